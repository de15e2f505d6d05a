"""Benchmark: a recipe through ``fp8state train`` (Lightning, the user's path), FP8 safe against
the same command with ``quant.recipe=bf16``, in one run.

Each run trains ``--steps`` steps; its throughput is the effective tokens/s (applied steps
only) over the logged windows after ``--skip-windows`` warm-up windows. Prints both and
the ratio FP8 / bf16. At the 124M shape the eager loop is host-bound and the host of a shared
machine is noisy: ``--repeat N`` runs the pair N times, interleaved (fp8, bf16, fp8, ...), and
compares each variant's fastest run (every run's number is kept in the JSON). Overrides apply
to both, e.g. ``trainer.compile=true``.

    python benchmarks/recipe_speed.py --out DIR [--recipe gpt_124m_h200] [--steps 120] [--repeat 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from scaling import throughput, train


def _or_minus_inf(v: float) -> float:
    """A failed run (NaN) never counts as the fastest."""
    return float("-inf") if math.isnan(v) else v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt_124m_h200")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip-windows", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="run the pair this many times, interleaved; keep the fastest")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        args.recipe,
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=10",
        f"trainer.max_steps={args.steps}",
        "trainer.checkpoint_every_n_steps=100000",
        *args.overrides,
    ]
    result = {"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "repeat": args.repeat}
    for rep in range(args.repeat):
        for name, extra in (("fp8", []), ("bf16", ["quant.recipe=bf16"])):
            run_name = name if args.repeat == 1 else f"{name}_{rep}"
            code, rows = train(out, run_name, [*common, *extra])
            tps = throughput(rows, args.skip_windows, "train/effective_tokens_per_s") if code == 0 else float("nan")
            loss = rows[-1]["train/loss"] if rows else float("nan")
            runs = result.setdefault(name, {"runs": []})["runs"]
            runs.append({"effective_tokens_per_s": tps, "exit": code, "final_loss": loss})
            tag = f" [repeat {rep + 1}/{args.repeat}]" if args.repeat > 1 else ""
            print(f"{name:>5}{tag}: {tps:,.0f} effective tokens/s, exit {code}, final loss {loss:.4f}", flush=True)
    for name in ("fp8", "bf16"):
        best = max(result[name]["runs"], key=lambda r: _or_minus_inf(r["effective_tokens_per_s"]))
        result[name].update(best)
    ratio = result["fp8"]["effective_tokens_per_s"] / result["bf16"]["effective_tokens_per_s"]
    result["fp8_over_bf16"] = ratio
    print(f"FP8 / bf16 effective tokens/s: {ratio:.3f}")
    (out / "recipe_speed.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
