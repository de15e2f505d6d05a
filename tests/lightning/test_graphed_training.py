"""GraphedTrainingStep in a Trainer, on the CPU with GraphedStep's eager stand-in: the same model
and data trained with automatic optimization and through the graphed step end bitwise equal
(parameters, optimizer state, every step's loss), with one event per step, one commit per owner
per event, the non-finite guard's skips, a resume, and the refusals. The real capture and replay
run in tests/gpu/test_graphed_training_cuda.py."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.lightning import Fp8StateCallback, GraphedTrainingStep, TelemetryCallback
from lightning_fp8state.models import GPT, GPTConfig
from lightning_fp8state.models.data import ResumableLoader, make_dataset
from lightning_fp8state.telemetry import read_jsonl
from tests.lightning.graph_stand_in import EagerGraphStandIn

STEPS = 8
TINY = GPTConfig(vocab_size=32, seq_len=16, d_model=32, n_layers=2, n_heads=2)


class GPTModule(pl.LightningModule):
    """A tiny GPT; ``graphed``: its step runs through GraphedTrainingStep (the eager stand-in)."""

    def __init__(
        self,
        graphed: bool,
        *,
        warmup: int = 2,
        fused: bool = True,
        nonfinite_at: int | None = None,
        cfg: GPTConfig = TINY,
        batch_size: int = 4,
        real_graphs: bool = False,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.cfg, self.batch_size = cfg, batch_size
        self.fused = fused
        self.nonfinite_at = nonfinite_at
        self.register_buffer("loss_scale", torch.ones(()), persistent=False)
        self.runners: list[EagerGraphStandIn] = []
        self.graphed = None
        if graphed:  # real_graphs: GraphedStep itself (CUDA), else its eager stand-in
            runner = None if real_graphs else self._stand_in
            self.graphed = GraphedTrainingStep(self, self.scaled_loss, warmup=warmup, runner=runner)

    def _stand_in(self, state, body, *inputs, warmup, microbatch):
        runner = EagerGraphStandIn(state, body, *inputs, params=self.parameters, warmup=warmup, microbatch=microbatch)
        self.runners.append(runner)
        return runner

    def scaled_loss(self, x, y):
        # loss_scale is read inside the event (a graph reads it from its memory on every replay)
        return self.model.loss(x, y) * self.loss_scale

    def on_train_batch_start(self, batch, batch_idx):
        inf = self.nonfinite_at is not None and self.trainer.global_step == self.nonfinite_at
        self.loss_scale.fill_(math.inf if inf else 1.0)

    def training_step(self, batch, batch_idx):
        if self.graphed is not None:
            return self.graphed(self, batch)
        return self.scaled_loss(*batch)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # another lr every step
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        ds = make_dataset("markov", vocab_size=self.cfg.vocab_size, seq_len=self.cfg.seq_len, length=64, seed=0)
        return ResumableLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=True)


def make_trainer(tmp_path, *, max_steps=STEPS, callbacks=(), accelerator="cpu", **kw) -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=tmp_path,
        callbacks=list(callbacks),
        **kw,
    )


def fit(tmp_path, module, *, ckpt_path=None, callbacks=(), telemetry=None, quant=None, **kw):
    fp8 = Fp8StateCallback(config=quant or f8s.QuantConfig(strict=True))
    telemetry = telemetry or TelemetryCallback(run_dir=tmp_path, log_every_n_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[fp8, telemetry, *callbacks], **kw)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, fp8


def assert_same_training(a: GPTModule, b: GPTModule) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    oa, ob = a.trainer.optimizers[0].state_dict()["state"], b.trainer.optimizers[0].state_dict()["state"]
    assert oa.keys() == ob.keys()
    for i in oa:
        for key in oa[i]:
            assert torch.equal(oa[i][key], ob[i][key]), (i, key)


def losses(run_dir) -> list[float]:
    return [row["train/loss"] for row in read_jsonl(run_dir / "telemetry.jsonl") if "train/loss" in row]


def test_the_graphed_step_trains_bitwise_like_automatic_optimization(tmp_path):
    plain = GPTModule(graphed=False)
    fit(tmp_path / "plain", plain)
    graphed = GPTModule(graphed=True, warmup=2)
    trainer, fp8 = fit(tmp_path / "graphed", graphed)

    assert trainer.global_step == STEPS
    assert_same_training(plain, graphed)
    assert losses(tmp_path / "graphed") == losses(tmp_path / "plain")
    assert len(losses(tmp_path / "plain")) == STEPS
    # the saturated fractions are logged (the kernels count: nothing a replay skips), the same
    sat = [
        [
            {k: v for k, v in r.items() if k.startswith("fp8state/saturated_frac")}
            for r in read_jsonl(d / "telemetry.jsonl")
        ]
        for d in (tmp_path / "plain", tmp_path / "graphed")
    ]
    assert sat[0] == sat[1] and sum(len(r) for r in sat[1]) >= STEPS
    (runner,) = graphed.runners
    assert runner.eager_calls == 2 and runner.replays == STEPS - 2  # the capture step counts as a replay
    # the events are the callback's numbering, one per step, each owner committed once in each
    assert runner.events == [(s, 0) for s in range(STEPS)]
    state = fp8.state
    assert state.clock.last == (STEPS - 1, 0)
    owners = state.ledger.owners()
    assert owners
    for event in state.ledger.events():
        assert all(state.ledger.commits(owner, event) == 1 for owner in owners), event
    assert state.ledger.ok


@pytest.mark.parametrize("fused", [True, False], ids=["fused guard on the device", "unfused guard on the host"])
def test_a_non_finite_step_after_the_capture_is_skipped_as_in_automatic_optimization(tmp_path, fused):
    """Step 4 (a replay) has an infinite loss: the guard skips it. With an unfused optimizer the
    guard sets the gradients to None; the next replay puts the graph's gradient tensors back."""
    plain = GPTModule(graphed=False, fused=fused, nonfinite_at=4)
    fit(tmp_path / "plain", plain)
    graphed = GPTModule(graphed=True, warmup=2, fused=fused, nonfinite_at=4)
    fit(tmp_path / "graphed", graphed)
    assert_same_training(plain, graphed)
    rows = [r for r in read_jsonl(tmp_path / "graphed" / "telemetry.jsonl") if "train/steps_skipped" in r]
    assert rows[-1]["train/steps_skipped"] == 1 and rows[-1]["train/steps_applied"] == STEPS - 1
    assert graphed.runners[0].replays == STEPS - 2


