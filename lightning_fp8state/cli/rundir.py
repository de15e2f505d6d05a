"""The run directory: claimed atomically by rank 0, its files, and what is left of a failed run.

A new run's directory is ``out_dir/name``, or ``name-2``, ``name-3``, ... when taken: rank 0
claims it with ``os.mkdir`` (atomic: two runs started together never share one), holds its
``.lock``, exports its path to the ranks it launches (``FP8STATE_RUN_DIR``), and every rank
receives it again from rank 0 over the process group once that exists (``SharedRunDir``). Other
ranks never create or write anything there themselves (:func:`run_directory`).

Rank 0 writes the run files at fit start (``RunFiles``): the resolved ``config.yaml``,
``provenance.json`` (what produced the run, and where a resume continued it) and
``conversion.json``; each checkpoint records the configuration it was trained with
(:data:`RUN_CONFIG_KEY`). A new run that ends before its first checkpoint leaves no directory.
Every entry fp8state keeps there (:data:`RUN_ENTRIES`) is opened without following a link.
A resume is validated by :mod:`lightning_fp8state.cli.resume` before anything here changes.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, DiskFullError, RunDirectoryError
from ..ops import cuda as cuda_ext
from .loader_position import carry_loader_position

__all__ = [
    "RUN_CONFIG_KEY",
    "RUN_DIR_ENV",
    "RUN_ENTRIES",
    "claim_run_dir",
    "launch_rank",
    "lock_run_dir",
    "provenance",
    "remove_if_empty_run",
    "report_interrupted",
    "require_no_links",
    "resume_command",
    "rewrite_run_files",
    "run_directory",
    "run_files_callback",
    "shared_run_dir_callback",
    "wandb_run_id",
    "write_run_files",
    "write_text_atomic",
]

RUN_DIR_ENV = "FP8STATE_RUN_DIR"
RUN_CONFIG_KEY = "fp8state_run_config"  # the resolved run configuration a checkpoint was trained with
WANDB_ID_FILE = "wandb_run_id"


def launch_rank() -> int:
    """This process's global rank as its launcher set it in the environment (0 when nothing
    is set): ``RANK`` (torchrun), ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``, or Lightning's
    own launcher's ``NODE_RANK``/``LOCAL_RANK`` (any non-zero one means "not rank 0")."""
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return 0 if node == 0 and local == 0 else max(1, local)


def claim_run_dir(out_dir: str | os.PathLike, name: str) -> Path:
    """Create and return ``out_dir/name`` or the first free ``name-N``; atomic (``os.mkdir``
    fails if another process took the name first, and the next number is tried)."""
    base = Path(out_dir)
    n = 1
    while True:
        path = base / (name if n == 1 else f"{name}-{n}")
        try:
            base.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except FileExistsError:
            if not base.is_dir():  # out_dir itself is a file
                raise ConfigError(f"out_dir={str(base)!r} is a file: pass a directory") from None
            n += 1
            continue
        except OSError as exc:
            raise ConfigError(
                f"out_dir={str(base)!r}: cannot create the run directory {str(path)!r} ({exc.strerror}); "
                "pass a writable out_dir=..."
            ) from exc
        return path


LOCK_FILE = ".lock"
# Every entry of a run directory that fp8state writes or reads. None may be a symbolic link: a run
# directory may come from someone else, and a link would lead a write (or a prune) anywhere.
RUN_ENTRIES = {
    "config.yaml": "file",
    "provenance.json": "file",
    "conversion.json": "file",
    "telemetry.jsonl": "file",
    WANDB_ID_FILE: "file",
    LOCK_FILE: "file",
    "checkpoints": "folder",
    "wandb": "folder",
    "report": "folder",
}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def require_no_links(run_dir: Path, entries=RUN_ENTRIES) -> None:
    """Refuse a run directory in which one of ``entries`` is a symbolic link, or not the kind of
    entry fp8state keeps there (a folder where a file belongs, a FIFO, a device: opening one hung
    or raised), before anything there is read or written (RunDirectoryError naming it)."""
    for name in entries:
        path = run_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise RunDirectoryError(
                f"{path} is a symbolic link (to {os.readlink(path)!r}): fp8state never writes or reads a run's "
                "files through a link (a received run directory could point them anywhere); remove the link, "
                "or put a copy of what it points to in its place"
            )
        kind = RUN_ENTRIES.get(name, "file")
        if not (stat.S_ISDIR(mode) if kind == "folder" else stat.S_ISREG(mode)):
            raise RunDirectoryError(
                f"{path} is not a {kind}, as fp8state keeps it there: the run directory was changed by hand; "
                f"remove or move {path.name}, then resume"
            )


