"""Two (or more) spawned processes for the distributed tests: a free port, start, join with a deadline."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _then_exit(rank: int, worker, *args) -> None:
    """Run one worker; once it has returned, end the process without interpreter teardown. Gloo's
    threads can abort a process at teardown ("terminate called without an active exception"), which
    would fail a worker that had already passed; a worker that raises still fails as before."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, args: tuple, *, nprocs: int = 2, timeout: float = 300, what: str = "workers") -> None:
    """Run ``worker(rank, free port, *args)`` in ``nprocs`` spawned processes; fail the test if
    one raises (its traceback is in the error) or they take longer than ``timeout`` seconds."""
    ctx = mp.start_processes(
        _then_exit, args=(worker, free_port(), *args), nprocs=nprocs, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):  # raises if a worker failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs} {what} did not finish within {timeout} s")


def save_rank_results(out, rank: int, results: dict) -> None:
    """A worker's last act: its results as host copies (ranks' tensors lived on different
    devices) to ``out/rank{rank}.pt``, then a barrier (rank 1 waits for rank 0's extra runs) and
    the process group's end."""
    import torch.distributed as dist  # noqa: PLC0415  (workers only)
    import torch.utils._pytree as pytree  # noqa: PLC0415

    results = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), results)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def spawn_pair_results(worker, out, device_type: str = "cpu", timeout: float = 300) -> list[dict]:
    """Run ``worker(rank, port, out, device_type)`` in two spawned ranks (gloo on the CPU, NCCL on
    two GPUs) and load what each saved to ``out/rank{r}.pt``."""
    spawn(worker, (str(out), device_type), timeout=timeout, what=f"{device_type} workers")
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
