"""Errors raised by lightning_fp8state; each subclasses the nearest builtin."""

from __future__ import annotations

import errno
import os

__all__ = [
    "AlreadyConvertedError",
    "AmbiguousRecomputeError",
    "ConcurrentEntryError",
    "ConfigError",
    "ConversionWarning",
    "DiskFullError",
    "OwnerAlignmentError",
    "RunDirectoryError",
    "SelectiveCheckpointError",
    "StaleSnapshotError",
    "StateLoadError",
    "StateTransitionError",
    "UntrustedCheckpointError",
]


class ConfigError(ValueError):
    """A configuration key has a value outside what is allowed."""


class RunDirectoryError(ConfigError):
    """A run directory cannot be used as asked: ``--resume`` of an unreadable checkpoint, of a
    configuration the checkpoint was not made with, or with an override a resume cannot take.
    Raised before anything in the directory is changed (the CLI exits with code 2)."""


class StateTransitionError(RuntimeError):
    """Quantizer state would advance in a way the protocol forbids.

    Raised in strict mode on a second commit of one owner in one logical event, on a
    recompute that tries to record an amax, on an owner entered by several layers in one
    event (wrong ownership scope), or on a recording forward outside ``Fp8State.step``.
    """


class ConcurrentEntryError(RuntimeError):
    """A second stream (or thread) entered an owner that is in flight on another one."""


class AlreadyConvertedError(ValueError):
    """A model's layers were converted by another ``Fp8State``: a second state would own none of
    them (it converted nothing, then failed later with a misleading message)."""


class OwnerAlignmentError(RuntimeError):
    """Ranks registered different owners (or in another order), so their state banks cannot
    be combined index by index (amax reduction across the data-parallel group)."""


class StaleSnapshotError(RuntimeError):
    """A consumer was handed a snapshot stamped for another step, layer, role or owner."""


class AmbiguousRecomputeError(RuntimeError):
    """A recompute could not be matched to exactly one true-forward call."""


class StateLoadError(ValueError):
    """A saved quantizer state is corrupt or does not match the live one; nothing was loaded."""


class DiskFullError(OSError):
    """A file could not be written for lack of space (``ENOSPC``/``EDQUOT``) or because it would
    pass this process's file-size limit (``EFBIG``: ``ulimit -f``). The file it would have
    replaced is intact (every save writes a temporary and renames it); the message says so only
    where there was one, else that no partial file is left."""

    def __init__(self, path, needed: int | None, free: int | None, cause: OSError | None = None) -> None:
        code = cause.errno if cause is not None and cause.errno is not None else errno.ENOSPC
        need = f"it needs about {format_bytes(needed)}" if needed is not None else "it needs more space"
        kept = "The previous file is kept as it was" if os.path.lexists(path) else "No partial file is left"
        if code == errno.EFBIG:
            limit = file_size_limit()
            text = (
                f"cannot write {path}: it would pass this process's file-size limit "
                f"({format_bytes(limit) if limit is not None else 'ulimit -f'}); {need}. "
                f"{kept}; raise the limit (ulimit -f unlimited)"
            )
        else:
            why = f" ({cause.strerror})" if cause is not None and cause.strerror else ""
            have = f", {format_bytes(free)} free there" if free is not None else ""
            text = (
                f"no space left to write {path}{why}: {need}{have}. {kept}; free some space (or pass another out_dir)"
            )
        super().__init__(code, text)
        self.path, self.needed, self.free = path, needed, free

    def __str__(self) -> str:
        return self.strerror


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a digit before the point (``1.5 KiB``)."""
    value, unit = float(n), "bytes"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), None when unlimited or unknown."""
    try:
        import resource  # noqa: PLC0415  (POSIX only)
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


class UntrustedCheckpointError(StateLoadError):
    """A checkpoint file names a type or function outside the allowlist of what our checkpoints
    hold: unpickling it could run code (a pickled ``os.system`` call). Nothing in it has run."""

    def __init__(self, path, refused: str) -> None:
        self.path, self.refused = path, refused
        super().__init__(
            f"{path}: refused to load: it names {refused}, which no checkpoint of lightning_fp8state holds "
            "(only tensors, numbers, containers and an allowlist of DeepSpeed/torch types); reading it could "
            "run code from the file. Nothing in it was run: use a checkpoint from a source you trust"
        )


class SelectiveCheckpointError(RuntimeError):
    """Torch's selective activation checkpointing saw a different op sequence in a region's
    recompute than in its true forward (raised by :func:`lightning_fp8state.checkpoint`)."""


class ConversionWarning(UserWarning):
    """A converted layer never ran through the quantizer protocol (see ``Fp8State.warn_unowned``)."""