def lock_run_dir(run_dir: Path):
    """Hold ``RUN_DIR/.lock`` (an advisory ``flock``) for as long as the returned file is open:
    a second process that resumes the same run at the same time is refused, with the holder's
    pid. Taken by rank 0 once everything is validated; opened without following a link. Returns
    None where ``flock`` is missing.

    Raises:
        RunDirectoryError: another process holds it, or it cannot be created (a read-only run
            directory), or it is a link.
    """
    try:
        import fcntl  # noqa: PLC0415  (POSIX only)
    except ImportError:
        return None
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError as exc:
        if os.path.islink(path):
            require_no_links(run_dir, (LOCK_FILE,))
        raise RunDirectoryError(
            f"{path} cannot be created ({exc.strerror}): a run directory must be writable to train in it; "
            "copy the run somewhere writable and resume the copy"
        ) from None
    f = os.fdopen(fd, "r+", encoding="utf-8")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirectoryError(
            f"{run_dir} is in use by a running fp8state process ({holder}): wait for it to end, "
            "or stop it; two processes never share a run directory"
        ) from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
    except OSError as exc:  # a full disk: name the file (the bare error said only "a file")
        f.close()
        free = shutil.disk_usage(run_dir).free if run_dir.is_dir() else None
        raise DiskFullError(path, 64, free, exc) if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc from None
    return f


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (never half written)."""
    from ..lightning.checkpoint_io import write_atomic  # noqa: PLC0415  (Lightning: imported only when writing)

    write_atomic(path, lambda f: f.write(text), binary=False, nbytes=len(text.encode("utf-8")))


def wandb_run_id(run_dir: Path, *, create: bool) -> str | None:
    """The W&B run id kept in the run directory (so a resume continues the same W&B run);
    a new one is written when ``create`` and there is none."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and not path.is_symlink():
        with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), encoding="utf-8", errors="replace") as f:
            text = f.read(256).strip()
        if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
            return text
    if not create:
        return None
    run_id = uuid.uuid4().hex[:12]
    write_text_atomic(path, run_id + "\n")
    return run_id


def remove_if_empty_run(run_dir: Path) -> bool:
    """Remove a new run's directory if the run saved no checkpoint: nothing in it can be resumed,
    so a run that failed (or was stopped) before its first checkpoint leaves no half-made
    directory. Returns whether removed."""
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(ckpts.iterdir()):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


@contextmanager
def run_directory(cfg: DictConfig, resume: str | None, rank: int) -> Iterator[Path]:
    """The run's directory, held for the body of the ``with``: ``resume`` when given; for a new
    run, rank 0 claims one (:func:`claim_run_dir`) and exports it to the ranks Lightning launches,
    which take it from there. Rank 0 holds its lock (:func:`lock_run_dir`: a concurrent resume
    of this run is refused). A new run that fails before its first checkpoint is removed."""
    fresh = resume is None
    if not fresh:
        run_dir = Path(resume)
    elif rank == 0:
        run_dir = claim_run_dir(cfg.out_dir, cfg.name)
    else:  # a launched rank: rank 0's directory (the broadcast in SharedRunDir confirms it)
        run_dir = Path(os.environ.get(RUN_DIR_ENV) or Path(cfg.out_dir) / cfg.name)
    lock = lock_run_dir(run_dir) if rank == 0 else None
    exported = rank == 0 and fresh
    if exported:
        os.environ[RUN_DIR_ENV] = str(run_dir)  # the ranks Lightning launches inherit it
    try:
        yield run_dir
    except BaseException:
        if fresh and rank == 0:
            if lock is not None:
                lock.close()
                lock = None
            remove_if_empty_run(run_dir)  # a run that failed before its first checkpoint leaves nothing
        raise
    finally:
        if exported:
            os.environ.pop(RUN_DIR_ENV, None)
        if lock is not None:
            lock.close()


