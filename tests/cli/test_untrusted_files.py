"""A received run directory writes nothing outside the run (issue 41): no entry of it is written,
read or pruned through a symbolic link, and telemetry reaches the disk at every checkpoint and
notices its file or directory going away mid-run.

Each link test points one entry at a victim outside the run; the refusal is one line naming the
entry (exit 2), the victim keeps every byte, and the run directory is unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.telemetry.sinks import JsonlSink, read_jsonl, read_telemetry
from tests.cli.test_faults import COMMON, assert_one_clean_error, snapshot, train
from tests.lightning.launch import ROOT, launch_env

FILES = ["config.yaml", "provenance.json", "conversion.json", "telemetry.jsonl", "wandb_run_id", ".lock"]
FOLDERS = ["checkpoints", "wandb"]


@pytest.fixture
def victim(tmp_path):
    """A folder outside the run with a file in it: what a planted link points at."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "precious.txt").write_text("do not touch\n")
    (folder / "step=1.ckpt").write_bytes(b"someone else's checkpoint")
    return folder


@pytest.mark.parametrize("entry", FILES + FOLDERS)
def test_a_resume_refuses_a_run_entry_that_is_a_link(finished_run, victim, capsys, entry):
    path = finished_run / entry
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    target = victim if entry in FOLDERS else victim / "precious.txt"
    path.symlink_to(target, target_is_directory=target.is_dir())
    before, victim_before = snapshot(finished_run), snapshot(victim)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, str(path), "symbolic link")
    assert snapshot(victim) == victim_before
    assert snapshot(finished_run) == before


@pytest.mark.parametrize(
    ("entry", "make"), [(".lock", os.mkfifo), ("telemetry.jsonl", os.mkdir), ("checkpoints", None)]
)
def test_a_resume_refuses_an_entry_of_the_wrong_kind(finished_run, capsys, entry, make):
    """A FIFO as .lock hung or raised; telemetry.jsonl as a folder resumed and lost its rows."""
    path = finished_run / entry
    if path.is_dir():
        shutil.rmtree(path)
        path.write_text("a file where the checkpoints folder belongs\n")
    else:
        path.unlink(missing_ok=True)
        make(path)
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, str(path), "is not a")
    assert snapshot(finished_run) == before


