"""Benchmark: a Linear's input prologue (LayerNorm, GELU) fused with its FP8 quantize + amax.

For the shapes of the 1.2B GPT (16,384 tokens; d_model 2048, MLP 8192), in one run:
- ``unfused``: torch's op (``F.layer_norm`` on float32, ``F.gelu`` on bf16), then our
  quantize + amax kernel (what ``fuse_prologues=false`` runs);
- ``compile``: ``torch.compile`` of the whole reference composition (op, scale, clamp, cast, amax);
- ``ours``: the fused kernel (``ops.layer_norm_quantize_fp8`` / ``ops.gelu_quantize_fp8``);
- ``copy``: a device copy moving the fused op's ideal bytes (input read + codes written),
  the memory-bandwidth ceiling.
Medians of CUDA-event-timed calls; prints ms, the ideal-byte bandwidth and the ratios.

    python benchmarks/prologue.py [--tokens 16384 --d-model 2048 --mlp 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from timing import median_ms

from lightning_fp8state import ops

E4M3 = torch.float8_e4m3fn


def reference_ln(x, w, b, scale, pending):
    y = F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    pending.copy_(torch.maximum(pending, y.abs().amax().reshape(1)))
    return (y * scale).clamp(-448.0, 448.0).to(E4M3)


def reference_gelu(x, scale, pending):
    y = F.gelu(x)
    pending.copy_(torch.maximum(pending, y.abs().amax().float().reshape(1)))
    return (y.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def copy_ceiling(read_bytes: int, write_bytes: int):
    """A copy that reads ``read_bytes`` and writes ``write_bytes`` (two uint8 copies)."""
    src = torch.empty(read_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(write_bytes, dtype=torch.uint8, device="cuda")
    sink = torch.empty(read_bytes - write_bytes, dtype=torch.uint8, device="cuda") if read_bytes > write_bytes else None

    def run():
        dst.copy_(src[:write_bytes])
        if sink is not None:  # the rest of the reads (written once more: an upper bound on the cost)
            sink.copy_(src[write_bytes:])

    return run


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=8192)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    scale = torch.tensor([4.0], device="cuda")
    pending = torch.zeros(1, device="cuda")
    x = torch.randn(args.tokens, args.d_model, device="cuda") * 3 + 1
    w, b = torch.randn(args.d_model, device="cuda"), torch.randn(args.d_model, device="cuda")
    h = (torch.randn(args.tokens, args.mlp, device="cuda") * 2).to(torch.bfloat16)
    cases = [
        (
            "layer_norm fp32",
            x,
            lambda: ops.quantize_fp8_record_amax(F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), scale, pending, 0, E4M3),
            torch.compile(reference_ln),
            lambda f: f(x, w, b, scale, pending),
            lambda: ops.layer_norm_quantize_fp8(x, w, b, 1e-5, scale, E4M3, pending, 0),
        ),
        (
            "gelu bf16",
            h,
            lambda: ops.quantize_fp8_record_amax(F.gelu(h), scale, pending, 0, E4M3),
            torch.compile(reference_gelu),
            lambda f: f(h, scale, pending),
            lambda: ops.gelu_quantize_fp8(h, scale, E4M3, pending, 0),
        ),
    ]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'case':<16} {'shape':>14} {'copy ms':>8} {'unfused':>8} {'compile':>8} {'ours':>8} {'ours GB/s':>10} "
        f"{'/copy':>6} {'vs unfused':>10} {'vs compile':>10}"
    )
    results = []
    for name, inp, unfused, compiled, call_compiled, ours in cases:
        read, write = inp.numel() * inp.element_size(), inp.numel()
        t_copy = median_ms(copy_ceiling(read, write))
        t_unfused = median_ms(unfused)
        t_compile = median_ms(lambda c=compiled, cc=call_compiled: cc(c))
        t_ours = median_ms(ours)
        gbs = (read + write) / t_ours / 1e6
        row = {
            "case": name,
            "shape": list(inp.shape),
            "ms": {"copy": t_copy, "unfused": t_unfused, "compile": t_compile, "ours": t_ours},
            "ours_gbs": gbs,
        }
        results.append(row)
        print(
            f"{name:<16} {str(tuple(inp.shape)):>14} {t_copy:8.3f} {t_unfused:8.3f} {t_compile:8.3f} {t_ours:8.3f} "
            f"{gbs:10.0f} {t_copy / t_ours:6.2f} {t_unfused / t_ours:9.2f}x {t_compile / t_ours:9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
