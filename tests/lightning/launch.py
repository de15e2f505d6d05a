"""Run a plan of scenario fits (tests/lightning/scenarios.py) in fresh processes and load what each rank saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


# Set in this process by in-process distributed tests; a child that inherits them believes it
# is already one rank of a launched job and waits for peers that never come.
LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


def launch_env() -> dict[str, str]:
    """This process's environment without the variables that mark a process as a launched rank."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}


def run_plan(plan: list[dict], out: Path, *, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Start ``python -m tests.lightning.scenarios`` as rank 0 (Lightning launches the rest).

    Raises AssertionError with the processes' output when the run times out, or fails and
    ``check`` is on (``check=False``: a failure is returned, for tests of refusals).
    """
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "tests.lightning.scenarios", str(plan_path), str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"scenario plan timed out after {timeout}s:\n{exc.stdout}\n{exc.stderr}") from exc
    assert proc.returncode == 0 or not check, (
        f"scenario plan failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc


def load_ranks(out: Path, name: str, world_size: int) -> list[dict]:
    """What each rank of run ``name`` recorded, indexed by rank."""
    return [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
