"""Diagnostic (GPU): is ``fp8_rowwise``'s training repeatable eagerly, and where does its
whole-step CUDA graph first differ from its eager run?

``Recipe.graph_problem`` refuses fp8_rowwise's graphs (its graphed CLI run differed from its
eager run on the H200, 2026-12-02). This script lifts the refusal in its own process only and
trains the small CLI GPT three times (eager, graphed, eager again), then prints the first step
whose loss or grad norm differs and the parameters that differ. Before that it runs one
forward + backward of a converted two-layer stack twice on the same inputs, eagerly, and
prints which outputs and gradients are not bitwise repeatable.

    python benchmarks/rowwise_graph_diag.py --out DIR [--recipe fp8_rowwise]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.cli.main import main as cli_main
from lightning_fp8state.quant_recipes import rowwise
from lightning_fp8state.telemetry.sinks import read_jsonl

CLI = [
    "model.d_model=128",
    "model.n_layers=2",
    "model.seq_len=64",
    "data.batch_size=8",
    "data.num_samples=800",
    "telemetry.wandb=disabled",
    "trainer.accelerator=gpu",
    "trainer.precision=bf16-mixed",
    "trainer.max_steps=10",
    "trainer.checkpoint_every_n_steps=10",
]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def repeat_one_step(recipe: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 384), nn.GELU(), nn.Linear(384, 128)).cuda()
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format="e4m3"))
    state.convert(model)
    x0 = torch.randn(512, 128, device="cuda")
    g = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for i in range(3):
        for p in model.parameters():
            p.grad = None
        x = x0.clone().requires_grad_(True)
        with state.step(i):
            with torch.autocast("cuda", torch.bfloat16):
                y = model(x)
            y.backward(g)
        runs.append(
            {"y": y.detach().clone(), "dx": x.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
        )
    for key in runs[0]:
        same = [_equal(runs[0][key], r[key]) for r in runs[1:]]
        print(f"one step repeated: {key:12s} bitwise {same}")


def cli_runs(out: Path, recipe: str) -> None:
    common = [*CLI, f"quant.recipe={recipe}", "quant.backward_format=e4m3"]
    names = ("eager", "graphed", "eager2")
    for name in names:
        extra = ["trainer.cuda_graphs=true"] if name == "graphed" else []
        assert cli_main(["train", *common, *extra, f"out_dir={out / name}"]) == 0, name
    runs = [out / n / "tiny_gpt_cpu" for n in names]
    ckpts = [torch.load(r / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for r in runs]
    logged = [[(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(r / "telemetry.jsonl")] for r in runs]
    for i, name in enumerate(names[1:], start=1):
        first = next((s for s, (a, b) in enumerate(zip(logged[0], logged[i], strict=True)) if a != b), None)
        differ = [k for k in ckpts[0]["state_dict"] if not _equal(ckpts[0]["state_dict"][k], ckpts[i]["state_dict"][k])]
        print(f"eager vs {name}: first differing step {first}; {len(differ)} parameters differ: {differ[:8]}")
    for s, rows in enumerate(zip(*logged, strict=True)):
        print(f"step {s}: " + "  ".join(f"{n}={v}" for n, v in zip(names, rows, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--recipe", default="fp8_rowwise")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rowwise.Fp8Rowwise.graph_problem = lambda self: None  # this process only: the diagnostic
    repeat_one_step(args.recipe)
    os.chdir(out)
    cli_runs(out, args.recipe)


if __name__ == "__main__":
    main()
