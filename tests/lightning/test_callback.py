"""Fp8StateCallback on one CPU process (BoringModel with checkpointed blocks): arguments,
conversion report, event lifecycle and commit points, aborts, read-only evaluation, the
ledger metric, checkpoints and refusals, manual optimization."""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_fp8state as f8s
from lightning_fp8state.lightning import Fp8StateCallback
from lightning_fp8state.models import ResumableLoader
from tests.lightning.launch import ROOT
from tests.lightning.models import CheckpointedBoring, ScaledDataset
from tests.lightning.test_ddp import expected_events

BATCHES = 8  # 16 samples, batch 2
N_OWNERS = 6 * 3


def make_model(**kw) -> CheckpointedBoring:
    torch.manual_seed(0)
    model = CheckpointedBoring(**kw)
    model.train_dataloader = lambda: ResumableLoader(ScaledDataset(2 * BATCHES), batch_size=2)
    model.val_dataloader = lambda: ResumableLoader(ScaledDataset(8), batch_size=2)
    model.predict_dataloader = model.val_dataloader
    return model


def make_trainer(*callbacks, **kw) -> pl.Trainer:
    args = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "callbacks": list(callbacks),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    args.update(kw)
    return pl.Trainer(**args)


# -- package, registration, arguments -----------------------------------------------
def test_importing_the_package_does_not_import_lightning():
    code = (
        "import sys, lightning_fp8state as f8s; "
        "assert 'lightning' not in sys.modules and 'lightning.pytorch' not in sys.modules, 'imported'; "
        "cb = f8s.lightning.Fp8StateCallback; assert 'lightning.pytorch' in sys.modules; "
        "from lightning.pytorch.strategies import StrategyRegistry; assert 'fp8state_ddp' in StrategyRegistry"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_callback_arguments_are_keyword_only_and_validated():
    with pytest.raises(TypeError):
        Fp8StateCallback(f8s.QuantConfig())  # positional: refused
    with pytest.raises(f8s.ConfigError, match="config='fp8_delayed' is not allowed: expected a QuantConfig"):
        Fp8StateCallback(config="fp8_delayed")
    with pytest.raises(f8s.ConfigError, match="audit='yes' is not allowed: expected true or false"):
        Fp8StateCallback(audit="yes")
    with pytest.raises(f8s.ConfigError, match=r"unknown QuantConfig keys \['histroy_len'\]"):
        Fp8StateCallback(config={"histroy_len": 4})
    assert Fp8StateCallback(config={"history_len": 4}).config.history_len == 4


# -- conversion ---------------------------------------------------------------------
def test_conversion_is_reported_once(monkeypatch):
    messages = []
    monkeypatch.setattr("lightning_fp8state.lightning.callback.rank_zero_info", messages.append)
    cb = Fp8StateCallback(config=f8s.QuantConfig(exclude=("head",)))
    model = make_model()
    trainer = make_trainer(cb, limit_val_batches=2)
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    reports = [m for m in messages if m.startswith("lightning_fp8state: converted")]
    assert reports == ["lightning_fp8state: converted 5 layer(s) (5 nn.Linear), skipped 1, not quantizable 0"]
    assert cb.conversion.converted == ["inp", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    assert cb.conversion.skipped == {"head": "matches an exclude pattern ['head']"}
    assert isinstance(model.head, torch.nn.Linear) and not isinstance(model.head, f8s.Fp8Linear)
    assert isinstance(model.blocks[0].fc1, f8s.Fp8Linear)


def test_conversion_verbose_lists_every_layer_and_report_dir_gets_the_json(monkeypatch, tmp_path):
    import json

    messages = []
    monkeypatch.setattr("lightning_fp8state.lightning.callback.rank_zero_info", messages.append)
    cb = Fp8StateCallback(config=f8s.QuantConfig(exclude=("head",)), verbose=True, report_dir=tmp_path)
    make_trainer(cb).fit(make_model())
    (report,) = [m for m in messages if m.startswith("lightning_fp8state: converted")]
    assert "  converted blocks.1.fc2: nn.Linear -> Fp8Linear" in report.splitlines()
    assert "  skipped head: matches an exclude pattern ['head']" in report.splitlines()
    saved = json.loads((tmp_path / "conversion.json").read_text())
    assert saved["counts"]["converted"] == 5
    assert {"name": "head", "status": "skipped", "reason": "matches an exclude pattern ['head']"} in saved["entries"]
    with pytest.raises(f8s.ConfigError, match="verbose='yes' is not allowed: expected true or false"):
        Fp8StateCallback(verbose="yes")


def test_converted_layer_that_never_runs_is_warned_about_after_the_first_event():
    """The callback converts at setup and again at fit start; the check armed by the first
    survives the second, and fires once after the first training event."""
    model = make_model()
    model.unused = torch.nn.Linear(16, 16)  # converted, never called: it would never quantize
    with pytest.warns(f8s.ConversionWarning, match=r"never ran through the quantizer .*: unused\."):
        make_trainer(Fp8StateCallback(config=f8s.QuantConfig())).fit(model)


# -- events and commit points -------------------------------------------------------
class CommitSpy(Callback):
    """Runs after Fp8StateCallback in every hook: records what the protocol looked like."""

    def __init__(self, cb):
        self.cb = cb
        self.before_backward, self.after_backward = [], []

    def on_before_backward(self, trainer, pl_module, loss):
        state = self.cb.state
        per_owner = state.ledger.event(state.event)
        forward = {o: r.commits for o, r in per_owner.items() if o.role != "grad_output"}
        backward = {o: r.observations for o, r in per_owner.items() if o.role == "grad_output"}
        self.before_backward.append((state.event, forward, backward))

    def on_after_backward(self, trainer, pl_module):
        state = self.cb.state
        last = state.clock.last
        self.after_backward.append(
            (state.event, len(state.protocol.stash), last, {o: r.commits for o, r in state.ledger.event(last).items()})
        )


def test_one_event_per_microbatch_with_accumulation_and_the_commit_points():
    cb = Fp8StateCallback(audit=True)
    spy = CommitSpy(cb)
    trainer = make_trainer(cb, spy, max_epochs=2, accumulate_grad_batches=3)
    trainer.fit(make_model())
    state = cb.state
    events = expected_events(BATCHES, 3, 2)
    assert state.ledger.events() == events
    assert trainer.global_step == 6
    for event in events:
        per_owner = state.ledger.event(event)
        assert len(per_owner) == N_OWNERS
        assert all((r.commits, r.observations, r.recompute_records) == (1, 1, 0) for r in per_owner.values())
    # before backward: forward roles committed once, grad_output not seen yet
    for event, forward, backward in spy.before_backward:
        assert len(forward) == 6 * 2 and set(forward.values()) == {1}, event
        assert backward == {}
    # after backward: the event is closed, the stash released, every owner committed once
    assert [a[2] for a in spy.after_backward] == events
    for event, stash, _, commits in spy.after_backward:
        assert event is None and stash == 0
        assert len(commits) == N_OWNERS and set(commits.values()) == {1}
    report = cb.audit_report()
    # 2 checkpointed blocks x 2 Linears per event compared; fc2's output is early-stopped
    # (compared at its operands), fc1's output is rebuilt
    assert report.ok and report.recomputed == 4 * len(events)
    assert sum(r.output_recomputed for r in report.rows) == 2 * len(events)


class FailAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.fit_loop.epoch_loop.batch_idx == self.batch:
            raise RuntimeError("boom in the middle of an event")


def test_an_exception_aborts_the_event_and_a_later_fit_continues_the_clock():
    cb = Fp8StateCallback()
    model = make_model()
    with pytest.raises(RuntimeError, match="boom"):
        make_trainer(cb, FailAt(2)).fit(model)
    state = cb.state
    assert state.event is None and len(state.protocol.stash) == 0
    assert state.clock.last == (2, 0)
    assert bool((state.bank.amax_pending == 0).all())  # the aborted event's amaxes are gone
    # it raised after commit_forward: forward roles had advanced, grad_output never ran
    aborted = state.ledger.event((2, 0))
    assert {r.commits for o, r in aborted.items() if o.role != "grad_output"} == {1}
    assert not any(o.role == "grad_output" for o in aborted)
    assert state.ledger.ok
    # the same callback in a new fit: the logical clock keeps moving forward
    trainer = make_trainer(cb)
    trainer.fit(model)
    assert state.ledger.events()[-BATCHES:] == [(3 + i, 0) for i in range(BATCHES)]
    assert state.ledger.ok


class SkipBatch(CheckpointedBoring):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            self(batch)  # the forward runs and observes amaxes...
            return None  # ...but the batch is skipped: no backward, no optimizer step
        return super().training_step(batch, batch_idx)


def test_a_skipped_batch_is_aborted_without_commits():
    cb = Fp8StateCallback()
    torch.manual_seed(0)
    model = SkipBatch()
    model.train_dataloader = lambda: ResumableLoader(ScaledDataset(2 * BATCHES), batch_size=2)
    make_trainer(cb).fit(model)
    state = cb.state
    skipped = state.ledger.event((1, 0))
    assert skipped and all(r.observations == 1 and r.commits == 0 for r in skipped.values())
    # Lightning counts the skipped batch's (empty) optimizer step: one event per batch, each at its own step
    assert state.ledger.events() == [(i, 0) for i in range(BATCHES)]
    for event in state.ledger.events():
        if event != (1, 0):
            per_owner = state.ledger.event(event)
            assert len(per_owner) == N_OWNERS and all(r.commits == 1 for r in per_owner.values())
    assert state.ledger.ok and state.event is None


class PhaseCounter:
    def __init__(self):
        self.phases = []

    def observe(self, record, phase, output, snaps):
        self.phases.append(phase)


def test_validation_and_prediction_read_the_state_without_changing_it():
    cb = Fp8StateCallback()
    model = make_model()
    trainer = make_trainer(cb, limit_val_batches=2)
    trainer.fit(model)
    state = cb.state
    before = state.state_dict()
    counter = PhaseCounter()
    state.protocol.auditors.append(counter)
    trainer.validate(model, verbose=False)
    trainer.predict(model)
    after = state.state_dict()
    assert counter.phases and set(counter.phases) == {f8s.Phase.INFERENCE}
    for key in ("amax_history", "scale", "descale", "amax_pending"):
        assert torch.equal(before["bank"][key], after["bank"][key]), key
    assert before["clock"] == after["clock"] and before["ledger"] == after["ledger"]


# -- ledger checks ------------------------------------------------------------------
def test_violations_are_counted_as_a_metric_when_not_strict():
    cb = Fp8StateCallback(config=f8s.QuantConfig(mode="naive", strict=False))
    trainer = make_trainer(cb)
    trainer.fit(make_model())
    assert cb.violations_seen == len(cb.state.ledger.violations) > 0
    assert trainer.callback_metrics["fp8state/violations"].item() == cb.violations_seen


def test_safe_mode_logs_zero_violations():
    cb = Fp8StateCallback()
    trainer = make_trainer(cb)
    trainer.fit(make_model())
    assert trainer.callback_metrics["fp8state/violations"].item() == 0


def test_violations_raise_in_strict_mode():
    cb = Fp8StateCallback(config=f8s.QuantConfig(mode="naive", strict=True))
    with pytest.raises(f8s.StateTransitionError, match="recorded an amax during recompute"):
        make_trainer(cb).fit(make_model())
    assert cb.state.event is None


# -- checkpoints --------------------------------------------------------------------
def test_model_checkpoint_holds_the_state_and_another_model_is_refused(tmp_path):
    cb = Fp8StateCallback()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer(cb, saver, enable_checkpointing=True).fit(make_model())
    path = tmp_path / "step=4.ckpt"
    entry = torch.load(path, weights_only=False)["fp8state"]
    assert entry["world_size"] == 1 and list(entry["ranks"]) == [0]
    assert entry["ranks"][0]["clock"]["last"] == [3, 0]
    assert entry["accumulated_grads"] is None  # saved right after an optimizer step
    # the same weights, but the quantizer state names a layer the new run does not convert
    other = Fp8StateCallback(config=f8s.QuantConfig(exclude=("head",)))
    with pytest.raises(f8s.StateLoadError, match=r"different model.*\['head'\]"):
        make_trainer(other, max_epochs=2).fit(make_model(), ckpt_path=path)
    # another quantizer configuration is refused by the state itself
    other = Fp8StateCallback(config=f8s.QuantConfig(history_len=4))
    with pytest.raises(f8s.StateLoadError, match="history_len: saved 16, live 4"):
        make_trainer(other, max_epochs=2).fit(make_model(), ckpt_path=path)


def test_a_checkpoint_without_quantizer_state_warns(tmp_path):
    trainer = make_trainer()
    trainer.fit(make_model())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    cb = Fp8StateCallback()
    with pytest.warns(UserWarning, match="holds no quantizer state"):
        make_trainer(cb, max_epochs=2).fit(make_model(), ckpt_path=tmp_path / "plain.ckpt")
    assert cb.state.ledger.events()[0] == (BATCHES, 0)


# -- manual optimization ------------------------------------------------------------
class Manual(CheckpointedBoring):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        for half in batch.chunk(2):  # two forward/backward passes in one batch
            self.manual_backward(self.loss(self(half)))
        opt.step()


def test_manual_optimization_closes_the_event_at_the_batch_end():
    cb = Fp8StateCallback(audit=True)
    torch.manual_seed(0)
    model = Manual()
    model.train_dataloader = lambda: ResumableLoader(ScaledDataset(2 * BATCHES), batch_size=2)
    make_trainer(cb).fit(model)
    state = cb.state
    assert state.ledger.events() == [(i, 0) for i in range(BATCHES)]
    # each module runs twice per event: two call sites, each its own owner, each committed once
    assert {o.site for o in state.bank.owners} == {0, 1}
    for event in state.ledger.events():
        per_owner = state.ledger.event(event)
        assert len(per_owner) == 2 * N_OWNERS
        assert all(r.commits == 1 for r in per_owner.values())
    assert cb.audit_report().ok and state.ledger.ok


def test_a_save_inside_a_window_of_an_engine_that_owns_the_gradients_warns_and_is_marked():
    """DeepSpeed accumulates inside its engine (handles_gradient_accumulation): the window's
    gradients cannot be saved, so the save warns, the entry says so, and loading warns again."""
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    cb = Fp8StateCallback()
    model = make_model()
    cb.setup(SimpleNamespace(global_rank=0, strategy=None), model, "fit")
    cb._grads_pending = True  # as after a backward inside an accumulation window
    engine = SimpleNamespace(strategy=SimpleNamespace(handles_gradient_accumulation=True))
    checkpoint = {}
    with pytest.warns(UserWarning, match="keeps the accumulated gradients inside its engine"):
        cb.on_save_checkpoint(engine, model, checkpoint)
    entry = checkpoint["fp8state"]
    assert entry["accumulation_lost"] is True and entry["accumulated_grads"] is None
    other = Fp8StateCallback()
    model2 = make_model()
    other.setup(SimpleNamespace(global_rank=0, strategy=None), model2, "fit")
    fitting = SimpleNamespace(world_size=1, global_rank=0, state=SimpleNamespace(fn=TrainerFn.FITTING))
    with pytest.warns(UserWarning, match="not an exact continuation"):
        other.on_load_checkpoint(fitting, model2, checkpoint)


def test_saving_inside_an_event_is_refused_with_lightning_advice():
    from types import SimpleNamespace

    cb = Fp8StateCallback()
    model = make_model()
    cb.setup(SimpleNamespace(global_rank=0, strategy=None), model, "fit")
    cb.state.begin_event(0, 0)
    with pytest.raises(f8s.StateTransitionError, match="save from on_train_batch_end or later"):
        cb.on_save_checkpoint(SimpleNamespace(strategy=SimpleNamespace(handles_gradient_accumulation=False)), model, {})
    cb.state.abort_event()


def test_a_save_inside_a_window_under_sharded_parameters_warns_and_is_marked():
    """fp8state_fsdp (fp8state_sharded): the accumulated gradients are sharded DTensors; the save
    inside a window warns that they cannot be kept and marks the entry."""
    from types import SimpleNamespace

    cb = Fp8StateCallback()
    model = make_model()
    cb.setup(SimpleNamespace(global_rank=0, strategy=None), model, "fit")
    cb._grads_pending = True

    class Sharded(f8s.lightning.Fp8StateStrategyContract):  # fp8state_fsdp's answers, without its setup
        handles_gradient_accumulation = False
        fp8state_sharded = True

    trainer = SimpleNamespace(strategy=Sharded())
    checkpoint = {}
    with pytest.warns(UserWarning, match="keeps the accumulated gradients sharded across ranks"):
        cb.on_save_checkpoint(trainer, model, checkpoint)
    assert checkpoint["fp8state"]["accumulation_lost"] is True
