"""Benchmark: a Linear's input prologue (LayerNorm, GELU, RMSNorm, SwiGLU) fused with its FP8
quantize + amax.

For the shapes of the 1.2B GPT (16,384 tokens; d_model 2048, MLP 8192) and of Llama (8,192
tokens; d_model 2048 and 4096; SwiGLU width 8192 and 14336, bf16 activations), in one run:
- ``unfused``: torch's op (``F.layer_norm`` on float32, ``F.gelu`` on bf16, Hugging Face's
  RMSNorm, ``F.silu(gate) * up``), then our quantize + amax kernel (what ``fuse_prologues=false``
  runs);
- ``eager``: the whole reference composition (op, amax, scale, clamp, cast) in eager torch;
- ``compile``: ``torch.compile`` of that composition;
- ``ours``: the fused kernel (``ops.layer_norm_quantize_fp8``, ``ops.gelu_quantize_fp8``,
  ``ops.rms_norm_quantize_fp8``, ``ops.swiglu_quantize_fp8``);
- ``copy``: a device copy moving the fused op's ideal bytes (input read + codes written),
  the memory-bandwidth ceiling.
Medians of CUDA-event-timed calls; prints ms, the ideal-byte bandwidth, its ratio to the copy's
(``/copy``: 1.00 is the ceiling) and the speedups.

    python benchmarks/prologue.py [--family gpt|llama|all] [--tokens 16384 --d-model 2048 --mlp 8192]
        [--llama-tokens 8192 --llama-d 2048 4096 --llama-inter 8192 14336] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from timing import median_ms

from lightning_fp8state import ops

E4M3 = torch.float8_e4m3fn


class Case(NamedTuple):
    name: str
    shape: tuple
    read: int  # the fused op's ideal bytes: its input read ...
    write: int  # ... and its codes written (a norm's per-row statistics left out)
    unfused: Callable
    eager: Callable
    compiled: Callable
    ours: Callable


def _record_and_encode(y, scale, pending):
    pending.copy_(torch.maximum(pending, y.abs().amax().float().reshape(1)))
    return (y.float() * scale).clamp(-448.0, 448.0).to(E4M3)


def reference_ln(x, w, b, scale, pending):
    return _record_and_encode(F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), scale, pending)


def reference_gelu(x, scale, pending):
    return _record_and_encode(F.gelu(x), scale, pending)


def hf_rms_norm(x, w, eps: float = 1e-5):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_rms(x, w, scale, pending):
    return _record_and_encode(hf_rms_norm(x, w), scale, pending)


def swiglu_f32(h):
    gate, up = h.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_swiglu(h, scale, pending):
    return _record_and_encode(swiglu_f32(h), scale, pending)


def _torch_swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _case(name, inp, write, unfused, reference, args, ours) -> Case:
    compiled = torch.compile(reference)
    return Case(
        name,
        tuple(inp.shape),
        inp.numel() * inp.element_size(),
        write,
        unfused,
        lambda: reference(*args),
        lambda: compiled(*args),
        ours,
    )


def gpt_cases(args, scale, pending) -> list[Case]:
    x = torch.randn(args.tokens, args.d_model, device="cuda") * 3 + 1
    w, b = torch.randn(args.d_model, device="cuda"), torch.randn(args.d_model, device="cuda")
    h = (torch.randn(args.tokens, args.mlp, device="cuda") * 2).to(torch.bfloat16)
    ln = F.layer_norm
    return [
        _case(
            "layer_norm fp32",
            x,
            x.numel(),
            lambda: ops.quantize_fp8_record_amax(ln(x, (x.shape[-1],), w, b, 1e-5), scale, pending, 0, E4M3),
            reference_ln,
            (x, w, b, scale, pending),
            lambda: ops.layer_norm_quantize_fp8(x, w, b, 1e-5, scale, E4M3, pending, 0),
        ),
        _case(
            "gelu bf16",
            h,
            h.numel(),
            lambda: ops.quantize_fp8_record_amax(F.gelu(h), scale, pending, 0, E4M3),
            reference_gelu,
            (h, scale, pending),
            lambda: ops.gelu_quantize_fp8(h, scale, E4M3, pending, 0),
        ),
    ]


def llama_cases(args, scale, pending) -> list[Case]:
    cases = []
    for d in args.llama_d:
        x = (torch.randn(args.llama_tokens, d, device="cuda") * 3 + 1).to(torch.bfloat16)
        w = (1 + 0.2 * torch.randn(d, device="cuda")).to(torch.bfloat16)  # a bf16 model's weight
        w32 = w.float()  # what the prologue hands the kernel
        cases.append(
            _case(
                f"rms_norm bf16 d={d}",
                x,
                x.numel(),
                lambda x=x, w=w: ops.quantize_fp8_record_amax(hf_rms_norm(x, w), scale, pending, 0, E4M3),
                reference_rms,
                (x, w, scale, pending),
                lambda x=x, w32=w32: ops.rms_norm_quantize_fp8(x, w32, 1e-5, scale, E4M3, pending, 0),
            )
        )
    for inter in args.llama_inter:
        h = (torch.randn(args.llama_tokens, 2 * inter, device="cuda") * 2).to(torch.bfloat16)
        cases.append(
            _case(
                f"swiglu bf16 I={inter}",
                h,
                h.numel() // 2,
                lambda h=h: ops.quantize_fp8_record_amax(_torch_swiglu(h), scale, pending, 0, E4M3),
                reference_swiglu,
                (h, scale, pending),
                lambda h=h: ops.swiglu_quantize_fp8(h, scale, E4M3, pending, 0),
            )
        )
    return cases


def measure(case: Case) -> dict:
    t = {
        "copy": median_ms(copy_ceiling(case.read, case.write)),
        "unfused": median_ms(case.unfused),
        "eager": median_ms(case.eager),
        "compile": median_ms(case.compiled),
        "ours": median_ms(case.ours),
    }
    gbs = (case.read + case.write) / t["ours"] / 1e6
    return {"case": case.name, "shape": list(case.shape), "ms": t, "ours_gbs": gbs, "of_copy": t["copy"] / t["ours"]}


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
    p.add_argument("--family", choices=("gpt", "llama", "all"), default="all")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=8192)
    p.add_argument("--llama-tokens", type=int, default=8192)
    p.add_argument("--llama-d", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--llama-inter", type=int, nargs="+", default=[8192, 14336])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    scale = torch.tensor([4.0], device="cuda")
    pending = torch.zeros(1, device="cuda")
    cases = (gpt_cases(args, scale, pending) if args.family in ("gpt", "all") else []) + (
        llama_cases(args, scale, pending) if args.family in ("llama", "all") else []
    )
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'case':<22} {'shape':>14} {'copy ms':>8} {'unfused':>8} {'eager':>8} {'compile':>8} {'ours':>8} "
        f"{'ours GB/s':>10} {'/copy':>6} {'vs unfused':>10} {'vs eager':>9} {'vs compile':>10}"
    )
    results = []
    for case in cases:
        row = measure(case)
        results.append(row)
        t = row["ms"]
        print(
            f"{case.name:<22} {str(case.shape):>14} {t['copy']:8.3f} {t['unfused']:8.3f} {t['eager']:8.3f} "
            f"{t['compile']:8.3f} {t['ours']:8.3f} {row['ours_gbs']:10.0f} {row['of_copy']:6.2f} "
            f"{t['unfused'] / t['ours']:9.2f}x {t['eager'] / t['ours']:8.2f}x {t['compile'] / t['ours']:9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
