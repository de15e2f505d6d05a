"""Shared timing for the benchmarks: CUDA-event medians after a warm-up, and a clean start for
a peak-memory window."""

from __future__ import annotations

import gc
import statistics
import time

import torch

__all__ = ["fresh_peak", "median_ms"]


def fresh_peak(device=None) -> float:
    """Start a peak-memory window clean and return the GiB still allocated (what earlier
    measurements of the process left; print it beside the peak). A measured model and its
    optimizer sit in reference cycles (a module and the hooks, closures and state that read it)
    and stay allocated until Python's cyclic collector runs: without the collection here, the
    previous variant's weights, gradients and optimizer state can count in the next one's peak."""
    gc.collect()
    if not torch.cuda.is_available():  # (a CPU run: the collection only)
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**30


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
