"""The H200 recipes as they ship (``trainer.cuda_graphs: true``), shrunk to a test's size on one
GPU: each replays from CUDA graphs and trains bitwise what the same recipe trains with
``trainer.cuda_graphs=false`` (every step's loss and grad norm, the final weights and the
quantizer's state)."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.cli.config import load_config
from tests.conftest import bitwise_equal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 8
SHRINK = [  # the recipe's strategy, precision, checkpointing and quantization; a small model, one GPU
    "model.d_model=128",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.seq_len=64",
    "data.batch_size=8",
    "data.num_samples=800",
    "data.num_workers=0",
    "telemetry.wandb=disabled",
    "telemetry.log_every_n_steps=1",
    f"trainer.max_steps={STEPS}",
    f"trainer.checkpoint_every_n_steps={STEPS}",
    "trainer.devices=1",
]


@pytest.mark.parametrize("recipe", ["gpt_124m_h200", "gpt_350m_h200x2_deepspeed"])
def test_an_h200_recipe_as_shipped_replays_bitwise_its_eager_run(tmp_path, monkeypatch, recipe):
    from lightning_fp8state.cli.main import main
    from lightning_fp8state.telemetry.sinks import read_jsonl

    shipped = load_config(recipe)
    assert shipped.trainer.cuda_graphs is True
    runners = []  # every whole-step or per-block graph runner the run builds
    for cls in (f8s.GraphedStep, f8s.GraphedBlocks):
        original = cls.__init__

        def spy(self, *a, _original=original, **kw):
            _original(self, *a, **kw)
            runners.append(self)

        monkeypatch.setattr(cls, "__init__", spy)
    monkeypatch.chdir(tmp_path)
    assert main(["train", recipe, *SHRINK, "trainer.cuda_graphs=false", f"out_dir={tmp_path / 'eager'}"]) == 0
    assert runners == []
    assert main(["train", recipe, *SHRINK, f"out_dir={tmp_path / 'shipped'}"]) == 0
    warmup = shipped.trainer.cuda_graphs_warmup
    assert len(runners) == 1 and runners[0].eager_calls == warmup and runners[0].replays == STEPS - warmup

    runs = [tmp_path / name / shipped.name for name in ("eager", "shipped")]
    logged = [[(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(run / "telemetry.jsonl")] for run in runs]
    assert len(logged[0]) == STEPS and logged[0] == logged[1]
    if recipe == "gpt_124m_h200":  # DeepSpeed keeps its checkpoint as a directory of shards
        a, b = (torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu") for run in runs)
        for k in a["state_dict"]:
            assert bitwise_equal(a["state_dict"][k], b["state_dict"][k]), k
        for k in ("scale", "amax_history"):
            assert bitwise_equal(a["fp8state"]["ranks"][0]["bank"][k], b["fp8state"]["ranks"][0]["bank"][k]), k
