"""A full disk and a file-size limit at a checkpoint save (issue 41): one line and exit 3, naming
the file, what it needs in a readable unit and what is free, the last good checkpoint intact, and
the resume command only where there is a checkpoint to resume (else the half-made run is removed).

The failure is injected where the disk would report it: the checkpoint's temporary file raises
``ENOSPC`` from inside ``torch.save`` (torch's zip writer then raises ``RuntimeError: [enforce
fail at inline_container.cc]``, the case that printed a traceback), and a real ``RLIMIT_FSIZE`` in a
child process (the kernel's ``SIGXFSZ`` killed the run without a word).

Beside them, the other faults of a run's inputs and outputs: a token file that holds nothing, and
W&B online, whose key is looked up where W&B itself looks (no network call in any test: W&B's
``init`` is replaced by one that raises W&B's own error).
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_fp8state.cli.main import main
from lightning_fp8state.lightning.checkpoint_io import write_atomic
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


# -- what a full disk leaves: the previous file, or none ----------------------------------
def _no_room(f) -> None:
    f.write(b"x" * 100)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_says_the_previous_file_is_kept_only_where_there_was_one(tmp_path):
    """ "The previous file is kept as it was" was said of files that had never existed (a run's
    first step=N.ckpt, its first last.ckpt)."""
    from lightning_fp8state.errors import DiskFullError

    new = tmp_path / "new.ckpt"
    with pytest.raises(DiskFullError) as caught:
        write_atomic(new, _no_room, nbytes=3000)
    assert "No partial file is left" in str(caught.value) and "previous file" not in str(caught.value)
    assert not new.exists() and list(tmp_path.iterdir()) == []
    old = tmp_path / "old.ckpt"
    old.write_bytes(b"the good one")
    with pytest.raises(DiskFullError, match="needs about 2.9 KiB.*The previous file is kept as it was"):
        write_atomic(old, _no_room, nbytes=3000)
    assert old.read_bytes() == b"the good one" and [p.name for p in tmp_path.iterdir()] == ["old.ckpt"]


def test_a_full_disk_at_the_first_last_ckpt_names_it_and_the_resume_continues_from_step_n(
    run_root, capsys, monkeypatch
):
    """What a disk that fills between a run's first step=N.ckpt and its first last.ckpt leaves
    (seen on a 600 KiB tmpfs): the resume it prints must work from step=N.ckpt alone."""
    _fill_disk_at(monkeypatch, "last.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train(*COMMON, "trainer.max_steps=20", "out_dir=runs")
    err = capsys.readouterr().err
    run = Path("runs") / "tiny_gpt_cpu"
    assert code == 3, err[-3000:]
    assert_one_clean_error(err, str(run / "checkpoints" / "last.ckpt"), "No partial file is left")
    assert "previous file" not in err and f"then continue: fp8state train --resume {run}" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step=10.ckpt"]
    monkeypatch.undo()  # room again
    monkeypatch.chdir(run_root)
    assert train("--resume", str(run)) == 0, capsys.readouterr().err[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 20


# -- a token file that holds nothing ------------------------------------------------------
def test_an_empty_token_bin_is_one_line_for_train_and_audit(run_root, capsys):
    """``data.source=bin`` on an empty file: ``ValueError: cannot mmap an empty file`` (exit 1)."""
    data = run_root / "empty.bin"
    data.touch()
    source = ["data.source=bin", f"data.path={data}", "model.vocab_size=512"]
    for command in (["train", *COMMON, *source, "out_dir=runs"], ["audit", *COMMON[:5], *source, "--steps", "1"]):
        assert main(command) == 2
        assert_one_clean_error(capsys.readouterr().err, str(data), "holds 0 tokens", "need at least 17")
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


# -- W&B online: the key where W&B itself finds it ----------------------------------------
@pytest.fixture
def wandb_home(run_root, monkeypatch):
    """No W&B key anywhere but what a test puts there; W&B's process-wide settings read afresh."""
    import wandb

    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(run_root))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(run_root / "wandb_config"))
    wandb.teardown()
    yield run_root
    wandb.teardown()


def _unreachable_wandb(monkeypatch) -> list:
    import wandb

    called = []

    def init(*args, **kwargs):
        called.append(kwargs)
        raise wandb.errors.CommError("Network error (ConnectionError), entering retry loop")

    monkeypatch.setattr(wandb, "init", init)
    return called


@pytest.mark.parametrize(
    "server",
    ["default", "http://localhost:8080", "settings:https://wandb.example.com"],
    ids=["wandb-login-default-server", "a-server-with-a-port", "a-server-from-wandb-login-host"],
)
def test_wandb_online_takes_the_key_that_wandb_login_saved_for_its_server(wandb_home, capsys, monkeypatch, server):
    """The check looked for a netrc entry for ``api.wandb.ai`` only, by host name: it refused a
    key that `wandb login` had saved for W&B's default server of this release, for a server with a
    port (netrc names ``host:port``), or for a server set by `wandb login --host` (W&B's settings
    file). Each key is written by W&B's own netrc writer, as `wandb login` does."""
    import wandb

    wbauth = pytest.importorskip("wandb.sdk.lib.wbauth")
    if server == "default":
        url = wandb.Settings().base_url
    elif server.startswith("settings:"):
        url = server.removeprefix("settings:")
        (wandb_home / "wandb_config").mkdir()
        (wandb_home / "wandb_config" / "settings").write_text(f"[default]\nbase_url = {url}\n")
    else:
        url = server
        monkeypatch.setenv("WANDB_BASE_URL", url)
    wbauth.write_netrc_auth(host=url, api_key="k" * 40)
    called = _unreachable_wandb(monkeypatch)
    assert train(*COMMON, "telemetry.wandb=online", "out_dir=runs") == 2
    err = capsys.readouterr().err
    assert_one_clean_error(err, "W&B could not start the run")  # it went on to W&B: the key was taken
    assert len(called) == 1 and "needs a W&B API key" not in err


