"""A fixed workload of the FP4 quantize kernels, for Nsight Compute (the FP4 target of #4).

With ``--time`` it times each call instead (CUDA-event medians) against a device copy of the
same bf16 tensor, in effective GB/s (ideal bytes: 2 read + 0.5 written + one scale byte per
block): the quick check of one kernel change (``benchmarks/quantize_fp4.py`` is the full
benchmark with the peers).

Runs each variant (NVFP4 and MXFP4; plain, amax-recording, centered with statistics) on one
bf16 tensor of ``--n`` elements (rows of ``--k``), ``--reps`` times each, after one warm-up
call that builds the extension. Under ncu, profile only the kernels (``--clock-control none``
is what works on the device machines):

    ncu --clock-control none -k regex:quantize_fp4 --launch-skip 6 --launch-count 6 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/profile_fp4.py

What to read: DRAM throughput against the copy's (~4 TB/s), achieved occupancy and the
registers per thread (the centered kernel keeps 32 per-channel statistics), and the top
warp stall reasons (memory dependency means too little in flight; issue-bound kernels show
"selected"/"not selected" stalls and high issue-slot use).
"""

from __future__ import annotations

import argparse

import torch
from timing import median_ms

from lightning_fp8state import ops
from lightning_fp8state.formats import FP4_LAYOUTS

VARIANTS = ("plain", "record", "centered")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1 << 26)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--layouts", nargs="+", default=["nvfp4", "mxfp4"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--time", action="store_true", help="print GB/s against a device copy")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.n // args.k, args.k, device="cuda", generator=g).bfloat16()
    scale = torch.tensor([0.75], device="cuda")
    center = torch.randn(args.k, device="cuda", generator=g) * 0.1
    pending = torch.zeros(2, device="cuda")
    cmax = torch.full((2, args.k), float("-inf"), device="cuda")
    cmin = torch.full((2, args.k), float("inf"), device="cuda")
    calls = {
        "plain": lambda layout: ops.quantize_fp4(x, scale, layout),
        "record": lambda layout: ops.quantize_fp4_record_amax(x, scale, pending, 0, layout),
        "centered": lambda layout: ops.quantize_fp4_centered_record(x, scale, center, pending, cmax, cmin, 1, layout),
    }
    for layout in args.layouts:  # warm-up: one launch of each (builds the extension once)
        for v in args.variants:
            calls[v](layout)
    torch.cuda.synchronize()
    if args.time:
        y = torch.empty_like(x)
        copy_ms = median_ms(lambda: y.copy_(x))
        copy_gbs = 4 * x.numel() / copy_ms / 1e6
        print(f"copy {copy_ms:.3f} ms {copy_gbs:.0f} GB/s")
        for layout in args.layouts:
            ideal = x.numel() * (2.5 + 1 / FP4_LAYOUTS[layout].block_size)
            for v in args.variants:
                ms = median_ms(lambda v=v, layout=layout: calls[v](layout))
                gbs = ideal / ms / 1e6
                print(f"{layout} {v:9s} {ms:.3f} ms {gbs:.0f} GB/s {gbs / copy_gbs:.3f} of copy")
        return
    for layout in args.layouts:
        for v in args.variants:
            for _ in range(args.reps):
                calls[v](layout)
    torch.cuda.synchronize()
    print(f"ran {len(args.layouts) * len(args.variants) * args.reps} quantize launches on {x.shape} bf16")


if __name__ == "__main__":
    main()
