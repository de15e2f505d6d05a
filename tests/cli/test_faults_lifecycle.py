"""A run's life from start to stop (issue 41): the last step is always saved, the summary's loss is
the last step's, an interrupt before the first checkpoint leaves nothing to resume and says so,
printed commands are quoted for the shell, a GPU recipe is refused by ``audit`` at once, and a
``last.ckpt`` that is not what the strategy writes is refused before anything runs.

Preemption (SIGTERM and SIGHUP checkpoint at the next step boundary) is tested with the other
signals in ``tests/cli/test_faults.py::test_interrupt_then_resume_counts_each_step_once_and_ends_bitwise_equal``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch

from lightning_fp8state.cli import main as cli_main
from lightning_fp8state.telemetry.sinks import read_jsonl
from tests.cli.test_faults import COMMON, assert_one_clean_error, snapshot, train
from tests.lightning.launch import ROOT, launch_env


def _step(ckpt) -> int:
    return torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"]


def test_the_last_step_is_saved_and_the_summary_gives_its_loss(run_root, capsys):
    """max_steps=12 with a checkpoint every 5 steps: last.ckpt is at step 12 (it was at 10, and a
    resume re-trained 11-12), and the printed loss is step 12's row in telemetry.jsonl."""
    assert train(*COMMON, "trainer.max_steps=12", "trainer.checkpoint_every_n_steps=5", "out_dir=runs") == 0
    out = capsys.readouterr().out
    run = run_root / "runs" / "tiny_gpt_cpu"
    ckpts = run / "checkpoints"
    assert _step(ckpts / "last.ckpt") == 12
    assert {p.name for p in ckpts.iterdir()} == {"last.ckpt", "step=10.ckpt", "step=12.ckpt"}
    rows = {r["step"]: r for r in read_jsonl(run / "telemetry.jsonl")}
    assert f"steps: 12, last loss: {rows[12]['train/loss']:.4f}" in out
    assert train("--resume", str(run)) == 0
    assert "already complete at step 12" in capsys.readouterr().out


def test_audit_refuses_a_gpu_recipe_without_a_gpu_at_once(monkeypatch, capsys):
    """``audit gpt_124m_h200`` on a CPU machine once ran for minutes and was killed for memory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    ran = []
    import lightning_fp8state.cli.audit as audit

    monkeypatch.setattr(audit, "run_audit", lambda *a, **k: ran.append(a))
    assert cli_main.main(["audit", "gpt_124m_h200", "--steps", "1"]) == 2
    assert_one_clean_error(capsys.readouterr().err, "needs a CUDA GPU", "gpt_124m_h200")
    assert ran == []


def _child(code: str, *args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = launch_env()
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


CTRL_C_AT_STEP = """
import os, signal, sys
# Ctrl-C as at a terminal, even where this child was started with SIGINT ignored (a shell's
# background job): Python keeps an inherited SIG_IGN
signal.signal(signal.SIGINT, signal.default_int_handler)
from lightning_fp8state.lightning import telemetry_callback as tc
hook = tc.TelemetryCallback.on_train_batch_end
def stop(self, trainer, *args):
    hook(self, trainer, *args)
    if trainer.global_step == 3:
        os.kill(os.getpid(), signal.SIGINT)
tc.TelemetryCallback.on_train_batch_end = stop
from lightning_fp8state.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_before_the_first_checkpoint_removes_the_run_and_says_start_again(run_root):
    """It printed a resume command that then exited 2, and left the directory behind."""
    done = _child(CTRL_C_AT_STEP, "train", *COMMON, "trainer.max_steps=30", "out_dir=runs", cwd=run_root)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "before the first checkpoint" in done.stderr and "start the run again" in done.stderr
    assert "--resume" not in done.stderr and "Traceback" not in done.stderr
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