def test_wandb_online_with_a_key_wandb_rejects_is_refused_at_once(wandb_home, capsys, monkeypatch):
    """A malformed WANDB_API_KEY passed the check (any value did) and failed in wandb.init."""
    import wandb

    pytest.importorskip("wandb.sdk.lib.wbauth")
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    monkeypatch.setattr(wandb, "init", lambda *a, **k: pytest.fail("W&B must not be started"))
    assert train(*COMMON, "telemetry.wandb=online", "out_dir=runs") == 2
    assert_one_clean_error(capsys.readouterr().err, "telemetry.wandb='online'", "WANDB_API_KEY", "offline")
    assert not (wandb_home / "runs").exists()


# -- FSDP2: a sharded checkpoint (a folder torch distributed checkpoint writes) -----------
FSDP = [*COMMON, "strategy.name=fp8state_fsdp", "trainer.max_steps=20", "out_dir=runs"]


def test_a_file_size_limit_at_an_fsdp_checkpoint_is_one_line_and_exit_3(run_root):
    """torch's shard writer keeps no OSError: ``RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598`` inside a CheckpointException, a
    traceback, and a half-written ``step=10.ckpt/`` left in the run."""
    env = launch_env()
    env.update(WANDB_SILENT="true", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    limit = 128 * 1024  # above every run file and DCP's .metadata (~40 KiB), below the shard file (~550 KiB)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "lightning_fp8state", "train", *FSDP]
    done = subprocess.run(cmd, cwd=run_root, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert_one_clean_error(done.stderr, "step=10.ckpt", "file-size limit", "128.0 KiB", "start the run again")
    assert not (run_root / "runs" / "tiny_gpt_cpu").exists()


@pytest.mark.parametrize(
    ("failing", "kept"), [(3, ["last.ckpt", "step=10.ckpt"]), (4, ["last.ckpt", "step=10.ckpt", "step=20.ckpt"])]
)
def test_a_full_disk_at_an_fsdp_checkpoint_keeps_the_last_good_one_whole(run_root, capsys, monkeypatch, failing, kept):
    """The disk fills in the shard file of the run's third checkpoint folder (step=20.ckpt) or its
    fourth (last.ckpt at step 20). Lightning wrote into the folder itself: a half-written
    step=20.ckpt/ stayed, and last.ckpt's shard file was truncated in place; the error was a
    traceback. The disk is full where the OS says so: a shard file's write raises ENOSPC, and
    the file system reports no space free from then on."""
    real_open, real_usage = Path.open, shutil.disk_usage
    folders: list[str] = []
    full = []

    def open_(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        if self.name.endswith(".distcp") and "w" in mode:
            if not folders or folders[-1] != self.parent.name:
                folders.append(self.parent.name)
            if len(folders) == failing:
                full.append(self)
                return _FullDiskFile(file, room=4096)
        return file

    def disk_usage(path):
        usage = real_usage(path)
        return usage._replace(free=0) if full else usage

    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train(*FSDP)
    err = capsys.readouterr().err
    assert full, "no checkpoint write met the full disk"
    name = "step=20.ckpt" if failing == 3 else "last.ckpt"
    ckpts = Path("runs") / "tiny_gpt_cpu" / "checkpoints"
    assert code == 3, err[-3000:]
    assert_one_clean_error(err, str(ckpts / name), "no space left", "then continue: fp8state train --resume")
    assert ("The previous file is kept as it was" in err) == (name == "last.ckpt")
    assert sorted(p.name for p in ckpts.iterdir()) == kept  # no half-written folder, no temporary
    shard = "__0_0.distcp"
    assert (ckpts / "last.ckpt" / shard).read_bytes() == (ckpts / "step=10.ckpt" / shard).read_bytes()
    assert torch.load(ckpts / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 10


def test_the_temporary_folders_a_killed_fsdp_save_leaves_are_removed_at_the_resume(run_root, capsys):
    """A sharded save killed before its folder was moved into place leaves ``.step=N.ckpt.XXXX.tmp/``
    (or, between the two renames, the previous ``.last.ckpt.XXXX.old.tmp/``); the resume's
    clean-up unlinked temporaries as files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert train(*FSDP) == 0
    ckpts = run_root / "runs" / "tiny_gpt_cpu" / "checkpoints"
    left = [ckpts / ".step=30.ckpt.k1ll3d.tmp", ckpts / ".last.ckpt.k1ll3d.old.tmp"]
    for folder in left:
        shutil.copytree(ckpts / "last.ckpt", folder)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert train("--resume", str(ckpts.parent), "trainer.max_steps=30") == 0, capsys.readouterr().err[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step=20.ckpt", "step=30.ckpt"]