def test_a_resumed_graphed_run_warms_up_again_and_ends_bitwise_equal(tmp_path):
    whole = GPTModule(graphed=True, warmup=2)
    fit(tmp_path / "whole", whole)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = GPTModule(graphed=True, warmup=2)
    fit(tmp_path / "first", first, max_steps=3, callbacks=[ckpt])
    resumed = GPTModule(graphed=True, warmup=2)
    trainer, fp8 = fit(tmp_path / "resumed", resumed, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))

    assert trainer.global_step == STEPS
    assert_same_training(whole, resumed)
    (runner,) = resumed.runners
    assert runner.events == [(s, 0) for s in range(3, STEPS)] and runner.eager_calls == 2
    assert fp8.state.clock.last == (STEPS - 1, 0)


def test_without_an_fp8_state_the_step_runs_as_a_bf16_control(tmp_path):
    """No Fp8StateCallback: the same loop with no quantizer state (the peer a benchmark compares)."""
    module = GPTModule(graphed=True, warmup=1)
    make_trainer(tmp_path, max_steps=4).fit(module)
    (runner,) = module.runners
    assert runner.state is None and runner.events == [(s, 0) for s in range(4)] and runner.replays == 3


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("audit", "Fp8StateCallback(audit=True)"),
        ("automatic", "automatic_optimization"),
    ],
)
def test_what_a_replay_cannot_serve_is_refused_by_name(tmp_path, setup, needle):
    module = GPTModule(graphed=True)
    fp8 = Fp8StateCallback(config=f8s.QuantConfig(strict=True), audit=setup == "audit")
    telemetry = TelemetryCallback(run_dir=tmp_path, saturation=setup == "saturation")
    if setup == "automatic":
        module.automatic_optimization = True
    trainer = make_trainer(tmp_path, max_steps=2, callbacks=[fp8, telemetry])
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        trainer.fit(module)
    assert not module.runners  # refused before any event ran