def resume_command(run_dir: Path, *overrides: str) -> str:
    """The command that continues the run in ``run_dir``, quoted for the shell."""
    return shlex.join(["fp8state", "train", "--resume", str(run_dir), *overrides])


def report_interrupted(run_dir: Path, step: int, *, fresh: bool, stopping: bool, checkpointing: bool = True) -> int:
    """Say where an interrupted run stands (exit 130). With a checkpoint: which one, and the command
    that continues from it. Without one (a new run stopped before its first save): nothing can be
    resumed, so the run's directory is removed and the line says to start again. A run without
    checkpoints (``checkpointing`` false) keeps its directory, its telemetry, and says so."""
    saved = sorted((run_dir / "checkpoints").glob("step=*.ckpt"), key=lambda p: p.stat().st_mtime)
    how = "stopped by a signal (SIGTERM or SIGHUP)" if stopping else "interrupted"
    if not checkpointing:
        print(
            f"fp8state: {how} at step {step}; trainer.enable_checkpointing=false, so nothing can be resumed; "
            f"the run directory {run_dir} keeps its telemetry",
            file=sys.stderr,
        )
    elif saved:
        print(
            f"fp8state: {how} at step {step}; the last checkpoint is {saved[-1]}. "
            f"Continue with: {resume_command(run_dir)}",
            file=sys.stderr,
        )
    elif fresh:
        remove_if_empty_run(run_dir)
        print(
            f"fp8state: {how} at step {step}, before the first checkpoint: nothing to resume, and the run "
            f"directory {run_dir} was removed; start the run again",
            file=sys.stderr,
        )
    else:
        print(f"fp8state: {how} at step {step}; no checkpoint was saved in {run_dir / 'checkpoints'}", file=sys.stderr)
    return 130


# -- the run files ---------------------------------------------------------------------------
def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown (installed package)"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """What produced a run: package, git commit, Python, torch, CUDA and the built extension."""
    from .. import __version__

    return {
        "package": "lightning_fp8state",
        "version": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda_extension": cuda_ext.extension_info(),
        "command": sys.argv,
    }


def write_run_files(
    run_dir: Path, cfg: DictConfig, plan=None, conversion: dict | None = None, resharded: dict | None = None
) -> None:
    """``config.yaml``, ``provenance.json`` (and ``conversion.json`` when given), each replaced
    in one rename. A resumed run's provenance keeps what started the run (``started_as``) and
    says where it resumed (``plan``: its :class:`~lightning_fp8state.cli.resume.ResumePlan`) and,
    on another world size, what was mapped (``resharded``: the world sizes, the owners copied
    and merged, the data position)."""
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if conversion is not None:
        write_text_atomic(run_dir / "conversion.json", json.dumps(conversion, indent=1))
    doc = provenance()
    try:
        prior = json.loads((run_dir / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        prior = {}
    if plan is not None or "started_as" in prior:
        doc["started_as"] = prior.get("started_as") or {
            k: prior.get(k) for k in ("version", "git_commit", "torch", "gpu", "command")
        }
        resumed = prior.get("resumed_from") if plan is None else {"checkpoint": str(plan.checkpoint), "step": plan.step}
        if plan is not None and resharded is not None:
            resumed["world_size"] = resharded
        doc["resumed_from"] = resumed
    write_text_atomic(run_dir / "provenance.json", json.dumps(doc, indent=1, default=str))


def rewrite_run_files(run_dir: Path, cfg: DictConfig) -> None:
    """The run files written again when the run ends: the CUDA extension (and its hash) is known
    only now. A run directory moved or deleted mid-run is not recreated (the telemetry has said
    so); a full disk is a warning, not a failure (the run itself is saved)."""
    try:
        if run_dir.is_dir():
            write_run_files(run_dir, cfg)
    except DiskFullError as exc:
        print(f"fp8state: warning: {exc}; the run's files keep what they said at its start", file=sys.stderr)


def _remove_stale_temporaries(run_dir: Path) -> None:
    """Remove what saves killed mid-write left behind (``.last.ckpt.XXXX.tmp``, a file or, for a
    sharded checkpoint, a folder)."""
    from ..lightning.checkpoint_io import TMP_SUFFIX, remove_temporary

    for tmp in (run_dir / "checkpoints").glob(f".*{TMP_SUFFIX}"):
        remove_temporary(tmp)


# -- a resume on another world size ------------------------------------------------------------
def _resharded(report, loader) -> dict | None:
    """What the mapping did, as ``provenance.json`` keeps it; the data position said in one line
    (rank 0), beside the callback's line on the quantizer state."""
    if report is None:
        return None
    data = (
        loader.describe() if loader is not None else "the checkpoint holds no loader position: the epoch starts again"
    )
    print(
        f"fp8state: on {report.world} rank(s) (saved by {report.saved_world}), {data}; the quantizer owners copied "
        "and merged are named in provenance.json"
    )
    doc = report.to_dict()
    doc["data"] = {"continues_at_sample": loader.sample, "repeated_samples": loader.repeated} if loader else None
    return doc


