"""Two (or more) spawned processes for the distributed tests: a free port, start, join with a deadline."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, args: tuple, *, nprocs: int = 2, timeout: float = 300, what: str = "workers") -> None:
    """Run ``worker(rank, free port, *args)`` in ``nprocs`` spawned processes; fail the test if
    one raises (its traceback is in the error) or they take longer than ``timeout`` seconds."""
    ctx = mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):  # raises if a worker failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs} {what} did not finish within {timeout} s")
