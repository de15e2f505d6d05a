"""Benchmark: what one GEMM call costs the host — FP8 ``torch._scaled_mm``, our ``scaled_matmul``
wrapper around it, and bf16 ``torch.mm`` / ``F.linear`` (the peers), in the same run.

At the 124M and 350M shapes the eager step is host-bound: the host issues a step slower than
the GPU runs it. This measures the host side of each GEMM entry point alone: ``--calls`` calls
issued back to back without a synchronization (the host's wall time per call), and the GPU's
time per call from CUDA events over the same calls (where host > GPU, the host sets the pace).

    python benchmarks/gemm_host.py [--calls 2000] [--shapes 1024x768x768 16384x1024x1024]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lightning_fp8state.nn import scaled_matmul


def _time(fn, calls: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--shapes", nargs="+", default=["256x768x768", "16384x1024x1024", "16384x4096x1024"])
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call, host issue / GPU")
    for spec in args.shapes:
        m, n, k = (int(v) for v in spec.split("x"))
        a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)  # [N, K]: b.t() is column-major
        sa, sb = torch.ones(1, device=dev), torch.ones(1, device=dev)
        bias32 = torch.randn(n, device=dev)
        bias16 = bias32.bfloat16()
        x16, w16 = a.bfloat16(), b.bfloat16()
        s0, s1 = sa.reshape(()), sb.reshape(())
        cases = {
            "torch._scaled_mm": lambda: torch._scaled_mm(a, b.t(), scale_a=s0, scale_b=s1, out_dtype=torch.bfloat16),
            "torch._scaled_mm + bias": lambda: torch._scaled_mm(
                a, b.t(), scale_a=s0, scale_b=s1, bias=bias16, out_dtype=torch.bfloat16
            ),
            "scaled_matmul + bias (ours)": lambda: scaled_matmul(a, b.t(), sa, sb, torch.bfloat16, "auto", bias32),
            "bf16 torch.mm": lambda: torch.mm(x16, w16.t()),
            "bf16 F.linear + bias": lambda: F.linear(x16, w16, bias16),
        }
        for name, fn in cases.items():
            host, gpu = _time(fn, args.calls)
            rows.append({"shape": spec, "case": name, "host_us": host, "gpu_us": gpu})
            print(f"  {spec:>18} {name:>28}: host {host:7.1f}  GPU {gpu:7.1f}  {'host-bound' if host > gpu else ''}")
    return rows


if __name__ == "__main__":
    main()
