"""Diagnostic: is each GEMM of the stateless recipes bitwise repeatable on this GPU, called
eagerly five times and replayed from a CUDA graph captured on a side stream (as GraphedStep and
GraphedBlocks capture)? Per shape ``M x N x K`` and backend: the per-tensor ``_scaled_mm``
(fp8_current), the rowwise ``_scaled_mm`` and the rowwise float32 emulation (fp8_rowwise with an
E5M2 operand), and a bf16 ``torch.mm`` as the control.

    python benchmarks/gemm_determinism.py
"""

from __future__ import annotations

import torch

from lightning_fp8state.ops.library_dynamic import quantize_fp8_current, quantize_fp8_rowwise
from lightning_fp8state.quant_recipes.gemm import scaled_matmul
from lightning_fp8state.quant_recipes.rowwise import rowwise_matmul

E4M3 = torch.float8_e4m3fn
SHAPES = [(512, 128, 128), (512, 384, 128), (128, 128, 512), (384, 128, 512), (4096, 1024, 1024), (1024, 1024, 16384)]


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    return out


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'M x N x K':>20} {'backend':>18} {'eager repeat':>13} {'graph == eager':>15}")
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        ra, _, da, _ = quantize_fp8_rowwise(a, E4M3, 0)
        rw, _, dw, _ = quantize_fp8_rowwise(w, E4M3, 0)
        ta, _, tda, _ = quantize_fp8_current(a, E4M3, 0)
        tw, _, tdw, _ = quantize_fp8_current(w, E4M3, 0)
        cases = {
            "per-tensor mm": lambda: scaled_matmul(ta, tw.t(), tda, tdw, torch.bfloat16, "scaled_mm", None),
            "rowwise mm": lambda: rowwise_matmul(ra, rw.t(), da, dw.t(), torch.bfloat16, "scaled_mm", None),
            "rowwise emulated": lambda: rowwise_matmul(ra, rw.t(), da, dw.t(), torch.bfloat16, "emulated", None),
            "bf16 mm (control)": lambda: a @ w.t(),
        }
        for name, fn in cases.items():
            try:
                outs = [fn().clone() for _ in range(5)]
                repeat = all(torch.equal(outs[0], o) for o in outs[1:])
                same = torch.equal(outs[0], graphed(fn))
                print(f"{f'{m} x {n} x {k}':>20} {name:>18} {str(repeat):>13} {str(same):>15}")
            except Exception as e:  # a backend this GPU or shape does not take
                print(f"{f'{m} x {n} x {k}':>20} {name:>18} error: {type(e).__name__}: {str(e)[:80]}")


if __name__ == "__main__":
    main()
