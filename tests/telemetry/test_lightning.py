"""TelemetryCallback on a Trainer (CPU): the guard, JSONL without W&B, W&B offline read back
from the run's own files, dominant source, clipping, accumulation, Fp8State, resume."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger

import lightning_fp8state as f8s
from lightning_fp8state.lightning import TelemetryCallback, wandb_logger
from lightning_fp8state.telemetry import read_jsonl
from tests.telemetry.helpers import (
    FakeDeepSpeedEngine,
    TinyModule,
    assert_bitwise_same,
    regression_batches,
    snapshot,
    wandb_history,
)


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """No account, no network, no user settings: W&B must work offline from a clean slate."""
    for key, sub in (
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
        ("WANDB_DATA_DIR", "wandb-data"),
    ):
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def trainer(tmp_path, callbacks, **kw):
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
        "log_every_n_steps": 1,  # Lightning's own logging; telemetry has its own window
    }
    return pl.Trainer(callbacks=callbacks, **(defaults | kw))


class StepSnapshots(Callback):
    """Parameters and optimizer state before and after chosen batches (one step each)."""

    def __init__(self, batches):
        self.batches, self.before, self.after = set(batches), {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in self.batches:
            self.before[batch_idx] = snapshot(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx in self.batches:
            self.after[batch_idx] = snapshot(pl_module, trainer.optimizers[0])


class ManualModule(TinyModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("fused", [False, True], ids=["host_guard", "fused_device_guard"])
@pytest.mark.parametrize("module_cls", [TinyModule, ManualModule], ids=["automatic", "manual"])
def test_nan_step_is_skipped_counted_and_leaves_params_and_adamw_state_bitwise(
    tmp_path, monkeypatch, module_cls, fused
):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # and logger=False: the JSONL is written anyway
    module = module_cls(nan_at={3}, fused=fused)
    spy = StepSnapshots({2, 3})
    tel = TelemetryCallback(log_every_n_steps=3)
    trainer(tmp_path, [tel, spy]).fit(module)

    assert_bitwise_same(spy.before[3], spy.after[3])  # the NaN step changed nothing
    with pytest.raises(AssertionError, match="changed"):  # while a normal step does
        assert_bitwise_same(spy.before[2], spy.after[2])
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in module.parameters())

    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["train/skipped"] for r in rows] == [0, 0, 0, 1, 0, 0]
    assert rows[3]["train/grad_finite"] == 0.0 and math.isnan(rows[3]["train/grad_norm"])
    assert rows[3]["train/dominant_grad_source"] == "net.hidden"  # where the NaN was put
    assert (rows[-1]["train/steps_attempted"], rows[-1]["train/steps_applied"], rows[-1]["train/steps_skipped"]) == (
        6,
        5,
        1,
    )
    assert [r["train/loss"] for r in rows] == module.losses  # the module's own record
    assert rows[-1]["train/lr"] == 1e-2
    assert [r["train/steps_skipped_window"] for r in rows if "train/steps_skipped_window" in r] == [0, 1]
    assert [r["train/tokens"] for r in rows] == [8] * 6  # float features: rows count
    assert not list(tmp_path.rglob("*.wandb"))


def test_wandb_logger_stays_offline_after_another_wandb_run_in_the_process(tmp_path, monkeypatch):
    """W&B reads WANDB_MODE once per process, so a logger that only set the environment went
    online (and asked for an API key) after an earlier run in the process; found when the
    sink's test ran first. The helper passes the mode to wandb.init itself."""
    from lightning_fp8state.telemetry import WandbSink

    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = WandbSink(tmp_path / "sink", project="first-run")
    sink.write([{"step": 0, "x": 1.0}])
    sink.close()
    logger = wandb_logger(tmp_path / "logger", name="second-run")
    trainer(tmp_path, [TelemetryCallback(log_every_n_steps=3)], logger=logger).fit(TinyModule())
    logger.experiment.finish()
    assert len(list((tmp_path / "logger" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_wandb_offline_run_holds_the_metrics(tmp_path):
    module = TinyModule(nan_at={2})
    logger = wandb_logger(tmp_path, name="telemetry-test")
    trainer(tmp_path, [TelemetryCallback(log_every_n_steps=3)], logger=logger).fit(module)
    logger.experiment.finish()

    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # offline: no account, no network
    history = [h for h in wandb_history(runs[0]) if "train/steps_attempted" in h]
    jsonl = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [h["trainer/global_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["train/loss"] for h in history] == module.losses
    assert [h["train/skipped"] for h in history] == [0, 0, 1, 0, 0, 0]
    assert history[-1]["train/steps_skipped"] == 1 and history[-1]["train/steps_applied"] == 5
    assert history[2]["train/grad_finite"] == 0 and math.isnan(history[2]["train/grad_norm"])
    assert history[2]["train/dominant_grad_source"] == "net.hidden"
    for h, j in zip(history, jsonl, strict=True):  # the same rows reach both sinks
        for key, value in j.items():
            if key in ("step", "time"):
                continue
            assert (
                (math.isnan(value) and math.isnan(h[key]))
                if isinstance(value, float) and math.isnan(value)
                else h[key] == value
            ), key
    logged = [h for h in history if "train/effective_tokens_per_s" in h]
    assert [h["trainer/global_step"] for h in logged] == [3, 6]
    assert 0 < logged[0]["train/effective_tokens_per_s"] < logged[0]["train/tokens_per_s"]  # a skip in window 1
    assert logged[1]["train/effective_tokens_per_s"] == logged[1]["train/tokens_per_s"]


def test_dominant_source_clipping_and_progress_bar(tmp_path):
    module = TinyModule(boost=("embed", 1000.0))
    t = trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2)], max_steps=4, gradient_clip_val=1e-3)
    t.fit(module)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/dominant_grad_source"] for r in rows] == ["net.embed"] * 4
    assert all(r["train/dominant_grad_share"] > 0.99 for r in rows)
    assert [r["train/clipped"] for r in rows] == [1.0] * 4 and rows[-1]["train/clip_events"] == 4
    assert all(r["train/grad_norm"] > 1e-3 for r in rows)  # measured before Lightning clipped
    bar = t.progress_bar_metrics
    assert bar["skipped"] == 0.0 and bar["eff_tok/s"] > 0 and bar["train/loss"] == pytest.approx(module.losses[-1])


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    module = TinyModule()
    trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2)], max_steps=3, accumulate_grad_batches=2).fit(module)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["train/tokens"] for r in rows] == [16] * 3
    # Lightning divides each microbatch loss by 2 before backward: the step's loss is their mean
    means = [(a + b) / 2 for a, b in zip(module.losses[::2], module.losses[1::2], strict=True)]
    assert [r["train/loss"] for r in rows] == pytest.approx(means, rel=1e-6)


