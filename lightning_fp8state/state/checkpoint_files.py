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
before those loaders see it, and nothing in it has run. What it checks beyond the files' types:

- nothing but regular files and folders in a checkpoint directory: no symbolic link (a linked
  folder was never walked, and a loader follows it), no FIFO or device (skipped by the walk,
  opened by DeepSpeed's glob);
- a DCP checkpoint: every DCP metadata file (``.metadata`` and the rank-local ``__N.metadata``
  torch's reader falls back to, with plain pickle, when the global one fails) names only DCP's
  metadata types, and ``.metadata`` holds DCP ``Metadata``; every storage path it names is a plain
  relative path to a regular file inside the checkpoint (a ``..`` pointed an item at any file
  beside it), read with no stream transform; every bytes item (the optimizer's ``param_groups``
  values, which DCP's default planner reads with ``torch.load(weights_only=False)``) is read with
  ``weights_only=True``. Every DCP load of ours (:func:`safe_dcp_load`) goes through
  :class:`SafeFileSystemReader` (the global ``.metadata`` only, read our way; the storage paths
  checked again) and :class:`SafeLoadPlanner` (bytes items read with ``weights_only=True``);
- a DeepSpeed checkpoint: ``latest`` and ``latest_universal`` (which name the tag folder DeepSpeed's
  engine opens) are one plain path component whose folder is inside the checkpoint, checked in
  any checkpoint directory (a ``.metadata`` planted in a DeepSpeed one made it pass for DCP);
- a file (or DCP bytes item) that torch's safe loader cannot even parse (a plain pickle of
  protocol 0, 1, 4 or 5; a torch checkpoint whose pickle is protocol 4 or 5, zip or legacy format)
  and that names a global the safe loader would refuse is refused as untrusted, not skipped as
  unreadable (a resume would otherwise fall back past a planted file); the names are found by an
  unpickler that resolves none of them (:class:`_NamesOnlyUnpickler`), so nothing in it runs.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import pickle
import re
import stat
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import StateLoadError, UntrustedCheckpointError

__all__ = [
    "DCP_METADATA_TYPES",
    "DEEPSPEED_LATEST",
    "DEEPSPEED_LATEST_FILES",
    "DEEPSPEED_TYPES",
    "SafeFileSystemReader",  # noqa: F822  (module __getattr__: DCP is imported on first use)
    "SafeLoadPlanner",  # noqa: F822
    "check_checkpoint",
    "checkpoint_files",
    "deepspeed_safe_globals",
    "load_checkpoint_file",
    "load_dcp_metadata",
    "zero_world_size",
    "safe_dcp_load",
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
DEEPSPEED_LATEST = "latest"  # DeepSpeed's engine reads the tag (the shard folder's name) from this file
DEEPSPEED_LATEST_FILES = (DEEPSPEED_LATEST, "latest_universal")  # the second one with load_universal on
_LATEST_MAX_BYTES = 4096
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
            refused = _refused_type(exc) or _pickled_callable(path)
            if refused is not None:
                raise UntrustedCheckpointError(path, refused) from None
            raise pickle.UnpicklingError(f"not a readable checkpoint ({_inner_reason(exc)})") from None


_LEGACY_PICKLES = 4  # torch's legacy format: the magic number, the protocol, sys_info, then the object
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}  # as protocols 0-2 name them


class _Inert:
    """What every global stands for while :class:`_NamesOnlyUnpickler` parses: calling,
    building or filling it does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return self

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


class _NamesOnlyUnpickler(pickle.Unpickler):
    """Python's own unpickler (every protocol, the stack as it really is: a global built from
    strings shuffled on the stack is named as it would resolve), but no global is resolved: each
    is recorded and stands in as :class:`_Inert`, so nothing from the file runs and no module is
    imported."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def find_class(self, module: str, name: str) -> type:
        self.names.append(f"{_PY2_MODULES.get(module, module)}.{name}")
        return _Inert

    def persistent_load(self, pid: Any) -> None:  # torch's storages: not read
        return None


def _safe_names() -> set[str]:
    """The globals torch's ``weights_only`` loader accepts now (its own and those allowed by
    ``torch.serialization.safe_globals``); empty where torch's private helpers are missing (then
    every global a pickle names counts as refused)."""
    try:
        from torch import _weights_only_unpickler as wo  # noqa: PLC0415

        return set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())
    except (ImportError, AttributeError, TypeError, ValueError):
        return set()


