"""AtomicCheckpointIO: Lightning checkpoints written to a temporary file, then renamed.

Reads are ``torch.load(weights_only=True)`` (``state/checkpoint_files.py``): a checkpoint that
names any other type is refused before anything in it runs.

A checkpoint file is either the old one or the new one, never a torn mix: a kill, a crash or
a full disk during a save leaves the previous file in place. Lightning's own ``_atomic_save``
stages the file through fsspec's transaction, whose temporary file lives in the system's
temp directory; when that is another file system (``/tmp`` on tmpfs) the final move is a
copy onto the target, which is not atomic. Here the temporary file sits next to the target
(same file system), is flushed to disk, and replaces it with ``os.replace``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from ..config import require_that
from ..errors import DiskFullError, RunDirectoryError, file_size_limit
from ..state.checkpoint_files import load_checkpoint_file

__all__ = [
    "TMP_SUFFIX",
    "AtomicCheckpointIO",
    "RunCheckpoint",
    "checkpoint_nbytes",
    "no_room_cause",
    "no_room_error",
    "remove_temporary",
    "replace_directory",
    "write_atomic",
]

TMP_SUFFIX = ".tmp"  # what a save interrupted by SIGKILL may leave behind: `.NAME.XXXX.tmp`
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NO_ROOM = (*DISK_FULL, errno.EFBIG)  # EFBIG: past the process's file-size limit (ulimit -f)


def checkpoint_nbytes(obj: Any) -> int:
    """About how many bytes ``torch.save(obj)`` writes: the tensors' storages (each once); of a
    ``DTensor``, this rank's shard (what a distributed checkpoint writes here)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            try:
                storage = local.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
                total += local.numel() * local.element_size()
                continue
            if ptr not in seen or ptr == 0:
                seen.add(ptr)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total + 64 * 1024  # the pickled structure and the zip records


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | os.PathLike, write, *, binary: bool = True, nbytes: int | None = None) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, flush it to disk, then rename
    it onto ``path``. On any error the temporary file is removed and ``path`` is untouched.

    Raises:
        DiskFullError: the disk (or quota) is full, or the file would pass the process's file-size
            limit; it names ``path``, ``nbytes`` (what the write needs, when the caller knows) and
            the space free there. Also when the write failed inside torch's zip writer, which
            reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc]`` with
            the ``OSError`` as its context.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        full = no_room_error(exc, path, nbytes)
        if full is not None and full is not exc:
            raise full from None
        raise
    _fsync_dir(path.parent)


def no_room_error(exc: BaseException, path: str | os.PathLike, nbytes: int | None) -> DiskFullError | None:
    """The :class:`DiskFullError` that ``exc``, raised by a write of ``path`` that needs about
    ``nbytes``, stands for (see :func:`no_room_cause`); None when it is neither a full disk nor a
    file-size limit. It names the space free now."""
    if isinstance(exc, DiskFullError):
        return exc
    cause = no_room_cause(exc, path, nbytes)
    return None if cause is None else DiskFullError(path, nbytes, _free_near(path), cause)


def no_room_cause(exc: BaseException, path: str | os.PathLike, nbytes: int | None) -> OSError | None:
    """The ``OSError`` (``ENOSPC``/``EDQUOT``/``EFBIG``) behind ``exc``, a failed write of ``path``
    that needs about ``nbytes``; None when there is none.

    It is ``exc`` itself, or one that ``exc`` was raised while handling (torch's zip writer turns
    a failed write into ``RuntimeError: [enforce fail at inline_container.cc]``), also inside a
    distributed checkpoint's ``CheckpointException``. That writer's own C++ file streams (torch
    distributed checkpoint's shard files) keep no ``OSError``: there a failed write with fewer
    than ``nbytes`` free, or a file-size limit below ``nbytes``, says it. Ask before removing what
    the write left (that frees space).
    """
    cause = _no_room(exc)
    if cause is None and nbytes is not None and _lost_write(exc):
        free, limit = _free_near(path), file_size_limit()
        if free is not None and free < nbytes:
            cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif limit is not None and limit < nbytes:
            cause = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    return cause


