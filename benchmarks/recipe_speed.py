"""Benchmark: a recipe through ``fp8state train`` (Lightning, the user's path), FP8 safe against
the same command with ``quant.recipe=bf16``, in one run.

Each run trains ``--steps`` steps; its throughput is the effective tokens/s (applied steps
only) over the logged windows after ``--skip-windows`` warm-up windows. Prints both and
the ratio FP8 / bf16.

    python benchmarks/recipe_speed.py --out DIR [--recipe gpt_124m_h200] [--steps 120] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaling import throughput, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt_124m_h200")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip-windows", type=int, default=2)
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
    result = {"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps}
    for name, extra in (("fp8", []), ("bf16", ["quant.recipe=bf16"])):
        code, rows = train(out, name, [*common, *extra])
        tps = throughput(rows, args.skip_windows, "train/effective_tokens_per_s") if code == 0 else float("nan")
        loss = rows[-1]["train/loss"] if rows else float("nan")
        result[name] = {"effective_tokens_per_s": tps, "exit": code, "final_loss": loss}
        print(f"{name:>5}: {tps:,.0f} effective tokens/s, exit {code}, final loss {loss:.4f}", flush=True)
    ratio = result["fp8"]["effective_tokens_per_s"] / result["bf16"]["effective_tokens_per_s"]
    result["fp8_over_bf16"] = ratio
    print(f"FP8 / bf16 effective tokens/s: {ratio:.3f}")
    (out / "recipe_speed.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
