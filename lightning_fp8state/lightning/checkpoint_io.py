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
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from ..errors import DiskFullError
from ..state.checkpoint_files import load_checkpoint_file

__all__ = ["TMP_SUFFIX", "AtomicCheckpointIO", "checkpoint_nbytes", "write_atomic"]

TMP_SUFFIX = ".tmp"  # what a save interrupted by SIGKILL may leave behind: `.NAME.XXXX.tmp`
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def checkpoint_nbytes(obj: Any) -> int:
    """About how many bytes ``torch.save(obj)`` writes: the tensors' storages (each once)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen or storage.data_ptr() == 0:
                seen.add(storage.data_ptr())
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
        DiskFullError: the disk (or quota) is full; it names ``path``, ``nbytes`` (what the
            write needs, when the caller knows) and the space free there.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and exc.errno in DISK_FULL:
            free = None
            with contextlib.suppress(OSError):
                free = shutil.disk_usage(path.parent).free
            raise DiskFullError(path, nbytes, free, exc) from None
        raise
    _fsync_dir(path.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (write a temporary file, then rename).

    Example::

        Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "AtomicCheckpointIO.save_checkpoint takes no storage_options, got "
                f"{storage_options!r}: pass a custom CheckpointIO for those"
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