def _pickled_callable(source: Path | bytes) -> str | None:
    """What a file (or a DCP bytes item) the safe loader could not parse names that the safe
    loader would refuse: the first such global, or None. Covers every pickle protocol (0 and 1
    are text, 4 and 5 start with a FRAME torch's safe loader does not parse), torch's zip format
    (its ``data.pkl``) and its legacy format (a few pickles one after the other); a checkpoint
    that names only what torch allows (one saved with ``pickle_protocol=4``) is not called
    planted. Nothing in it runs (:class:`_NamesOnlyUnpickler`); tensor data is not read."""
    try:
        with open(source, "rb") if isinstance(source, Path) else io.BytesIO(source) as f:
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as z:
                    names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                    if not names:
                        return None
                    with z.open(names[0]) as member:  # streamed: the pickle, not the whole member in memory
                        return _first_refused_global(member, 1)
            f.seek(0)
            return _first_refused_global(f, _LEGACY_PICKLES)
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def _first_refused_global(f: Any, count: int) -> str | None:
    """:func:`_pickled_callable` over up to ``count`` pickles read one after the other from ``f``.
    A binary pickle (protocol 2 and up) counts as far as it parses; a text one (protocol 0/1: no
    PROTO opcode) only when it parses to its end, so that a damaged file whose first byte happens
    to be a text opcode is not called planted."""
    safe = _safe_names()
    for _ in range(count):
        head = f.read(1)
        if not head:
            return None
        binary = head == b"\x80"
        f.seek(-1, io.SEEK_CUR)
        unpickler = _NamesOnlyUnpickler(f)
        try:
            unpickler.load()
            complete = True
        except Exception:  # noqa: BLE001  (a damaged pickle: what it named before that still counts)
            complete = False
        refused = next((n for n in unpickler.names if n not in safe), None)
        if refused is not None and (binary or complete):
            return refused
        if not complete:
            return None
    return None


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
    """The files a loader would unpickle in a checkpoint: the file itself, or every ``*.pt`` file
    under a checkpoint directory (DeepSpeed, FSDP2) and every DCP metadata file: ``.metadata``, and
    the rank-local ``__N.metadata`` torch's reader falls back to when the global one fails."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    return sorted(
        p for p in path.rglob("*") if p.is_file() and (p.suffix == ".pt" or p.name.endswith(DCP_METADATA_FILE))
    )


def _refuse_links(path: Path) -> None:
    """No symbolic link at ``path`` or anywhere under it, and nothing but regular files and
    folders (walked with ``lstat``, links not followed): a loader would follow a link to files
    these checks never read, and these checks skip a FIFO or device that DeepSpeed's glob of
    ``*_model_states.pt`` would open (and wait on for ever)."""
    if path.is_symlink():
        raise UntrustedCheckpointError(path, f"a symbolic link (to {os.readlink(path)!r})")
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            entry = Path(root) / name
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                raise UntrustedCheckpointError(entry, f"a symbolic link (to {os.readlink(entry)!r})")
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise UntrustedCheckpointError(entry, "a special file (a FIFO, socket or device) where files belong")


def _inside(folder: Path, relative: str, what: str, owner: Path) -> Path:
    """``folder / relative`` where ``relative`` is a plain relative path to a regular file under
    ``folder`` (no ``..``, not absolute, no link on the way), else UntrustedCheckpointError."""
    if "\0" in relative:
        raise UntrustedCheckpointError(owner, f"{what} {relative!r}, which is not a plain path")
    parts = Path(relative).parts
    if not relative or Path(relative).is_absolute() or any(p in ("..", ".") for p in parts):
        raise UntrustedCheckpointError(owner, f"{what} {relative!r} outside the checkpoint folder")
    target = folder.joinpath(*parts)
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        raise UntrustedCheckpointError(owner, f"{what} {relative!r}, which does not exist") from None
    if not stat.S_ISREG(mode):
        raise UntrustedCheckpointError(owner, f"{what} {relative!r}, which is not a regular file")
    return target


def _require_dcp_metadata(metadata: Any, meta_file: Path) -> None:
    """``metadata`` is torch distributed checkpoint's ``Metadata`` (torch's reader, given anything
    else, fails and then unpickles a rank-local ``__N.metadata`` instead)."""
    from torch.distributed.checkpoint.metadata import Metadata  # noqa: PLC0415

    if not isinstance(metadata, Metadata):
        raise StateLoadError(
            f"{meta_file}: not a distributed checkpoint's metadata (expected torch.distributed.checkpoint's "
            f"Metadata, found a {type(metadata).__name__}); the checkpoint is damaged or not a DCP one"
        )


def _storage_files(folder: Path, metadata: Any, meta_file: Path) -> list[tuple[Any, Any, Path]]:
    """``(index, storage info, file)`` of every item ``metadata`` stores, each file a regular file
    inside ``folder`` (no ``..``, not absolute, no link) read with no stream transform."""
    _require_dcp_metadata(metadata, meta_file)
    storage = metadata.storage_data or {}
    if not isinstance(storage, dict):
        raise UntrustedCheckpointError(meta_file, f"storage data of type {type(storage).__name__}")
    found = []
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str):
            raise UntrustedCheckpointError(meta_file, f"a storage path of type {type(relative).__name__}")
        file = _inside(folder, relative, "a storage path", meta_file)
        if getattr(info, "transform_descriptors", None):
            raise UntrustedCheckpointError(meta_file, f"storage transforms {list(info.transform_descriptors)}")
        found.append((index, info, file))
    return found


def _check_dcp_items(folder: Path, metadata: Any, meta_file: Path) -> None:
    """Every storage path of a DCP checkpoint inside ``folder``, and every bytes item readable
    with ``weights_only=True`` (DCP's default planner unpickles them with no restriction)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata  # noqa: PLC0415

    items = metadata.state_dict_metadata if isinstance(getattr(metadata, "state_dict_metadata", None), dict) else {}
    for index, info, file in _storage_files(folder, metadata, meta_file):
        if not isinstance(items.get(getattr(index, "fqn", None)), BytesStorageMetadata):
            continue  # a tensor: DCP's reader loads those with weights_only=True
        with open(file, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        _load_bytes_item(blob, file)


def _load_bytes_item(blob: bytes, file: Path) -> Any:
    """One DCP bytes item, read with ``weights_only=True``: UntrustedCheckpointError names ``file``
    and the type for anything that could run code."""
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_type(exc) or _pickled_callable(blob)
        if refused is not None:
            raise UntrustedCheckpointError(file, refused) from None
        raise pickle.UnpicklingError(f"{file}: not a readable checkpoint item ({_inner_reason(exc)})") from None


def _check_deepspeed_latest(path: Path, name: str = DEEPSPEED_LATEST) -> None:
    """DeepSpeed's ``latest`` (or ``latest_universal``, read instead with ``load_universal`` on)
    names one folder inside the checkpoint (its engine opens ``path / tag``; a tag of ``../../x``
    pointed it at shards these checks never read)."""
    latest = path / name
    if not os.path.lexists(latest):
        return
    if not stat.S_ISREG(os.lstat(latest).st_mode) or latest.stat().st_size > _LATEST_MAX_BYTES:
        raise UntrustedCheckpointError(latest, f"a '{name}' that is not a small regular file")
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise UntrustedCheckpointError(latest, "a tag that is not UTF-8 text") from None
    if not tag or tag in (".", "..") or any(c in tag for c in "/\\\0") or len(Path(tag).parts) != 1:
        raise UntrustedCheckpointError(latest, f"the tag {tag!r}, which is not one folder name inside the checkpoint")
    folder = path / tag
    if not folder.is_dir() or folder.is_symlink():
        raise UntrustedCheckpointError(latest, f"the tag {tag!r}, which is not a folder inside the checkpoint")


def zero_world_size(path: str | Path) -> int | None:
    """How many data-parallel ranks wrote a DeepSpeed checkpoint directory: its ZeRO optimizer
    partition files (``*zero_pp_rank_R_mp_rank_00_optim_states.pt``) in the folder its ``latest``
    names (checked by :func:`check_checkpoint` first), or in the directory itself; None when it
    holds none. Nothing is unpickled."""
    path = Path(path)
    latest = path / DEEPSPEED_LATEST
    folder = path / latest.read_text(encoding="utf-8").strip() if latest.is_file() else path
    ranks = {
        p.name.split("zero_pp_rank_")[1].split("_")[0]
        for p in folder.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt")
    }
    return len(ranks) or None


def check_checkpoint(path: str | Path, *, deepspeed: bool | None = None) -> None:
    """Read every file of the checkpoint at ``path`` the safe way (memory-mapped: tensor data is
    not read), so that a loader that unpickles it afterwards (DeepSpeed's engine, DCP) sees only
    files that hold nothing but data, and only files inside ``path``.

    A directory's ``latest``/``latest_universal`` is checked whatever kind the directory looks
    like (a ``.metadata`` planted in a DeepSpeed checkpoint made it pass for a DCP one), and every
    file is read for foreign types before any is checked for its structure (a damaged file found
    first would otherwise hide a planted one behind it from the resume, which falls back past a
    damaged checkpoint).

    Args:
        path: a checkpoint file, or a checkpoint directory (DeepSpeed's, or FSDP2's DCP one).
        deepspeed: allow DeepSpeed's types; default: when ``path`` is a directory without a DCP
            ``.metadata`` (a DeepSpeed checkpoint). ``False`` for a directory: a DCP checkpoint,
            whose ``.metadata`` must be there.

    Raises:
        UntrustedCheckpointError: a file names a type outside the allowlist, a symbolic link, a
            DCP storage path outside the folder, or a DeepSpeed ``latest`` that leads outside.
        StateLoadError: a DCP metadata file that holds no DCP metadata, or a DCP checkpoint
            without its ``.metadata``.
    """
    path = Path(path)
    _refuse_links(path)
    if path.is_dir():
        for name in DEEPSPEED_LATEST_FILES:
            _check_deepspeed_latest(path, name)
    files = checkpoint_files(path)
    if deepspeed is None:
        deepspeed = path.is_dir() and not (path / DCP_METADATA_FILE).is_file()
    allowed = deepspeed_safe_globals() if deepspeed else []
    metadata = []
    for f in files:
        if f.name.endswith(DCP_METADATA_FILE):
            metadata.append((f, load_dcp_metadata(f)))
        else:
            load_checkpoint_file(f, mmap=True, safe_globals=allowed)
    for f, meta in metadata:
        _check_dcp_items(f.parent, meta, f)
    if deepspeed is False and path.is_dir() and not (path / DCP_METADATA_FILE).is_file():
        raise StateLoadError(
            f"{path}: not a distributed checkpoint (no {DCP_METADATA_FILE}, which torch distributed checkpoint "
            "writes beside the shards); the checkpoint is damaged or not one of fp8state_fsdp's"
        )


@functools.cache
def _safe_dcp_classes() -> dict[str, type]:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint import metadata as dcp_metadata  # noqa: PLC0415
    from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: PLC0415

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, but a bytes item is read with ``weights_only=True`` (the
        default one unpickles it with no restriction: a planted item runs)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            where = Path(f"<distributed checkpoint item {read_item.dest_index.fqn}>")
            obj = _load_bytes_item(value.getvalue(), where)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    class SafeFileSystemReader(dcp.FileSystemReader):
        """DCP's local file-system reader, but the metadata is the one global ``.metadata``, read by
        our restricted unpickler (torch's reader unpickles it with plain pickle and, when that
        fails, falls back to a rank-local ``__N.metadata``, unpickled so too), and every storage
        path leads to a regular file inside the checkpoint, read with no stream transform."""

        def read_metadata(self) -> Any:  # no **kwargs: DCP then never asks for a rank's own file
            meta_file = Path(self.path) / DCP_METADATA_FILE
            metadata = load_dcp_metadata(meta_file)
            _require_dcp_metadata(metadata, meta_file)
            storage_meta = getattr(dcp_metadata, "StorageMeta", None)  # as torch's reader does (torch >= 2.5)
            if storage_meta is not None and hasattr(self, "load_id"):
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = storage_meta()
                metadata.storage_meta.load_id = self.load_id
            return metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            _storage_files(Path(self.path), metadata, Path(self.path) / DCP_METADATA_FILE)
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    classes = {"SafeLoadPlanner": SafeLoadPlanner, "SafeFileSystemReader": SafeFileSystemReader}
    for cls in classes.values():
        cls.__module__ = __name__
    return classes


def __getattr__(name: str) -> Any:
    # the classes subclass DCP's: DCP (most of a second to import) loads on first use
    if name in ("SafeLoadPlanner", "SafeFileSystemReader"):
        return _safe_dcp_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def safe_dcp_load(state: dict[str, Any], path: str | Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` after
    :func:`check_checkpoint`, with :class:`SafeLoadPlanner` and :class:`SafeFileSystemReader`
    (never a reader chosen from the path)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    check_checkpoint(path, deepspeed=False)
    classes = _safe_dcp_classes()
    dcp.load(state, storage_reader=classes["SafeFileSystemReader"](str(path)), planner=classes["SafeLoadPlanner"]())