class EpochScheduled(GPTModule):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}  # interval "epoch"


class TwoOptimizers(GPTModule):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.model.blocks.parameters()), torch.optim.SGD(self.model.head.parameters())]


@pytest.mark.parametrize(
    ("module_class", "needle"),
    [(EpochScheduled, "interval='epoch', frequency=1 is not supported"), (TwoOptimizers, "with 2 optimizers")],
)
def test_what_the_step_would_step_wrongly_is_refused_by_name(tmp_path, module_class, needle):
    """The step runs the optimizer and every scheduler after each event: an epoch-interval
    scheduler would be stepped every batch, a second optimizer never."""
    module = module_class(graphed=True)
    with pytest.raises(ConfigError, match=needle):
        fit(tmp_path, module)
    assert not module.runners


def test_gradient_accumulation_is_refused_by_lightning_by_name(tmp_path):
    """Manual optimization: Lightning refuses accumulate_grad_batches itself (each replay writes
    the gradients afresh, so they could not accumulate)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    module = GPTModule(graphed=True)
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches=2"):
        fit(tmp_path, module, accumulate_grad_batches=2)
    assert not module.runners


def test_bad_arguments_are_refused_by_name():
    module = GPTModule(graphed=False)
    with pytest.raises(ConfigError, match="warmup=0"):
        GraphedTrainingStep(module, module.scaled_loss, warmup=0)
    with pytest.raises(ConfigError, match="loss_fn=None is not allowed: expected a function of the batch"):
        GraphedTrainingStep(module, None)
    assert module.automatic_optimization  # nothing was switched by a refused construction


def _progress(auto_steps: int, manual_steps: int) -> dict:
    """A fit loop's optimizer-step counters as Lightning 2.6 saves them."""

    def counts(n, started=False):
        return {"ready": n, "completed": n, **({"started": n} if started else {})}

    return {
        "loops": {
            "fit_loop": {
                "epoch_loop.automatic_optimization.optim_progress": {
                    "optimizer": {
                        "step": {"total": counts(auto_steps), "current": counts(auto_steps)},
                        "zero_grad": {"total": counts(auto_steps, True), "current": counts(auto_steps, True)},
                    }
                },
                "epoch_loop.manual_optimization.optim_step_progress": {
                    "total": counts(manual_steps),
                    "current": counts(manual_steps),
                },
            }
        }
    }


def test_a_checkpoint_of_the_other_optimization_mode_keeps_its_step_count():
    """The whole-step graph trains under manual optimization, an eager run under automatic:
    Lightning keeps each mode's step count apart, and a resume in the other mode is given the
    saved one (else it would start at step 0, which the quantizer's clock refuses)."""
    from lightning_fp8state.lightning.callback import carry_optimizer_steps

    auto, manual = (
        "epoch_loop.automatic_optimization.optim_progress",
        "epoch_loop.manual_optimization.optim_step_progress",
    )
    eager = _progress(auto_steps=4, manual_steps=0)
    carry_optimizer_steps(eager, automatic=False)  # an eager run resumed with graphs
    assert eager["loops"]["fit_loop"][manual] == _progress(0, 4)["loops"]["fit_loop"][manual]
    graphed = _progress(auto_steps=0, manual_steps=6)
    carry_optimizer_steps(graphed, automatic=True)  # a graphed run resumed eagerly
    assert graphed["loops"]["fit_loop"][auto] == _progress(6, 0)["loops"]["fit_loop"][auto]
    for same_mode, automatic in ((_progress(4, 0), True), (_progress(0, 6), False), (_progress(0, 0), True)):
        before = copy.deepcopy(same_mode)
        carry_optimizer_steps(same_mode, automatic=automatic)
        assert same_mode == before
    for other_layout in ({}, {"loops": {"fit_loop": {auto: {"optimizer": {}}}}}, {"loops": None}):
        before = copy.deepcopy(other_layout)
        carry_optimizer_steps(other_layout, automatic=False)  # left to Lightning
        assert other_layout == before