CTRL_C_AT_SETUP = """
import sys
import lightning_fp8state.cli.train as train
def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
train.module_and_data = interrupted  # Ctrl-C while the model is built, before Lightning's own handling
from lightning_fp8state.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_in_the_first_seconds_is_one_line_and_exit_130(run_root):
    done = _child(CTRL_C_AT_SETUP, "train", *COMMON, "trainer.max_steps=30", "out_dir=runs", cwd=run_root)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("fp8state:")] == [
        "fp8state: interrupted (Ctrl-C); nothing was saved"
    ]
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


def test_printed_commands_are_quoted_for_the_shell(run_root, capsys):
    """A run named with a space: the 'already complete' line gives a command a shell runs as is."""
    assert train(*COMMON, "trainer.max_steps=4", "out_dir=my runs", "name=a b") == 0
    run = run_root / "my runs" / "a b"
    capsys.readouterr()
    assert train("--resume", str(run)) == 0
    out = capsys.readouterr().out
    command = shlex.join(["fp8state", "train", "--resume", str(run), "trainer.max_steps=8"])
    assert command in out and shlex.split(command)[3] == str(run)


def test_a_last_ckpt_that_is_a_directory_is_refused_before_training(run_root, capsys):
    """A file-writing run whose last.ckpt is a directory: the resume fell back, trained, then
    crashed at the first save. Now: exit 2 naming it, the run untouched."""
    assert train(*COMMON, "trainer.max_steps=10", "out_dir=runs") == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    last = run / "checkpoints" / "last.ckpt"
    last.unlink()
    last.mkdir()
    (last / "x").write_text("not ours")
    before = snapshot(run)
    capsys.readouterr()
    assert train("--resume", str(run), "trainer.max_steps=20") == 2
    assert_one_clean_error(capsys.readouterr().err, "last.ckpt", "is a directory")
    assert snapshot(run) == before


def test_the_checkpoint_a_resume_fell_back_to_is_pruned_afterwards(run_root, capsys):
    """last.ckpt and step=20.ckpt damaged: the resume continues from step=10.ckpt; once it has
    saved two newer checkpoints, step=10.ckpt goes like any older one."""
    assert train(*COMMON, "trainer.max_steps=20", "out_dir=runs") == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    ckpts = run / "checkpoints"
    for name in ("last.ckpt", "step=20.ckpt"):
        data = (ckpts / name).read_bytes()
        (ckpts / name).write_bytes(data[: len(data) // 2])
    assert train("--resume", str(run), "trainer.max_steps=40") == 0
    assert {p.name for p in ckpts.iterdir()} == {"last.ckpt", "step=30.ckpt", "step=40.ckpt"}
    assert _step(ckpts / "last.ckpt") == 40


# -- W&B online ---------------------------------------------------------------------------
def _no_wandb_key(monkeypatch, home) -> None:
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc there


def test_wandb_online_without_a_key_is_refused_at_once(run_root, capsys, monkeypatch):
    """It printed a traceback (or W&B asked for a key on the terminal) after the run had started."""
    _no_wandb_key(monkeypatch, run_root)
    import wandb

    monkeypatch.setattr(wandb, "init", lambda *a, **k: pytest.fail("W&B must not be started"))
    assert train(*COMMON, "telemetry.wandb=online", "out_dir=runs") == 2
    assert_one_clean_error(
        capsys.readouterr().err, "telemetry.wandb='online'", "wandb login", "telemetry.wandb=offline"
    )
    assert not (run_root / "runs").exists()


def test_wandb_online_that_cannot_be_reached_is_one_line_within_a_bounded_wait(run_root, capsys, monkeypatch):
    """With a key and no network W&B waited 98 s, then a traceback said the run id 'is in use'."""
    _no_wandb_key(monkeypatch, run_root)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    import wandb

    asked = {}

    def unreachable(*args, **kwargs):
        asked.update(kwargs)
        raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop")

    monkeypatch.setattr(wandb, "init", unreachable)
    assert train(*COMMON, "telemetry.wandb=online", "out_dir=runs") == 2
    assert_one_clean_error(capsys.readouterr().err, "W&B could not start the run", "Network error", "offline")
    assert asked["settings"].init_timeout == 30
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


def test_wandb_online_with_a_netrc_entry_is_not_refused(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from lightning_fp8state.cli.checks import require_wandb_credentials

    _no_wandb_key(monkeypatch, tmp_path)
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    netrc.chmod(0o600)
    require_wandb_credentials(OmegaConf.create({"telemetry": {"wandb": "online"}}))
