"""Shared timing for the benchmarks: CUDA-event medians after a warm-up."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["median_ms"]


def median_ms(fn, reps: int = 50, warmup: int = 5, budget_s: float | None = None) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, each timed with CUDA events;
    with ``budget_s``, fewer runs (at least 3) for functions too slow to repeat ``reps`` times."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if budget_s is not None:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        reps = max(3, min(reps, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
