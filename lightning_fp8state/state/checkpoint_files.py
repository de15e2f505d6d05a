"""Reading checkpoint files without running code in them.

A run directory may come from someone else, and a pickle can call any function it names
(``os.system``) while it is read. Every checkpoint file this package opens is therefore read
with ``torch.load(weights_only=True)``, which builds only tensors, plain containers and
numbers, plus an explicit allowlist of the few other types our checkpoints hold:

- a Lightning checkpoint (``last.ckpt``, ``step=N.ckpt``, FSDP2's ``meta.pt``): nothing beyond
  torch's own defaults (the quantizer state is tensors and plain numbers by design);
- a DeepSpeed shard (``*_model_states.pt``, ``*_optim_states.pt``): DeepSpeed stores its
  configuration object (``ds_config``), its loss scaler, ``ZeroStageEnum`` and
  ``fragment_address``; those are allowed by name (:data:`DEEPSPEED_TYPES`), and the classes
  ``ds_config`` is made of by where they are defined (DeepSpeed's ``*config`` modules);
- torch distributed checkpoint's ``.metadata`` (written with plain ``pickle``, which
  ``weights_only`` cannot parse): read by a restricted unpickler that resolves only the
  metadata dataclasses, ``torch.Size``, dtypes and paths (:data:`DCP_METADATA_TYPES`).

DeepSpeed's engine and torch's DCP reader unpickle their files themselves: :func:`check_checkpoint`
reads every file of a checkpoint this way first, so a file that names anything else is refused
(:class:`~lightning_fp8state.errors.UntrustedCheckpointError`, naming the file and the type)
before those loaders see it, and nothing in it has run.
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import UntrustedCheckpointError

__all__ = [
    "DCP_METADATA_TYPES",
    "DEEPSPEED_TYPES",
    "check_checkpoint",
    "checkpoint_files",
    "deepspeed_safe_globals",
    "load_checkpoint_file",
    "load_dcp_metadata",
]

# (module, name) of the non-tensor types a DeepSpeed shard holds besides its configuration models
DEEPSPEED_TYPES = (
    ("deepspeed.runtime.config", "DeepSpeedConfig"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.module_inject.auto_ep_presets.base", "AutoEPConfig"),
    ("builtins", "set"),
    ("builtins", "object"),
)
# (module, name) that torch distributed checkpoint's .metadata may name (besides torch dtypes)
DCP_METADATA_TYPES = (
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
)
DCP_METADATA_FILE = ".metadata"
_REFUSED = (  # how torch's weights_only unpickler names what it refused
    re.compile(r"GLOBAL ([\w.]+)"),
    re.compile(r"add_safe_globals`,? but got <class '([\w.]+)'>"),
    re.compile(r"reduce for unrecognized function (.+?)(?: which belongs|$)", re.M),
)


def _resolve(names: Iterable[tuple[str, str]]) -> list[Any]:
    """The objects behind ``names`` that exist in the installed versions (others are skipped)."""
    out = []
    for module, name in names:
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return out


def _deepspeed_config_models() -> list[type]:
    """The classes defined in DeepSpeed's configuration modules (``deepspeed.*.config``,
    ``*_config``; already imported ones only): what its ``ds_config`` object is made of. They
    hold parsed settings; building one runs no code from the file."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("deepspeed.") or module is None or not name.rsplit(".", 1)[-1].endswith("config"):
            continue
        found += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
    return found


def deepspeed_safe_globals() -> list[Any]:
    """The allowlist for DeepSpeed's shards (imports DeepSpeed's engine module)."""
    try:
        importlib.import_module("deepspeed.runtime.engine")  # imports every config module it uses
    except ImportError:
        return []
    types = _resolve(DEEPSPEED_TYPES) + _deepspeed_config_models()
    return list(dict.fromkeys(types))


def _refused_type(exc: BaseException) -> str | None:
    for pattern in _REFUSED:
        m = pattern.search(str(exc))
        if m:
            return m.group(1)
    return None


def load_checkpoint_file(
    path: str | Path, *, map_location: Any = "cpu", mmap: bool = False, safe_globals: Iterable[Any] = ()
) -> Any:
    """``torch.load(path, weights_only=True)`` with ``safe_globals`` allowed too.

    Raises:
        UntrustedCheckpointError: the file names a type or function outside the allowlist
            (it could run code); nothing in it ran.
        Other errors of ``torch.load`` (a truncated or corrupt file) propagate unchanged.
    """
    path = Path(path)
    with torch.serialization.safe_globals(list(safe_globals)):
        try:
            try:
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            except RuntimeError as exc:
                if not mmap or "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location=map_location, weights_only=True)  # legacy (non-zip) format
        except pickle.UnpicklingError as exc:
            refused = _refused_type(exc)
            if refused is not None:
                raise UntrustedCheckpointError(path, refused) from None
            raise pickle.UnpicklingError(f"not a readable checkpoint ({_inner_reason(exc)})") from None


def _inner_reason(exc: BaseException) -> str:
    """The reason inside torch's weights_only message, without its advice about PyTorch 2.6."""
    noise = ("Weights only load failed", "In PyTorch", "(1)", "(2)", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(noise)]
    return useful[0] if useful else "a corrupt pickle"


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allowlisted DCP metadata types and torch dtypes."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = {(m, n) for m, n in DCP_METADATA_TYPES}

    def find_class(self, module: str, name: str):
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpointError(self._path, f"{module}.{name}")


def load_dcp_metadata(path: str | Path) -> Any:
    """Torch distributed checkpoint's ``.metadata`` (plain pickle), read by a restricted
    unpickler: UntrustedCheckpointError for any type outside :data:`DCP_METADATA_TYPES`."""
    path = Path(path)
    return _MetadataUnpickler(io.BytesIO(path.read_bytes()), path).load()


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files a loader would unpickle in a checkpoint: the file itself, or every ``*.pt``
    (and DCP ``.metadata``) file under a checkpoint directory (DeepSpeed, FSDP2)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix == ".pt" or p.name == DCP_METADATA_FILE))


def check_checkpoint(path: str | Path, *, deepspeed: bool | None = None) -> None:
    """Read every file of the checkpoint at ``path`` the safe way (memory-mapped: tensor data is
    not read), so that a loader that unpickles it afterwards (DeepSpeed's engine, DCP) sees only
    files that hold nothing but data.

    Args:
        path: a checkpoint file, or a checkpoint directory (DeepSpeed's, or FSDP2's DCP one).
        deepspeed: allow DeepSpeed's types; default: when ``path`` is a directory without a DCP
            ``.metadata`` (a DeepSpeed checkpoint).

    Raises:
        UntrustedCheckpointError: a file names a type outside the allowlist.
    """
    path = Path(path)
    files = checkpoint_files(path)
    if deepspeed is None:
        deepspeed = path.is_dir() and not (path / DCP_METADATA_FILE).is_file()
    allowed = deepspeed_safe_globals() if deepspeed else []
    for f in files:
        if f.name == DCP_METADATA_FILE:
            load_dcp_metadata(f)
        else:
            load_checkpoint_file(f, mmap=True, safe_globals=allowed)
