"""A full disk and a file-size limit at a checkpoint save (issue 41): one line and exit 3, naming
the file, what it needs in a readable unit and what is free, the last good checkpoint intact, and
the resume command only where there is a checkpoint to resume (else the half-made run is removed).

The failure is injected where the disk would report it: the checkpoint's temporary file raises
``ENOSPC`` from inside ``torch.save`` (torch's zip writer then raises ``RuntimeError: [enforce
fail at inline_container.cc]``, the case that printed a traceback), and a real ``RLIMIT_FSIZE`` in a
child process (the kernel's ``SIGXFSZ`` killed the run without a word).
"""

from __future__ import annotations

import errno
import os
import re
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from tests.cli.test_faults import COMMON, assert_one_clean_error, train
from tests.lightning.launch import ROOT, launch_env


class _FullDiskFile:
    """A checkpoint's temporary file on a disk that fills after ``room`` bytes."""

    def __init__(self, file, room: int) -> None:
        self._file, self._room = file, room

    def write(self, data) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def _fill_disk_at(monkeypatch, name: str) -> None:
    """Every temporary of checkpoint ``name`` (``.step=20.ckpt.XXXX.tmp``) meets a full disk."""
    fdopen = os.fdopen

    def full_fdopen(fd, *args, **kwargs):
        file = fdopen(fd, *args, **kwargs)
        if os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1].startswith(f".{name}."):
            return _FullDiskFile(file, room=4096)
        return file

    monkeypatch.setattr(os, "fdopen", full_fdopen)


def test_format_bytes_keeps_a_digit_before_the_point():
    from lightning_fp8state.errors import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1536, 3 * 2**20, 5 * 2**30)] == [
        "0 bytes",
        "1023 bytes",
        "1.5 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


def test_a_full_disk_inside_torch_save_is_one_line_and_keeps_the_last_good_checkpoint(run_root, capsys, monkeypatch):
    _fill_disk_at(monkeypatch, "step=20.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train(*COMMON, "trainer.max_steps=20", "out_dir=runs")
    err = capsys.readouterr().err
    run = Path("runs") / "tiny_gpt_cpu"
    assert code == 3, err[-3000:]
    assert_one_clean_error(err, str(run / "checkpoints" / "step=20.ckpt"), "no space left", "needs about")
    assert re.search(r"needs about \d+\.\d (KiB|MiB)", err) and "0.0 MiB" not in err
    assert f"then continue: fp8state train --resume {run}" in err
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=10.ckpt"]  # no temporary left
    assert torch.load(ckpts / "last.ckpt", weights_only=True)["global_step"] == 10


def test_a_full_disk_before_the_first_checkpoint_removes_the_run_and_says_start_again(run_root, capsys, monkeypatch):
    """It said "the previous file is kept ... continue: --resume", and that resume exited 2."""
    _fill_disk_at(monkeypatch, "step=10.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train(*COMMON, "trainer.max_steps=20", "out_dir=runs")
    err = capsys.readouterr().err
    assert code == 3, err[-3000:]
    assert_one_clean_error(err, "step=10.ckpt", "no space left", "start the run again")
    assert "--resume" not in err
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


def test_a_file_size_limit_is_one_line_and_exit_3(run_root):
    """``ulimit -f`` below a checkpoint's size: the kernel's SIGXFSZ killed the run silently."""
    env = launch_env()
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    limit = 48 * 1024  # above every run file but a checkpoint (this model's are ~200 KiB)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "lightning_fp8state", "train", *COMMON, "trainer.max_steps=20", "out_dir=runs"]
    done = subprocess.run(cmd, cwd=run_root, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert_one_clean_error(done.stderr, "step=10.ckpt", "file-size limit", "48.0 KiB", "start the run again")
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


def test_a_resume_onto_a_full_disk_names_the_file_and_the_space(finished_run, capsys, monkeypatch):
    """It said only "no space left to write a file": the lock's pid line was the first write."""
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, file):
            self._file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._file, name)

    def fdopen(fd, *args, **kwargs):
        file = real_fdopen(fd, *args, **kwargs)
        return Full(file) if os.readlink(f"/proc/self/fd/{fd}").endswith("/.lock") else file

    monkeypatch.setattr(os, "fdopen", fdopen)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 3
    err = capsys.readouterr().err
    assert_one_clean_error(err, str(finished_run / ".lock"), "no space left", "needs about 64 bytes", "free there")
    assert f"then continue: fp8state train --resume {finished_run}" in err  # its checkpoints are there