def test_fp8state_health_reaches_the_rows(tmp_path):
    state = f8s.Fp8State(f8s.QuantConfig())
    module = TinyModule(state=state)
    trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2)], max_steps=4).fit(module)
    logs = [r for r in read_jsonl(tmp_path / "telemetry.jsonl") if "fp8state/owners" in r]
    assert [r["step"] for r in logs] == [2, 4]
    for r in logs:
        assert r["fp8state/owners"] == 9  # 3 layers x (input, weight, grad_output)
        assert r["fp8state/commits_per_event_min"] == r["fp8state/commits_per_event_max"] == 1.0
        assert r["fp8state/ledger_violations"] == 0.0
        assert 0.0 <= r["fp8state/saturated_frac"] < 1.0
    owner = next(o for o in state.bank.owners if o.layer == "embed" and o.role == "input")
    assert logs[-1]["fp8state/scale/embed.input"] == float(state.scale_of(owner))
    assert state.protocol.auditors == []  # the probe detached when training ended


def test_resume_continues_the_counters(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    first = trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2), ckpt], max_steps=4, enable_checkpointing=True)
    first.fit(TinyModule(nan_at={1}))
    second = trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2)], max_steps=6)
    second.fit(TinyModule(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["train/steps_attempted"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["train/steps_skipped"] == 1 and rows[-1]["train/steps_applied"] == 5


class GradNormAtStep(Callback):
    """The total gradient norm the optimizer is about to apply (after every earlier hook)."""

    def __init__(self):
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))


def test_the_callback_clips_a_fused_optimizer_under_bf16_mixed(tmp_path):
    """Lightning's mixed-precision plugin refuses to clip for a fused optimizer (its guard for
    fp16 loss scaling raises under bf16-mixed too); the callback clips with its own norm."""
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):  # what it replaces
        refused = tmp_path / "refused"
        trainer(refused, [TelemetryCallback()], max_steps=2, precision="bf16-mixed", gradient_clip_val=1e-3).fit(
            TinyModule(fused=True)
        )
    spy = GradNormAtStep()
    tel = TelemetryCallback(log_every_n_steps=2, clip_threshold=1e-3, apply_clipping=True)
    trainer(tmp_path, [tel, spy], max_steps=4, precision="bf16-mixed").fit(TinyModule(fused=True, nan_at={2}))
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/clipped"] for r in rows] == [1.0, 1.0, 0.0, 1.0]  # the NaN step counts no clip
    assert all(r["train/grad_norm"] > 1e-3 for i, r in enumerate(rows) if i != 2)  # measured before clipping
    assert all(n <= 1e-3 * (1 + 1e-4) for i, n in enumerate(spy.norms) if i != 2)  # what the optimizer gets
    assert [r["train/skipped"] for r in rows] == [0.0, 0.0, 1.0, 0.0]


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(f8s.ConfigError, match="log_every_n_steps=0"):
        TelemetryCallback(log_every_n_steps=0)
    with pytest.raises(f8s.ConfigError, match="tokens_per_batch='many'"):
        TelemetryCallback(tokens_per_batch="many")
    with pytest.raises(
        f8s.ConfigError,
        match=r"clip_threshold=None is not allowed: .*\(apply_clipping=True clips the gradients at it\)",
    ):
        TelemetryCallback(apply_clipping=True)
    with pytest.raises(f8s.ConfigError, match=r"clip_threshold=0 is not allowed: expected a finite number > 0 or None"):
        TelemetryCallback(clip_threshold=0)
    with pytest.raises(f8s.ConfigError, match="progress_bar='no' is not allowed: expected true or false"):
        TelemetryCallback(progress_bar="no")
    both = TelemetryCallback(clip_threshold=1.0, apply_clipping=True)
    with pytest.raises(f8s.ConfigError, match="would both clip"):
        trainer(tmp_path, [both], max_steps=1, gradient_clip_val=1.0).fit(TinyModule())
    # fp16 loss scaling (a GradScaler; Lightning builds one on CUDA only): gradients still scaled
    scaled = SimpleNamespace(
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        model=TinyModule(),
        gradient_clip_val=None,
        precision_plugin=SimpleNamespace(scaler=torch.amp.GradScaler("cpu")),
    )
    with pytest.raises(f8s.ConfigError, match="fp16 loss scaling"):
        TelemetryCallback(clip_threshold=1.0, apply_clipping=True).on_train_start(scaled, scaled.model)


