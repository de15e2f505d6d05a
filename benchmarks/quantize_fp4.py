"""Benchmark: packed-FP4 quantize (+ amax record) and dequantize, both layouts, against the copy
ceiling, the pure-torch reference run eagerly on CUDA and torch.compile of that reference.

For 2^20 ... 2^28 bf16 elements (rows of 4096), in one run and for NVFP4 and MXFP4:

* copy: a bf16 device-to-device copy of the same elements (the ceiling; read + write counted);
* eager / compile: ``quantize_fp4_reference`` plus the amax fold, eagerly and under
  torch.compile (reported as n/a if compilation fails);
* ours: ``fp8state::quantize_fp4_record_amax`` (the training hot path), and the centered
  variant ``quantize_fp4_centered_record`` (records the amax and per-channel max/min);
* dequantize: ``fp8state::dequantize_fp4`` to bf16, and the eager reference.

Effective GB/s count the ideal bytes: quantize reads 2 bytes and writes 0.5 + 1/block bytes
per element; dequantize reads 0.5 + 1/block and writes 2. Medians of CUDA-event-timed calls;
inputs rotate when they would fit in L2, so the times are HBM's. Prints a table per layout;
``--json PATH`` writes every number.

    python benchmarks/quantize_fp4.py [--min-log2 20] [--max-log2 28] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms

from lightning_fp8state import ops
from lightning_fp8state.formats import FP4_LAYOUTS

K = 4096


def bench(fn, reps: int = 50) -> float:
    """Median milliseconds (CUDA events); fewer runs for slow functions."""
    return median_ms(fn, reps=reps, warmup=3, budget_s=1.5)


def reference_record(x, scale, pending, layout):
    """What the op does, in plain torch: the reference quantize and the amax fold."""
    pending.copy_(torch.maximum(pending, ops.fp4_amax_reference(x).reshape(1)))
    return ops.quantize_fp4_reference(x, scale, None, layout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-log2", type=int, default=20)
    parser.add_argument("--max-log2", type=int, default=28)
    parser.add_argument("--layouts", default="nvfp4,mxfp4")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    assert ops.cuda.ensure_loaded(), ops.cuda.extension_info()
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "extension": ops.cuda.extension_info(), "runs": []}
    compiled = torch.compile(reference_record, dynamic=True)  # one compilation per layout
    tables = {}
    for layout in args.layouts.split(","):
        block = FP4_LAYOUTS[layout].block_size
        fmax = FP4_LAYOUTS[layout].tensor_fmax
        rows_out = []
        for log2 in range(args.min_log2, args.max_log2 + 1, 2):
            n = 1 << log2
            shape = (n // K, K)
            copies = max(1, (256 << 20) // (2 * n))  # rotate inputs that fit in L2
            xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 8))]
            dst = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
            scale = torch.tensor([fmax / 4.0], device="cuda")
            descale = 1 / scale
            center = torch.randn(K, device="cuda") * 0.1
            pending = torch.zeros(1, device="cuda")
            cmax = torch.full((1, K), float("-inf"), device="cuda")
            cmin = torch.full((1, K), float("inf"), device="cuda")
            it = {"i": 0}

            def pick(xs=xs, it=it):
                it["i"] = (it["i"] + 1) % len(xs)
                return xs[it["i"]]

            ms = {"copy": bench(lambda: dst.copy_(pick()))}
            ms["ours"] = bench(lambda: ops.quantize_fp4_record_amax(pick(), scale, pending, 0, layout))
            ms["ours_centered"] = bench(
                lambda: ops.quantize_fp4_centered_record(pick(), scale, center, pending, cmax, cmin, 0, layout)
            )
            ms["eager"] = bench(lambda: reference_record(pick(), scale, pending, layout), reps=10)
            try:
                ms["compile"] = bench(lambda: compiled(pick(), scale, pending, layout), reps=20)
            except Exception as exc:  # noqa: BLE001  (report, keep benchmarking)
                print(f"torch.compile of the reference failed ({type(exc).__name__}); reported as n/a")
                ms["compile"] = None
            packed = [ops.quantize_fp4(x, scale, layout) for x in xs]
            jt = {"i": 0}

            def pick_packed(packed=packed, jt=jt):
                jt["i"] = (jt["i"] + 1) % len(packed)
                return packed[jt["i"]]

            ms["dequant"] = bench(lambda: ops.dequantize_fp4(*pick_packed(), descale, layout, torch.bfloat16))
            ms["dequant_eager"] = bench(
                lambda: ops.dequantize_fp4_reference(*pick_packed(), descale, None, layout, torch.bfloat16), reps=10
            )
            q_bytes = n * (2 + 0.5 + 1 / block)
            gbs = {
                key: (q_bytes / ms[key] / 1e6 if ms[key] else None)
                for key in ("ours", "ours_centered", "eager", "compile")
            }
            gbs["copy"] = 4 * n / ms["copy"] / 1e6
            gbs["dequant"] = q_bytes / ms["dequant"] / 1e6
            gbs["dequant_eager"] = q_bytes / ms["dequant_eager"] / 1e6
            results["runs"].append({"layout": layout, "log2": log2, "elements": n, "ms": ms, "GBs": gbs})
            rows_out.append((log2, gbs))
            del xs, packed
            torch.cuda.empty_cache()
        tables[layout] = rows_out

    def fmt(v, w=9, p=0):
        return f"{v:{w}.{p}f}" if v is not None else f"{'n/a':>{w}}"

    print(f"device: {dev}, torch {torch.__version__}")
    print(f"extension: {results['extension'].get('library')} sha256 {results['extension'].get('sha256')}")
    for layout, rows_out in tables.items():
        block = FP4_LAYOUTS[layout].block_size
        print(
            f"\n{layout}: bf16 [n/{K}, {K}] -> packed E2M1 + block scales, with amax record; GB/s of ideal bytes "
            f"(2 + 0.5 + 1/{block} per element); copy counts read + write"
        )
        print(
            f"{'n':<6} {'copy':>9} {'eager':>9} {'compile':>9} {'ours':>9} {'/copy':>7} {'/compile':>8} "
            f"{'/eager':>7} {'centered':>9} {'/copy':>7} {'deq-eager':>9} {'dequant':>9} {'/copy':>7}"
        )
        for log2, g in rows_out:
            comp_ratio = g["ours"] / g["compile"] if g["compile"] else None
            print(
                f"2^{log2:<4} {fmt(g['copy'])} {fmt(g['eager'])} {fmt(g['compile'])} {fmt(g['ours'])} "
                f"{fmt(g['ours'] / g['copy'], 7, 3)} {fmt(comp_ratio, 8, 1)} {fmt(g['ours'] / g['eager'], 7, 1)} "
                f"{fmt(g['ours_centered'])} {fmt(g['ours_centered'] / g['copy'], 7, 3)} {fmt(g['dequant_eager'])} "
                f"{fmt(g['dequant'])} {fmt(g['dequant'] / g['copy'], 7, 3)}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
