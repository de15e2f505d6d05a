"""Benchmark: the 2-GPU DeepSpeed recipe's scaling, and its resume, through ``fp8state train``.

1. Scaling: the recipe (default ``gpt_350m_h200x2_deepspeed``: ZeRO-2, activation
   checkpointing, bf16-mixed, FP8 safe mode, per-block CUDA graphs as it ships, strict ledger;
   ``trainer.cuda_graphs=false`` measures it eagerly) runs ``--steps`` steps on 1 and on
   2 GPUs with the same per-GPU batch. Throughput is the run's global tokens/s over the logged
   windows after ``--skip-windows`` warm-up windows. Scaling efficiency = tokens/s on 2 GPUs
   over twice that on 1. The ledger is strict (``quant.strict=true``): a protocol violation
   on any rank fails the run.
2. Resume (``--resume-steps N``, 2 GPUs, ``trainer.deterministic=true``): one run of N steps,
   and one of N/2 steps resumed to N (same LR schedule), compared on every logged step's
   loss and gradient norm, bitwise.

    python benchmarks/scaling.py --out DIR [--steps 60] [--resume-steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from lightning_fp8state.telemetry.sinks import read_jsonl


def train(out: Path, name: str, overrides: list[str], resume: bool = False) -> tuple[int, list[dict]]:
    run = out / name
    base = [sys.executable, "-m", "lightning_fp8state", "train"]
    cmd = [*base, "--resume", str(run), *overrides] if resume else [*base, *overrides, f"out_dir={out}", f"name={name}"]
    log = out / f"{name}{'_resume' if resume else ''}.log"
    with open(log, "w") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    rows = read_jsonl(run / "telemetry.jsonl") if (run / "telemetry.jsonl").is_file() else []
    if code != 0:
        print(f"{name}: exit {code}; tail of {log}:\n" + log.read_text()[-3000:])
    return code, rows


def throughput(rows: list[dict], skip: int, key: str = "train/tokens_per_s") -> float:
    """Tokens/s (``key``: raw or ``train/effective_tokens_per_s``) over the logged windows after
    the first ``skip``, weighted by each window's length."""
    windows = [r for r in rows if key in r][skip:]
    seconds = sum(r["train/window_seconds"] for r in windows)
    return sum(r[key] * r["train/window_seconds"] for r in windows) / max(seconds, 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt_350m_h200x2_deepspeed")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip-windows", type=int, default=2)
    p.add_argument("--resume-steps", type=int, default=0)
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        args.recipe,
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=10",
        "quant.strict=true",
        *args.overrides,
    ]
    result: dict = {"recipe": args.recipe, "overrides": args.overrides}
    if not args.skip_scaling:
        tps = {}
        for devices in (1, 2):
            steps = [f"trainer.max_steps={args.steps}", "trainer.checkpoint_every_n_steps=100000"]
            code, rows = train(out, f"scale{devices}", [*common, f"trainer.devices={devices}", *steps])
            tps[devices] = throughput(rows, args.skip_windows) if code == 0 else float("nan")
            loss = rows[-1]["train/loss"] if rows else float("nan")
            print(f"{devices} device(s): {tps[devices]:,.0f} tokens/s (global), exit {code}, final loss {loss:.4f}")
        eff = tps[2] / (2 * tps[1])
        print(f"scaling efficiency (2 devices / 2 x 1 device): {eff:.3f}")
        result.update(tokens_per_s=tps, scaling_efficiency=eff)
    if args.resume_steps:
        n, half = args.resume_steps, args.resume_steps // 2
        det = [*common, "trainer.devices=2", "trainer.deterministic=true", f"trainer.schedule_steps={n}"]
        every = f"trainer.checkpoint_every_n_steps={half}"
        _, whole = train(out, "whole", [*det, f"trainer.max_steps={n}", every])
        train(out, "split", [*det, f"trainer.max_steps={half}", every])
        code, split = train(out, "split", [f"trainer.max_steps={n}"], resume=True)
        keys = ("train/loss", "train/grad_norm")
        a = {r["step"]: [r.get(k) for k in keys] for r in whole if r["step"] > half}
        b = {r["step"]: [r.get(k) for k in keys] for r in split if r["step"] > half}
        same = bool(a) and a == b
        print(f"resume at {half} of {n} steps on 2 devices: exit {code}; steps {half + 1}..{n} bit-identical: {same}")
        if not same:
            for step in sorted(set(a) | set(b))[:5]:
                print(f"  step {step}: whole {a.get(step)} resumed {b.get(step)}")
        result.update(resume_bit_identical=same, resume_steps=n)
    (out / "scaling.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