# -- the callbacks that keep the run directory -------------------------------------------------
def shared_run_dir_callback(run_dir: Path, telemetry, checkpoint):
    """A callback that makes every rank use rank 0's run directory once the process group
    exists (``strategy.broadcast``): the telemetry and checkpoint directories follow it."""
    from lightning.pytorch.callbacks import Callback

    class SharedRunDir(Callback):
        def __init__(self) -> None:
            self.run_dir = run_dir

        def setup(self, trainer, pl_module, stage: str) -> None:
            self.run_dir = Path(trainer.strategy.broadcast(str(self.run_dir), src=0))
            telemetry.run_dir = self.run_dir
            if checkpoint is not None:  # None: trainer.enable_checkpointing=false
                checkpoint.dirpath = str(self.run_dir / "checkpoints")

    return SharedRunDir()


def run_files_callback(run_dir: Path, cfg: DictConfig, plan, fp8_callback):
    """A callback that writes the run's files at fit start: after a resume's checkpoint has been
    loaded (a load that fails leaves the directory as it was), before the first step."""
    from lightning.pytorch.callbacks import Callback

    class RunFiles(Callback):
        def __init__(self) -> None:
            self.loader = None  # on another world size: the data position carried over

        def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            # before Lightning restores its loops: the loader's position, in samples, on this world size
            if plan is not None and plan.reshard is not None:
                self.loader = carry_loader_position(checkpoint, trainer.world_size, cfg.data.batch_size)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            # the configuration the checkpoint was trained with (plain values: weights_only loads
            # it): a resume compares config.yaml with it key by key
            checkpoint[RUN_CONFIG_KEY] = OmegaConf.to_container(cfg, resolve=True)

        def on_fit_start(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                write_run_files(run_dir, cfg, plan, conversion=fp8_callback.conversion.to_dict())
                if plan is not None:
                    _remove_stale_temporaries(run_dir)

        def on_train_start(self, trainer, pl_module) -> None:
            # on another world size, what the load did (FSDP2 loads after on_fit_start, DDP before)
            if trainer.is_global_zero and plan is not None and plan.reshard is not None:
                resharded = _resharded(fp8_callback.reshard_report, self.loader)
                write_run_files(run_dir, cfg, plan, conversion=fp8_callback.conversion.to_dict(), resharded=resharded)

    return RunFiles()
