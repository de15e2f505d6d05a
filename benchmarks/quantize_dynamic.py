"""Benchmark: the stateless-scaling quantizes (``fp8_current``, ``fp8_rowwise``, ``fp8_blockwise``)
against the copy ceiling, torch eager and torch.compile of the same numerics.

For 2^20 ... 2^28 bf16 elements laid out ``[n / cols, cols]``, in one run: a device copy of the
same bytes (the ceiling; its GB/s count read + write), the pure-torch reference
(``ops/reference_dynamic.py``) eager and under ``torch.compile`` (how torchao derives its dynamic
scales: compiled torch), and ours (``fp8state::quantize_fp8_current`` / ``_rowwise`` / ``_colwise``; ``t+rowwise``: torch's transpose
copy then the rowwise kernel, the colwise operands before their kernel). Every
variant is timed as a CUDA graph of ``--calls`` calls (each in its best mode: no host launch
cost in any of them), over several inputs when they would fit in L2, so HBM is what is timed.
Effective bandwidth counts the ideal bytes: 2 read + 1 written per element (``block``: 2 written,
its codes in both layouts). ``/copy`` is ours over the copy ceiling (issue 28's target for rowwise:
>= 0.85 at 2^28; issue 45's for the blockwise encodes: near it). Also ours called eagerly (``ours
call``, host launch included). The blockwise rows (``ops/reference_blockwise.py``): ``tile`` (1x128
tiles: activations, gradients), ``tile_t`` (128x1 tiles written transposed: the weight gradient's
operands), ``block`` (128x128 blocks and the transpose's: weights), ``pair`` (a gradient's 1x128
tiles and 128x1 tiles transposed from one read) against ``tile+t`` (the two kernels, two reads).

    python benchmarks/quantize_dynamic.py [--cols 4096 8192] [--max-log2 28] [--json out.json]
    python benchmarks/quantize_dynamic.py --recipes tile tile_t block pair tile+t --cols 1024 4096   # issue 45
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms as bench

from lightning_fp8state import ops
from lightning_fp8state.ops import library_blockwise as blk
from lightning_fp8state.ops import library_dynamic as dyn
from lightning_fp8state.ops import reference_blockwise as ref_blk
from lightning_fp8state.ops import reference_dynamic as ref

E4M3 = torch.float8_e4m3fn


def graphed(fn, inputs, calls):
    """A CUDA graph of ``calls`` calls of ``fn`` over ``inputs`` in turn; returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in inputs:
            fn(x)  # warm-up (compile, allocator)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for i in range(calls):
                fn(inputs[i % len(inputs)])
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cols", type=int, nargs="+", default=[4096])
    parser.add_argument("--min-log2", type=int, default=20)
    parser.add_argument("--max-log2", type=int, default=28)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--recipes", nargs="+", default=None, help="only these rows (default: all)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    assert ops.cuda.ensure_loaded(), ops.cuda.extension_info()
    dev = torch.cuda.get_device_name()

    def no_pow2(op):  # the blockwise ops' signature with pow2=False (fp8_blockwise's scales)
        return lambda x, dtype, margin: op(x, dtype, margin, False)

    peers = {
        "current": (ref.quantize_fp8_current_reference, dyn.quantize_fp8_current),
        "rowwise": (ref.quantize_fp8_rowwise_reference, dyn.quantize_fp8_rowwise),
        # fp8_rowwise's backward operands: per-column scales, codes transposed; "t+rowwise" is what
        # the recipe ran before the colwise kernel (torch's transpose copy, then the rowwise kernel)
        "colwise": (ref.quantize_fp8_colwise_reference, dyn.quantize_fp8_colwise),
        "t+rowwise": (
            ref.quantize_fp8_colwise_reference,
            lambda x, dtype, margin: dyn.quantize_fp8_rowwise(x.t().contiguous(), dtype, margin),
        ),
        "tile": (no_pow2(ref_blk.quantize_fp8_tile_reference), no_pow2(blk.quantize_fp8_tile)),
        "tile_t": (no_pow2(ref_blk.quantize_fp8_tile_t_reference), no_pow2(blk.quantize_fp8_tile_t)),
        "block": (no_pow2(ref_blk.quantize_fp8_block_reference), no_pow2(blk.quantize_fp8_block)),
        # a gradient's two tilings: one kernel reading x once ("pair"), or the two kernels ("tile+t")
        "pair": (no_pow2(ref_blk.quantize_fp8_tile_pair_reference), no_pow2(blk.quantize_fp8_tile_pair)),
        "tile+t": (
            no_pow2(ref_blk.quantize_fp8_tile_pair_reference),
            lambda x, dtype, margin: (
                blk.quantize_fp8_tile(x, dtype, margin),
                blk.quantize_fp8_tile_t(x, dtype, margin),
            ),
        ),
    }
    written = {"block": 2, "pair": 2, "tile+t": 2}  # bytes written per element (both layouts); the others 1
    if args.recipes:
        peers = {
            k: v for k, v in peers.items() if k in args.recipes or (k == "colwise" and "t+rowwise" in args.recipes)
        }
    # one compiled graph per shape: past dynamo's recompile limit (8) a compiled peer would run its
    # reference eagerly and be reported as torch.compile (2026-12-04: the 4096-column rows)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = {k: torch.compile(v[0]) for k, v in peers.items() if k not in ("t+rowwise", "tile+t")}
    if "t+rowwise" in peers:
        compiled["t+rowwise"] = compiled["colwise"]
    if "tile+t" in peers:
        compiled["tile+t"] = compiled.get("pair") or torch.compile(peers["tile+t"][0])
    results = {"device": dev, "torch": torch.__version__, "rows": []}
    lines = []
    for cols in args.cols:
        for log2 in range(args.min_log2, args.max_log2 + 1, 2):
            n = 1 << log2
            copies = max(1, min(8, (256 << 20) // (2 * n)))  # rotate inputs that would fit in L2
            xs = [torch.randn(n // cols, cols, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            dst = torch.empty_like(xs[0])
            reps = 20 if log2 >= 26 else 50
            t_copy = bench(graphed(lambda x: dst.copy_(x), xs, args.calls), reps=reps) / args.calls
            copy_gbs = 4 * n / t_copy / 1e6
            for recipe, (reference, ours) in peers.items():
                t = {
                    "eager": bench(graphed(lambda x, f=reference: f(x, E4M3, 0), xs, args.calls), reps=reps),
                    "compile": bench(graphed(lambda x, r=recipe: compiled[r](x, E4M3, 0), xs, args.calls), reps=reps),
                    "ours": bench(graphed(lambda x, f=ours: f(x, E4M3, 0), xs, args.calls), reps=reps),
                }
                t = {k: v / args.calls for k, v in t.items()}
                t["ours_call"] = bench(lambda f=ours: f(xs[0], E4M3, 0), reps=reps)
                gbs = {k: (2 + written.get(recipe, 1)) * n / v / 1e6 for k, v in t.items()}
                results["rows"].append(
                    {"recipe": recipe, "cols": cols, "log2": log2, "copy_GBs": copy_gbs, "ms": t, "GBs": gbs}
                )
                lines.append(
                    f"{recipe:<9} {cols:>6} 2^{log2:<3} {copy_gbs:8.0f} {gbs['eager']:8.0f} {gbs['compile']:8.0f} "
                    f"{gbs['ours']:8.0f} {gbs['ours'] / copy_gbs:7.3f} {gbs['ours'] / gbs['compile']:9.2f} "
                    f"{gbs['ours_call']:10.0f}"
                )
    print(f"device: {dev}, torch {torch.__version__}")
    print("FP8 E4M3 stateless quantize from bf16 [n / cols, cols]; GB/s of ideal bytes (3 per element, block 4), each")
    print("variant a CUDA graph of calls; copy counts read + write; 'ours call': one eager call, host included")
    print(
        f"{'recipe':<9} {'cols':>6} {'n':<5} {'copy':>8} {'eager':>8} {'compile':>8} {'ours':>8} {'/copy':>7} "
        f"{'/compile':>9} {'ours call':>10}"
    )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
