"""``fp8state train`` on a GPU: between log steps the Lightning loop reads nothing from the device.

A sync per step (the guard's flag read on the host, a number logged to the progress bar, a
0-d index tensor) keeps the host from running ahead of the GPU, which is what made the FP8
Lightning recipe slower than bf16 at 124M. Steady-state steps run here under
``torch.cuda.set_sync_debug_mode("error")``: the batch's copy to the device, the callbacks'
events, the telemetry (norms, the device guard with the fused AdamW, clipping), the optimizer
step, the LR scheduler and the progress bar. ``set_sync_debug_mode`` does not see an explicit
wait (``torch.cuda.synchronize``, a stream's or an event's ``synchronize``): those are counted
in the same steps, with the frame that called each (DeepSpeed's throughput timer made two a step
until the strategy turned its synchronization off).
"""

from __future__ import annotations

import traceback

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.gpu.test_compile_cuda import CLI_ON_THE_GPU

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class DeviceWaits:
    """Counts the explicit waits for the device while on: ``torch.cuda.synchronize`` and the
    ``synchronize`` of every ``torch.cuda.Stream`` and ``torch.cuda.Event``, each as the three
    frames that led to it (the innermost alone is often a wrapper, such as DeepSpeed's
    accelerator)."""

    _WAITS = ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"))

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._originals: list = []

    def on(self) -> None:
        for owner, name in self._WAITS:
            original = getattr(owner, name)
            self._originals.append((owner, name, original))
            setattr(owner, name, self._counted(original))

    def off(self) -> None:
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)

    def _counted(self, original):
        def wait(*args, **kwargs):
            callers = traceback.extract_stack()[-4:-1]
            self.calls.append(" < ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(callers)))
            return original(*args, **kwargs)

        return wait


class SyncFreeSteps(Callback):
    """Steps ``first`` .. ``last`` (0-based optimizer steps) run with syncs raising and explicit
    waits counted."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.checked: list[int] = []
        self.waits = DeviceWaits()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.first:
            torch.cuda.set_sync_debug_mode("error")
            self.waits.on()
        if self.first <= trainer.global_step <= self.last:
            self.checked.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last + 1:  # after this batch's optimizer step
            torch.cuda.set_sync_debug_mode(0)
            self.waits.off()


@pytest.fixture
def watch(monkeypatch):
    """``watch(first, last)`` adds a SyncFreeSteps to the Trainer the CLI builds; the debug mode is
    reset after."""
    spies: list[SyncFreeSteps] = []
    original = pl.Trainer.__init__

    def add(first: int, last: int) -> SyncFreeSteps:
        spy = SyncFreeSteps(first, last)
        spies.append(spy)

        def init(self, *a, callbacks=None, **kw):
            original(self, *a, callbacks=[*(callbacks or []), spy], **kw)

        monkeypatch.setattr(pl.Trainer, "__init__", init)
        return spy

    try:
        yield add
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for spy in spies:
            spy.waits.off()


@pytest.fixture
def watched(watch):
    return watch(3, 9)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_steady_state_steps_of_the_cli_loop_do_not_sync(tmp_path, monkeypatch, watched, precision):
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "tiny_gpt_cpu",
            "trainer.accelerator=gpu",
            f"trainer.precision={precision}",
            "trainer.gradient_clip_val=0.5",  # clipped by the telemetry, with the fused AdamW
            "trainer.max_steps=12",
            "trainer.checkpoint_every_n_steps=1000",
            "telemetry.wandb=disabled",
            "telemetry.log_every_n_steps=100",  # no log step inside the watched steps
            "data.num_workers=2",
            f"out_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 0
    assert watched.checked == list(range(3, 10))
    assert watched.waits.calls == []
    rows = read_jsonl(tmp_path / "runs" / "tiny_gpt_cpu" / "telemetry.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["train/steps_applied"] == 12  # the device guard's decisions, counted at the end
    assert all(r["train/grad_finite"] == 1.0 for r in rows)


@pytest.mark.parametrize("strategy", ["fp8state_ddp", "fp8state_deepspeed", "fp8state_fsdp"])
def test_graphed_steps_under_each_strategy_neither_sync_nor_wait(tmp_path, monkeypatch, watch, strategy):
    """The strategies' own loops with per-block CUDA graphs (world size 1): the gradient hooks,
    reductions and optimizer steps of DDP, DeepSpeed ZeRO-2 and FSDP2 between the replays make no
    host sync and no explicit wait for the device in steady state. The watched steps start after
    the capture (step 3, after ``trainer.cuda_graphs_warmup=3`` eager steps), whose
    ``torch.cuda.graph`` synchronizes the device once, as every capture does."""
    watched = watch(5, 11)
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "train",
            "tiny_gpt_cpu",
            *CLI_ON_THE_GPU,  # the shape the per-block graphs' CLI test runs under these strategies
            "trainer.devices=1",
            f"strategy.name={strategy}",
            "trainer.cuda_graphs=true",
            "trainer.gradient_clip_val=0.5",
            "trainer.max_steps=14",
            "trainer.cuda_graphs_warmup=3",
            "trainer.checkpoint_every_n_steps=1000",
            "telemetry.log_every_n_steps=100",
            "data.num_workers=2",
            f"out_dir={tmp_path / 'runs'}",
        ]
    )
    assert code == 0
    assert watched.checked == list(range(5, 12))
    assert watched.waits.calls == [], watched.waits.calls
