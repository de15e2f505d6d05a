"""Shared timing for the benchmarks: CUDA-event medians after a warm-up."""

from __future__ import annotations

import statistics

import torch

__all__ = ["median_ms"]


def median_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