def test_report_writes_no_plot_through_a_link(finished_run, victim, capsys):
    report = finished_run / "report"
    report.symlink_to(victim, target_is_directory=True)
    victim_before = snapshot(victim)
    assert main(["report", str(finished_run)]) == 2
    assert_one_clean_error(capsys.readouterr().err, str(report), "symbolic link")
    report.unlink()
    report.mkdir()
    (report / "loss.png").symlink_to(victim / "precious.txt")  # a link in place of one plot
    assert main(["report", str(finished_run)]) == 0
    assert not (report / "loss.png").is_symlink() and (report / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert snapshot(victim) == victim_before


def test_report_out_an_existing_file_and_an_unwritable_folder_are_one_line(finished_run, tmp_path, capsys, monkeypatch):
    existing = tmp_path / "notes.txt"
    existing.write_text("mine\n")
    assert main(["report", str(finished_run), "--out", str(existing)]) == 2
    assert_one_clean_error(capsys.readouterr().err, str(existing), "is a file", "--out")
    assert existing.read_text() == "mine\n"
    # a read-only run directory (root ignores mode bits: the file system's answer is injected)
    real_touch = type(finished_run).touch

    def read_only(self, *args, **kwargs):
        if self.parent == finished_run / "report":
            raise OSError(30, "Read-only file system")
        return real_touch(self, *args, **kwargs)

    monkeypatch.setattr(type(finished_run), "touch", read_only)
    assert main(["report", str(finished_run)]) == 2
    assert_one_clean_error(capsys.readouterr().err, "cannot be written", "Read-only file system", "--out DIR")


def test_a_read_only_run_directory_is_refused_at_resume_with_one_line(finished_run, capsys, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, ".lock", "Read-only file system", "writable")


def test_the_jsonl_sink_never_writes_through_a_link_and_keeps_its_file_private(tmp_path, victim):
    link = tmp_path / "telemetry.jsonl"
    link.symlink_to(victim / "precious.txt")
    with pytest.raises(OSError):
        JsonlSink(link).write([{"step": 1}])
    assert (victim / "precious.txt").read_text() == "do not touch\n"
    own = JsonlSink(tmp_path / "own.jsonl")
    own.write([{"step": 1}])
    own.close()
    assert (tmp_path / "own.jsonl").stat().st_mode & 0o777 == 0o600


def test_a_telemetry_file_deleted_or_a_run_directory_moved_mid_run_is_said(tmp_path):
    run = tmp_path / "run"
    sink = JsonlSink(run / "telemetry.jsonl")
    sink.write([{"step": 1}])
    (run / "telemetry.jsonl").unlink()
    with pytest.warns(RuntimeWarning, match="deleted or replaced during the run"):
        sink.write([{"step": 2}])
    assert [r["step"] for r in read_jsonl(run / "telemetry.jsonl")] == [1, 2]  # the earlier rows kept
    run.rename(tmp_path / "moved")
    with pytest.warns(RuntimeWarning, match="moved or deleted during the run"):
        sink.write([{"step": 3}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        sink.write([{"step": 4}])
    sink.close()
    assert not run.exists()  # nothing created at the old path
    assert [r["step"] for r in read_jsonl(tmp_path / "moved" / "telemetry.jsonl")] == [1, 2, 3, 4]


KILL_AFTER_SAVE = """
import os, signal, sys
from lightning_fp8state.lightning import checkpoint_io
save = checkpoint_io.RunCheckpoint.on_train_batch_end
def kill(self, trainer, *args):
    save(self, trainer, *args)
    if trainer.global_step == {step}:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint_io.RunCheckpoint.on_train_batch_end = kill
from lightning_fp8state.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _child(code: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = launch_env()
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS=str(torch.get_num_threads()))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_kill_right_after_a_checkpoint_loses_no_telemetry_row(run_root):
    """Rows wait in memory for the log step (every 4 here): a kill right after the checkpoint at
    step 10 lost rows 9-10 for good, since a resume starts at step 11."""
    args = [*COMMON, "telemetry.log_every_n_steps=4", "trainer.max_steps=20", "out_dir=runs"]
    done = _child(KILL_AFTER_SAVE.format(step=10), "train", *args, cwd=run_root)
    assert done.returncode == -9, done.stderr[-3000:]
    run = run_root / "runs" / "tiny_gpt_cpu"
    assert [r["step"] for r in read_jsonl(run / "telemetry.jsonl")] == list(range(1, 11))
    assert train("--resume", str(run)) == 0
    log = read_telemetry(run / "telemetry.jsonl")
    assert [r["step"] for r in log.rows] == list(range(1, 21)) and log.superseded == 0


MOVE_AT = """
import os, sys
from lightning_fp8state.lightning import telemetry_callback as tc
hook = tc.TelemetryCallback.on_train_batch_end
def move(self, trainer, *args):
    hook(self, trainer, *args)
    if trainer.global_step == 12:
        os.rename("runs/tiny_gpt_cpu", "runs/moved")
tc.TelemetryCallback.on_train_batch_end = move
from lightning_fp8state.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_directory_moved_mid_run_stops_at_the_next_save_with_one_line_and_no_stray_copy(run_root):
    done = _child(MOVE_AT, "train", *COMMON, "trainer.max_steps=30", "out_dir=runs", cwd=run_root)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "moved or deleted during the run" in done.stderr
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()  # no stray file or folder at the old path
    moved = run_root / "runs" / "moved"
    assert torch.load(moved / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 10
    assert max(r["step"] for r in read_jsonl(moved / "telemetry.jsonl")) >= 18


def test_the_report_of_a_run_that_ended_non_finite_says_so(tmp_path):
    """Its summary showed the last finite loss, as if the run had ended well."""
    from lightning_fp8state.telemetry import write_report

    rows = [{"step": s, "train/loss": 3.0 - 0.1 * s, "train/steps_attempted": s} for s in range(1, 5)]
    rows.append({"step": 5, "train/loss": float("nan"), "train/steps_attempted": 5})
    sink = JsonlSink(tmp_path / "telemetry.jsonl")
    sink.write(rows)
    sink.close()
    summary = write_report(tmp_path, show=False).summary
    assert summary["loss last"] != summary["loss last"]  # NaN
    assert summary["loss last finite"] == pytest.approx(2.6)


def test_the_telemetry_modules_report_command_refuses_a_link_with_one_line(finished_run, victim, capsys):
    from lightning_fp8state.telemetry.__main__ import main as telemetry_main

    (finished_run / "report").symlink_to(victim, target_is_directory=True)
    assert telemetry_main(["report", str(finished_run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "symbolic link" in err