class MemoryLogger(Logger):
    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


def test_every_lightning_logger_gets_the_rows(tmp_path):
    memory, csv = MemoryLogger(), CSVLogger(tmp_path / "csv", name="run")
    trainer(tmp_path, [TelemetryCallback(log_every_n_steps=2)], max_steps=4, logger=[csv, memory]).fit(TinyModule())
    ours = [(step, m) for step, m in memory.logged if "train/steps_attempted" in m]
    assert [step for step, _ in ours] == [1, 2, 3, 4]
    assert all(isinstance(v, (int, float)) for _, m in ours for v in m.values())  # text only to W&B
    assert "train/dominant_grad_source" not in ours[0][1] and "train/dominant_grad_share" in ours[0][1]
    with open(csv.log_dir + "/metrics.csv") as f:
        header = f.readline()
    assert "train/effective_tokens_per_s" in header and "train/grad_norm" in header
    # the JSONL goes where the first logger writes (trainer.log_dir)
    assert (tmp_path / "csv" / "run" / "version_0" / "telemetry.jsonl").is_file()


def test_callback_under_a_deepspeed_like_engine_counts_the_engines_skips(tmp_path):
    """Lightning's DeepSpeedStrategy needs CUDA, so the callback is driven by hand here with
    ``trainer.model`` a fake engine: the guard stands down and the engine's skips count."""
    engine = FakeDeepSpeedEngine()
    module = TinyModule()
    fake_trainer = SimpleNamespace(
        log_dir=str(tmp_path),
        default_root_dir=str(tmp_path),
        model=engine,
        gradient_clip_val=None,
        gradient_clip_algorithm=None,
        is_global_zero=True,
        log_every_n_steps=50,
        world_size=2,
        loggers=[],
        global_step=0,
    )
    cb = TelemetryCallback(log_every_n_steps=2, progress_bar=False)
    with pytest.warns(UserWarning, match="DeepSpeed keeps gradients"):
        cb.on_train_start(fake_trainer, module)
    assert cb.telemetry.guard is False
    opt = module.configure_optimizers()
    for step, batch in enumerate(regression_batches(4)):
        cb.on_train_batch_start(fake_trainer, module, batch, step)
        loss = module.training_step(batch, step)
        cb.on_before_backward(fake_trainer, module, loss)
        loss.backward()
        if step == 1:
            module.net.head.weight.grad[0, 0] = float("inf")  # fp16 overflow: the engine skips
        cb.on_before_optimizer_step(fake_trainer, module, opt)
        engine.step(overflow=step == 1)
        opt.zero_grad()
        fake_trainer.global_step = step + 1
        cb.on_train_batch_end(fake_trainer, module, None, batch, step)
    cb.on_train_end(fake_trainer, module)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/skipped"] for r in rows] == [0, 1, 0, 0]
    assert [r["train/steps_skipped_loss_scale"] for r in rows] == [0, 1, 1, 1]
    assert rows[1]["train/loss_scale"] == 32768.0 and rows[1]["train/grad_finite"] == 0.0
    assert rows[-1]["train/steps_applied"] == 3
    assert [r["train/tokens"] for r in rows] == [16] * 4  # 8 rows x world size 2
