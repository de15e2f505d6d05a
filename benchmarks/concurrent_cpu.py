"""Benchmark: ``fp8state train`` alone against two at once on the same CPU cores.

Each run trains the tiny CPU recipe for ``--steps`` steps; its speed is the optimizer steps per
second over its telemetry's logged windows after the first (start-up excluded). The lone run is
the peer measured in the same invocation: the table prints each concurrent run's it/s and its
ratio to the lone run's (the target: >= 0.5). ``--env KEY=VALUE`` sets the environment of every
run (e.g. ``OMP_NUM_THREADS=1`` for the comparison in docs/PERFORMANCE.md).

    python benchmarks/concurrent_cpu.py [--steps 300] [--env KEY=VALUE ...] [key=value overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, name: str, steps: int, overrides: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lightning_fp8state", "train", f"trainer.max_steps={steps}", f"name={name}"]
    cmd += [f"out_dir={out}", "telemetry.wandb=disabled", "telemetry.log_every_n_steps=25", *overrides]
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def steps_per_second(run_dir: Path) -> float:
    """Optimizer steps per second over the logged windows after the first one."""
    windows = []
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/window_seconds" in row:
            windows.append((row["train/window_steps"], row["train/window_seconds"]))
    windows = windows[1:] or windows
    return sum(s for s, _ in windows) / sum(t for _, t in windows)


def measure(steps: int, overrides: list[str], env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        lone = _run(out, "lone", steps, overrides, env)
        if lone.wait() != 0:
            raise SystemExit(f"the lone run failed: {lone.stderr.read()[-2000:]}")
        pair = [_run(out, f"pair{i}", steps, overrides, env) for i in range(2)]
        for p in pair:
            if p.wait() != 0:
                raise SystemExit(f"a concurrent run failed: {p.stderr.read()[-2000:]}")
        return {
            "lone": steps_per_second(out / "lone"),
            "pair": [steps_per_second(out / f"pair{i}") for i in range(2)],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    t0 = time.perf_counter()
    r = measure(args.steps, args.overrides, env)
    print(f"cores usable: {cores}; env: {env or '-'}; {args.steps} steps each ({time.perf_counter() - t0:.0f} s)")
    print(f"{'run':<12}{'it/s':>8}{'x lone':>8}")
    print(f"{'alone':<12}{r['lone']:>8.2f}{1.0:>8.2f}")
    for i, v in enumerate(r["pair"]):
        print(f"{f'together {i + 1}':<12}{v:>8.2f}{v / r['lone']:>8.2f}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
