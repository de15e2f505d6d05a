"""Benchmark: fused FP8 quantize + amax against the copy ceiling, torch eager and torch.compile.

For 2^20 ... 2^28 bf16 elements, in one run: a device copy of the same bytes (the ceiling),
torch eager quantize + amax, torch.compile of the same function, and ours
(``fp8state::quantize_fp8_record_amax``). Effective bandwidth counts the ideal bytes:
2 read + 1 written per element. Then dequantize, and the batched scale update for 1, 64
and 1024 owners (one launch each). Prints a table; ``--json PATH`` writes the numbers.

    python benchmarks/quantize.py [--max-log2 28] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms as bench

from lightning_fp8state import ops


def eager_quantize_amax(x, scale, pending):
    pending.copy_(torch.maximum(pending, x.abs().amax().float().reshape(1)))
    return (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-log2", type=int, default=20)
    parser.add_argument("--max-log2", type=int, default=28)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    assert ops.cuda.ensure_loaded(), ops.cuda.extension_info()
    dev = torch.cuda.get_device_name()
    compiled = torch.compile(eager_quantize_amax)
    rows, results = [], {"device": dev, "torch": torch.__version__, "quantize": [], "update": []}
    scale = torch.tensor([0.75], device="cuda")
    for log2 in range(args.min_log2, args.max_log2 + 1, 2):
        n = 1 << log2
        # rotate several inputs when they would fit in L2, so we time HBM, not the cache
        copies = max(1, (256 << 20) // (2 * n))
        xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(min(copies, 8))]
        dst = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        pending = torch.zeros(1, device="cuda")
        it = {"i": 0}

        def pick():
            it["i"] = (it["i"] + 1) % len(xs)
            return xs[it["i"]]

        t_copy = bench(lambda: dst.copy_(pick()))
        t_eager = bench(lambda: eager_quantize_amax(pick(), scale, pending))
        t_comp = bench(lambda: compiled(pick(), scale, pending))
        t_ours = bench(lambda: ops.quantize_fp8_record_amax(pick(), scale, pending, 0, torch.float8_e4m3fn))
        q = ops.quantize_fp8(xs[0], scale, torch.float8_e4m3fn)
        t_deq = bench(lambda: ops.dequantize_fp8(q, scale, torch.bfloat16))
        copy_gbs = 4 * n / t_copy / 1e6  # bytes read + written
        ideal = 3 * n
        gbs = {k: ideal / t / 1e6 for k, t in (("eager", t_eager), ("compile", t_comp), ("ours", t_ours))}
        deq_gbs = 3 * n / t_deq / 1e6
        results["quantize"].append(
            {
                "log2": log2,
                "copy_GBs": copy_gbs,
                "ms": {"copy": t_copy, "eager": t_eager, "compile": t_comp, "ours": t_ours, "dequant": t_deq},
                "GBs": gbs,
                "dequant_GBs": deq_gbs,
            }
        )
        rows.append(
            f"2^{log2:<3} {copy_gbs:9.0f} {gbs['eager']:9.0f} {gbs['compile']:9.0f} {gbs['ours']:9.0f} "
            f"{gbs['ours'] / copy_gbs:8.3f} {gbs['ours'] / gbs['compile']:8.2f} {gbs['ours'] / gbs['eager']:8.1f} "
            f"{deq_gbs:9.0f}"
        )

    print(f"device: {dev}, torch {torch.__version__}")
    print("FP8 E4M3 quantize + amax from bf16; GB/s of ideal bytes (3 per element); copy counts read+write")
    print(
        f"{'n':<6} {'copy':>9} {'eager':>9} {'compile':>9} {'ours':>9} {'/copy':>8} {'/compile':>8} {'/eager':>8} "
        f"{'dequant':>9}"
    )
    print("\n".join(rows))
    print("\nbatched scale update (history 16), one launch:")
    for n in (1, 64, 1024):
        bank = [
            torch.rand(16, n, device="cuda"),
            torch.ones(n, device="cuda"),
            torch.ones(n, device="cuda"),
            torch.rand(n, device="cuda"),
            torch.zeros(n, dtype=torch.int32, device="cuda"),
            torch.ones(n, dtype=torch.bool, device="cuda"),
            torch.full((n,), 448.0, device="cuda"),
        ]
        t_ours = bench(lambda b=bank: ops.update_scales(*b, "max", 0), reps=200)
        t_ref = bench(lambda b=bank: ops.update_scales_reference(*b, "max", 0), reps=200)
        # kernel-only time: capture 20 launches in a CUDA graph and divide
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ops.update_scales(*bank, "max", 0)
            with torch.cuda.graph(g, stream=s):
                for _ in range(20):
                    ops.update_scales(*bank, "max", 0)
        torch.cuda.current_stream().wait_stream(s)
        t_graph = bench(g.replay, reps=100) / 20
        results["update"].append({"owners": n, "ms_call": t_ours, "ms_graph": t_graph, "ms_torch_eager": t_ref})
        print(
            f"  owners {n:5d}: ours {t_ours * 1e3:7.1f} us/call (host incl.), {t_graph * 1e3:6.2f} us/launch in a graph; "
            f"torch eager reference {t_ref * 1e3:7.1f} us"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
