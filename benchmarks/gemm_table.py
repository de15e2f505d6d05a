"""Benchmark: measure this GPU's bf16 and FP8 GEMM speeds over a grid of shapes and write them
into the GEMM table that ``quant.policy.by_size`` reads (``configs/gemm/tables.yaml``).

For each ``(m, n, k)`` of the grid (every size for each of m, n and k: a Linear's forward,
input-gradient and weight-gradient GEMMs each take a different one of its shapes as ``k``) it
times, best of ``--reps`` runs with CUDA events after a warm-up:

- ``bf16_ms``: ``torch.mm`` of a bf16 ``[m, k]`` by the transpose of a bf16 ``[n, k]`` (the peer);
- ``fp8_ms``: ``torch._scaled_mm`` of the same operands in E4M3 with per-tensor scales, bf16 out;
- ``cast_ms``: quantizing both operands from bf16 to E4M3, which the policy adds to the FP8 time.
  ``--cast ours`` (the default where the CUDA extension loads) times the fused quantize-and-record-
  amax kernel a delayed-scaling call runs per operand; ``--cast torch`` times torch ops (amax, scale,
  cast: several kernels each, an upper bound that makes small GEMMs look hopeless). Either is
  conservative: a weight is quantized once per step, not per GEMM, and an input whose norm or
  activation is fused into its encode costs no pass of its own.

The device's entry (keyed by ``torch.cuda.get_device_name()``) is added to ``--out`` or replaces
the one there; other devices' entries are kept.

    python benchmarks/gemm_table.py [--sizes 512 1024 2048 4096 8192 16384] [--reps 10]
        [--out configs/gemm/tables.yaml]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
from pathlib import Path

import torch
import yaml

from lightning_fp8state.nn.policy import GEMM_TABLE_FORMAT
from lightning_fp8state.ops import cuda

HEADER = """\
# Measured GEMM speeds per device, read by quant.policy.by_size (lightning_fp8state/nn/policy.py).
# Not a recipe piece. Written by benchmarks/gemm_table.py on the device it measures (never by
# hand), keyed by torch.cuda.get_device_name(). Each shape: (m x k) @ (k x n), best of N runs
# of a CUDA graph of 20 calls timed with CUDA events (GPU time, launches not counted). bf16_ms:
# torch.mm in bfloat16; fp8_ms: torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales);
# cast_ms: quantizing both operands to e4m3 (the entry's "casts" says how: the fused quantize
# kernel, or torch ops).
"""
E4M3_MAX = 448.0


def best_ms(fn, reps: int, warmup: int = 3, inner: int = 20) -> float:
    """The fastest of ``reps`` runs of ``fn()`` in ms: GPU time, each run a CUDA graph replay of
    ``inner`` calls timed with CUDA events, so that the host's launches (which a compiled or
    graphed training step does not pay per kernel) do not count."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / inner)
    del graph
    return best


def to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in E4M3 at a per-tensor scale from its amax, and the inverse scale."""
    scale = E4M3_MAX / x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


def our_cast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in E4M3 through the fused delayed-scaling kernel (one pass: scale, cast, amax)."""
    scale = torch.ones((), device=x.device)
    pending = torch.zeros(1, device=x.device)
    return torch.ops.fp8state.quantize_fp8_record_amax(x, scale, pending, 0, torch.float8_e4m3fn)


def measure(m: int, n: int, k: int, reps: int, cast: str = "torch") -> dict:
    """One shape's row of the table (``cast``: how the operands' quantize is timed)."""
    dev = torch.device("cuda")
    a, b = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    (a8, sa), (b8, sb) = to_e4m3(a), to_e4m3(b)
    bt, b8t = b.t(), b8.t()  # [k, n] column-major, as a Linear's weight is used
    row = {"m": m, "n": n, "k": k}
    row["bf16_ms"] = round(best_ms(lambda: torch.mm(a, bt), reps), 5)
    row["fp8_ms"] = round(
        best_ms(lambda: torch._scaled_mm(a8, b8t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), reps), 5
    )
    quantize = our_cast if cast == "ours" else to_e4m3
    row["cast_ms"] = round(best_ms(lambda: (quantize(a), quantize(b)), reps), 5)
    return row


def write_table(path: Path, device: str, rows: list[dict], cast: str = "torch") -> None:
    """Add (or replace) ``device``'s entry in the table at ``path``, keeping the others."""
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    data = data if isinstance(data, dict) and data.get("format") == GEMM_TABLE_FORMAT else {}
    devices = dict(data.get("devices") or {})
    devices[device] = {
        "torch": str(torch.__version__),
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "casts": "fused quantize kernel" if cast == "ours" else "torch ops",
        "shapes": rows,
    }
    body = yaml.safe_dump({"format": GEMM_TABLE_FORMAT, "version": 1, "devices": devices}, sort_keys=False)
    path.write_text(HEADER + body)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--reps", type=int, default=10, help="runs per GEMM; the best is kept")
    p.add_argument("--cast", choices=("ours", "torch"), default=None, help="how the casts are timed (see above)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "configs/gemm/tables.yaml")
    args = p.parse_args(argv)
    device = torch.cuda.get_device_name()
    if args.cast is None:
        args.cast = "ours" if cuda.ensure_loaded() else "torch"
    print(f"device: {device}, torch {torch.__version__}; best of {args.reps}, ms; casts timed with {args.cast}")
    print(f"{'m':>6} {'n':>6} {'k':>6} {'bf16':>9} {'fp8':>9} {'casts':>9} {'gain':>6}")
    rows = []
    for m, n, k in itertools.product(args.sizes, repeat=3):
        row = measure(m, n, k, args.reps, args.cast)
        rows.append(row)
        gain = row["bf16_ms"] / (row["fp8_ms"] + row["cast_ms"])
        print(f"{m:>6} {n:>6} {k:>6} {row['bf16_ms']:>9.4f} {row['fp8_ms']:>9.4f} {row['cast_ms']:>9.4f} {gain:>5.2f}x")
        torch.cuda.empty_cache()
    write_table(args.out, device, rows, args.cast)
    print(f"wrote {len(rows)} shapes for {device!r} to {args.out}")
    return rows


if __name__ == "__main__":
    main()
