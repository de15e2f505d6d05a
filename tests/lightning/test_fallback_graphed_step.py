"""QuantConfig.fallback under GraphedTrainingStep (``trainer.cuda_graphs=true``), on the CPU with
GraphedStep's eager stand-in (tests/lightning/graph_stand_in.py): a move after the capture makes
the graph stale; the next batch captures again, once, its gradients cleared before that capture as
before the first, and the run ends bitwise the automatic-optimization run, the move included. The
real capture, the deferred decision and the replays run in tests/gpu/test_fallback_graphed_step.py.

The outlier is the one of tests/unit/test_fallback_current.py: fc1's weight holds 1e37 from step 3
on, its input one feature at 1e8 at step 3 only; fc1's delayed-scaled output is inf/NaN at step 4,
the move happens at step 4's end (a replay: the capture is step 2).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fp8state as f8s
from lightning_fp8state.lightning import Fp8StateCallback, GraphedTrainingStep, TelemetryCallback
from lightning_fp8state.telemetry import read_jsonl
from tests.conftest import bitwise_equal
from tests.lightning.graph_stand_in import EagerGraphStandIn

STEPS, OUTLIER_STEP, MOVE_STEP, WARMUP = 8, 3, 4, 2


class _OutlierModule(pl.LightningModule):
    def __init__(self, graphed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))
        self.runners: list[EagerGraphStandIn] = []
        self.graphed = GraphedTrainingStep(self, self.loss, warmup=WARMUP, runner=self._stand_in) if graphed else None

    def _stand_in(self, state, body, *inputs, warmup, microbatch):
        runner = EagerGraphStandIn(state, body, *inputs, params=self.parameters, warmup=warmup, microbatch=microbatch)
        self.runners.append(runner)
        return runner

    def loss(self, x):
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x * self.gain)))).sum()

    def on_train_batch_start(self, batch, batch_idx):
        with torch.no_grad():
            if self.trainer.global_step == OUTLIER_STEP:
                self.fc1.weight[0, 0] = 1e37
            self.gain[1] = 1e8 if self.trainer.global_step == OUTLIER_STEP else 1.0

    def training_step(self, batch, batch_idx):
        if self.graphed is not None:
            return self.graphed(self, batch)
        return self.loss(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(STEPS * 16, 32, generator=g)), batch_size=16, shuffle=False)


def _fit(tmp_path, graphed: bool, target: str):
    module = _OutlierModule(graphed)
    fp8 = Fp8StateCallback(config=f8s.QuantConfig(fallback=True, fallback_to=target))
    telemetry = TelemetryCallback(run_dir=tmp_path, log_every_n_steps=1, saturation=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        callbacks=[fp8, telemetry],
    )
    trainer.fit(module)
    return module, fp8.state


@pytest.mark.parametrize("target", ["bf16", "current"])
def test_a_move_after_the_capture_captures_again_once_and_trains_like_eager(tmp_path, target):
    plain, plain_state = _fit(tmp_path / "plain", False, target)
    graphed, state = _fit(tmp_path / "graphed", True, target)
    assert dict(state.protocol.fallen_back) == dict(plain_state.protocol.fallen_back) == {"fc1": MOVE_STEP}
    assert state.protocol.fallback.events[0].target == target
    (runner,) = graphed.runners
    # captured at step 2, stale after step 4's move, captured again at step 5 (the stand-in asserts the
    # gradients were cleared before it, and that later replays find the new capture's gradient tensors)
    assert runner.recaptures == 1 and runner.eager_calls == WARMUP
    assert runner.events == [(s, 0) for s in range(STEPS)]
    for name, p in plain.named_parameters():
        assert bitwise_equal(p, dict(graphed.named_parameters())[name]), name
    for run in ("plain", "graphed"):  # the step that showed the fault was skipped, and only it
        rows = [r for r in read_jsonl(tmp_path / run / "telemetry.jsonl") if "train/steps_skipped" in r]
        assert rows[-1]["train/steps_skipped"] == 1, run