def _free_near(path: str | os.PathLike) -> int | None:
    """The bytes free on the file system that ``path`` is (or would be) on."""
    folder = Path(path).parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _no_room(exc: BaseException | None) -> OSError | None:
    """The full-disk or file-size ``OSError`` that ``exc`` is, or that it was raised while
    handling (torch's zip writer turns a failed write into a ``RuntimeError``), or that a rank
    of a distributed checkpoint failed with (``CheckpointException.failures``)."""
    for _ in range(8):  # a short chain: the writer's error, the OSError, maybe a close's
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc
        for failure in _rank_failures(exc):
            found = _no_room(failure)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def _lost_write(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's C++ writer's failed write (on one rank at least)."""
    return (isinstance(exc, RuntimeError) and "inline_container.cc" in str(exc)) or any(
        _lost_write(failure) for failure in _rank_failures(exc)
    )


def _rank_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions of torch distributed checkpoint's ``CheckpointException`` (rank: (exception,
    traceback)); none for any other."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, (tuple, BaseException))]


def replace_directory(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move the folder ``tmp`` (written in full) onto ``path``, replacing what is there.

    Two renames: ``path`` is never a half-written folder. A kill between them leaves the previous
    one as ``.NAME.XXXX.old.tmp`` beside it, a temporary like any other (a resume removes them).
    """
    tmp, path = Path(tmp), Path(path)
    old = None
    if os.path.lexists(path):
        old = tmp.with_name(f"{tmp.name.removesuffix(TMP_SUFFIX)}.old{TMP_SUFFIX}")
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        remove_temporary(old)


def remove_temporary(path: Path) -> None:
    """Remove a temporary file or folder (``.NAME.XXXX.tmp``) that a save left; a link is removed, not followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (write a temporary file, then rename).

    Example::

        Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        require_that(
            storage_options is None,
            "AtomicCheckpointIO.save_checkpoint(storage_options)",
            repr(storage_options),
            "None (pass a custom CheckpointIO for those)",
        )
        write_atomic(path, lambda f: torch.save(checkpoint, f), nbytes=checkpoint_nbytes(checkpoint))

    @override
    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Always ``weights_only=True`` with our allowlist, whatever the caller asks: a run
        directory may come from someone else (UntrustedCheckpointError names a refused type)."""
        if not Path(path).exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(path, map_location=map_location or (lambda storage, loc: storage))


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(filename="{step}", monitor="step", mode="max")`` that saves the run's last
    step, saves at a preemption, and keeps pruning after a resume, whatever the directory is
    called and whatever the resume changed.

    The last step: ``every_n_train_steps`` alone leaves the steps after the last multiple unsaved
    (``max_steps=12`` with every 5 saved step 10), and Lightning's ``on_train_end`` writes
    ``last.ckpt`` only when no ``last.ckpt`` was saved before; here the step that reaches
    ``max_steps`` is always saved (``step=N.ckpt`` and ``last.ckpt``), so "steps: N" means the
    checkpoint is at N.

    A preemption: Lightning's signal connector turns SIGTERM into a ``SIGTERMException`` at the
    next batch boundary (after the optimizer step and ``on_train_batch_end``), then calls every
    callback's ``on_exception``; that one exception is saved here like a periodic checkpoint (any
    other exception is not: it may have stopped mid-step). SIGHUP (a closed terminal, some
    schedulers) is forwarded as SIGTERM for the time of the fit, so it stops the same way.

    Lightning restores which checkpoints it kept (``best_k_models``) only when the saved
    ``dirpath`` string equals the current one, and only under a callback state key that holds
    ``every_n_train_steps``: resumed through an absolute path, from a copied run directory, or
    with another ``trainer.checkpoint_every_n_steps``, it forgot them and never removed the
    older ``step=N.ckpt`` again. Here the kept set is read from the directory itself when
    training starts: the ``save_top_k`` newest ``step=N.ckpt`` are kept, older ones removed.
    """

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._hangup = None
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
            self._hangup = signal.signal(signal.SIGHUP, _hangup_as_sigterm)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        if getattr(self, "_hangup", None) is not None:
            signal.signal(signal.SIGHUP, self._hangup)
            self._hangup = None
        super().teardown(trainer, pl_module, stage)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            self._save_now(trainer)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self._save_now(trainer)

    @override
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        """Refuse to save when the directory that held the checkpoints' folder at the start is gone
        (the run directory moved or deleted mid-run): saving would create a stray copy of it at
        the old path."""
        run_dir = getattr(self, "_run_dir", None)
        if run_dir is not None and not run_dir.is_dir():
            raise RunDirectoryError(
                f"{run_dir} was moved or deleted during the run, so the checkpoint of step {trainer.global_step} "
                "cannot be saved there; the run stops. Resume it where it is now: fp8state train --resume <its new path>"
            )
        super()._save_checkpoint(trainer, filepath)

    @override
    def _should_remove_checkpoint(self, trainer, previous: str, current: str) -> bool:
        """Lightning never removes the checkpoint it resumed from; here a ``step=N.ckpt`` of this
        directory goes like any other once two newer ones are saved (a resume that fell back to
        an older checkpoint kept it for good)."""
        if previous == current or self.dirpath is None:
            return False
        previous_path = Path(previous).absolute()
        return previous_path.parent == Path(self.dirpath).absolute() and previous_path.name.startswith("step=")

    def _save_now(self, trainer) -> None:
        """Save ``step=N.ckpt`` and ``last.ckpt`` at this step, unless saved already."""
        if self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the kept set comes from the directory (on_train_start): no "dirpath has changed" warning
        super().load_state_dict(dict(state_dict, dirpath=self.dirpath))

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        parent = Path(self.dirpath).parent if self.dirpath is not None else None
        self._run_dir = parent if parent is not None and parent.is_dir() else None
        if self.dirpath is None or self.save_top_k < 1 or self.monitor != "step":
            return
        found = []
        for path in Path(self.dirpath).glob("step=*.ckpt"):
            step = path.name[len("step=") : -len(".ckpt")]
            if step.isdigit():
                found.append((int(step), path))
        found.sort(reverse=True)
        keep, older = found[: self.save_top_k], found[self.save_top_k :]
        if trainer.is_global_zero:
            for _, path in older:
                trainer.strategy.remove_checkpoint(path)
        self.best_k_models = {str(path): torch.tensor(step) for step, path in keep}
        if keep:
            self.best_model_path, self.best_model_score = str(keep[0][1]), torch.tensor(keep[0][0])
            self.kth_best_model_path, self.kth_value = str(keep[-1][1]), torch.tensor(keep[-1][0])


def _hangup_as_sigterm(signum, frame) -> None:
    """SIGHUP, handled as the SIGTERM Lightning already handles (a checkpoint at the next step)."""
    os.kill(os.getpid(), signal.SIGTERM)
