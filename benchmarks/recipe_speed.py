"""Benchmark: a recipe through ``fp8state train`` (Lightning, the user's path), FP8 safe against
the same command with ``quant.recipe=bf16``, in one run.

Each run trains ``--steps`` steps; its throughput is the effective tokens/s (applied steps
only) over the logged windows after ``--skip-windows`` warm-up windows. Prints both and
the ratio FP8 / bf16. At the 124M shape the eager loop is host-bound and the host of a shared
machine is noisy: ``--repeat N`` runs the pair N times, interleaved (fp8, bf16, fp8, ...), and
compares each variant's fastest run (every run's number is kept in the JSON). Overrides apply
to both, e.g. ``trainer.compile=true``.

``--modes`` runs each variant in several modes of the same loop, so that each is compared in its
own best mode (like with like): ``eager``, ``compile`` (``trainer.compile=true``), ``graphs``
(``trainer.cuda_graphs=true``: forward and backward replayed from a CUDA graph) and
``compile+graphs``; each sets both keys, whatever the recipe ships. The default mode,
``recipe``, runs the recipe as it ships (the H200 recipes: ``trainer.cuda_graphs=true``). It
prints the ratio per mode, each variant's best mode, and FP8's best over bf16's best.

    python benchmarks/recipe_speed.py --out DIR [--recipe gpt_124m_h200] [--steps 120] [--repeat 3]
                                      [key=value ...] [--modes eager graphs]   (--modes last: it takes a list)
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


# each mode but "recipe" (as the recipe ships) sets both switches: the H200 recipes ship with
# trainer.cuda_graphs=true
MODES = {
    "recipe": [],
    "eager": ["trainer.compile=false", "trainer.cuda_graphs=false"],
    "compile": ["trainer.compile=true", "trainer.cuda_graphs=false"],
    "graphs": ["trainer.compile=false", "trainer.cuda_graphs=true"],
    "compile+graphs": ["trainer.compile=true", "trainer.cuda_graphs=true"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt_124m_h200")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--skip-windows", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="run the pair this many times, interleaved; keep the fastest")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["recipe"])
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="write each run's final checkpoint (by default trainer.enable_checkpointing=false: the 1B recipes write ~14 GiB, the Mixtral one 68)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=["fp8", "bf16"],
        default=["fp8", "bf16"],
        help="run only these (one alone prints no ratio: an A/B of an FP8 setting against a bf16 run measured before)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides for both runs (after `--` when following --modes)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        args.recipe,
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=10",
        f"trainer.max_steps={args.steps}",
        # the throughput is in the telemetry; the disk is finite (the Mixtral recipe's checkpoint is 68 GiB)
        *(
            ["trainer.checkpoint_every_n_steps=100000"]
            if args.keep_checkpoints
            else ["trainer.enable_checkpointing=false"]
        ),
        *args.overrides,
    ]
    result = {"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "repeat": args.repeat}
    variants = tuple(v for v in (("fp8", []), ("bf16", ["quant.recipe=bf16"])) if v[0] in args.variants)
    for rep in range(args.repeat):
        for mode in args.modes:
            for name, extra in variants:
                key = name if args.modes == ["recipe"] else f"{name} {mode}"
                run_name = key.replace(" ", "_").replace("+", "_")
                run_name = run_name if args.repeat == 1 else f"{run_name}_{rep}"
                code, rows = train(out, run_name, [*common, *MODES[mode], *extra])
                tps = throughput(rows, args.skip_windows, "train/effective_tokens_per_s") if code == 0 else float("nan")
                loss = rows[-1]["train/loss"] if rows else float("nan")
                # the run's peak allocated CUDA memory (its telemetry, on a GPU only)
                peak = max((r["train/mem_peak_gib"] for r in rows if "train/mem_peak_gib" in r), default=float("nan"))
                runs = result.setdefault(key, {"runs": [], "mode": mode, "variant": name})["runs"]
                runs.append({"effective_tokens_per_s": tps, "exit": code, "final_loss": loss, "peak_gib": peak})
                tag = f" [repeat {rep + 1}/{args.repeat}]" if args.repeat > 1 else ""
                print(
                    f"{key:>20}{tag}: {tps:,.0f} effective tokens/s, exit {code}, final loss {loss:.4f},"
                    f" peak {peak:.1f} GiB",
                    flush=True,
                )
    keys = [k for k, v in result.items() if isinstance(v, dict) and "runs" in v]
    for key in keys:
        best = max(result[key]["runs"], key=lambda r: _or_minus_inf(r["effective_tokens_per_s"]))
        result[key].update(best)
    if len(variants) < 2:
        (out / "recipe_speed.json").write_text(json.dumps(result, indent=1))
        return
    if args.modes == ["recipe"]:
        ratio = result["fp8"]["effective_tokens_per_s"] / result["bf16"]["effective_tokens_per_s"]
    else:
        for mode in args.modes:
            r = result[f"fp8 {mode}"]["effective_tokens_per_s"] / result[f"bf16 {mode}"]["effective_tokens_per_s"]
            result[f"fp8_over_bf16 {mode}"] = r
            print(f"FP8 / bf16 effective tokens/s, both {mode}: {r:.3f}")
        best = {}
        for name, _ in variants:
            mode = max(args.modes, key=lambda m: _or_minus_inf(result[f"{name} {m}"]["effective_tokens_per_s"]))
            best[name] = (mode, result[f"{name} {mode}"]["effective_tokens_per_s"])
            result[f"{name}_best_mode"] = mode
            print(f"{name} best mode: {mode} ({best[name][1]:,.0f} effective tokens/s)")
        ratio = best["fp8"][1] / best["bf16"][1]
    result["fp8_over_bf16"] = ratio
    print(f"FP8 / bf16 effective tokens/s{'' if args.modes == ['recipe'] else ', each in its best mode'}: {ratio:.3f}")
    (out / "recipe_speed.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
