"""Lazy build and load of the CUDA kernels in ``csrc/`` (see :mod:`lightning_fp8state.shipped`).

The first op called on a CUDA tensor builds the extension with
``torch.utils.cpp_extension`` (cached on disk: later processes load it in well under a
second) and registers its kernels under ``TORCH_LIBRARY_IMPL(fp8state, CUDA, m)``, which
then take precedence over the reference for CUDA tensors. If the build or the load fails,
a warning is issued once and the reference ops keep serving CUDA tensors.

A registration that torch rejects (a kernel whose C++ signature disagrees with the op's
schema in ``ops/library*.py``) aborts the loading process from a static initializer, where
no Python ``except`` can catch it. So the first load of each build, with each version of
the schemas, happens in a child process (``load_check()``); only when the child loaded the
library cleanly does this process load it, and a marker file in the build directory spares
the check afterwards. A child that fails or dies makes the warning above, with its output.

Each build lives in its own directory of the cache, named by ``build_tag()``: the torch and
CUDA versions, the architectures and ``source_hash()``, a hash of every source and header
in ``csrc/``. torch's JIT only tracks the ``sources`` it compiles, so without the hash an
edited header would reuse a stale library; with it, any change to ``csrc/`` builds afresh.

What is trusted: the cache folder is where a library is loaded from, so it must belong to this
user and be writable by nobody else (``_private_dir``: created 0700; a folder of another owner,
or one that group or others may write, is refused and the reference ops serve); each build
records the SHA-256 of its library beside it (``fp8state_cuda.so.sha256``) and a library is
loaded only when it matches (``_check_library``: a mismatch is refused; a build without a record,
from an earlier version, is built afresh). The child that checks a first load runs isolated
(``python -I``, the parent's own ``sys.path`` and nothing else): a ``torch.py`` in the working
directory is not imported.

Environment:
    FP8STATE_CUDA_ARCHS: ``TORCH_CUDA_ARCH_LIST`` syntax for the build (default ``9.0+PTX``).
    FP8STATE_CACHE_DIR: where builds are cached (default ``~/.cache/lightning_fp8state``),
        one subdirectory per ``build_tag()``.
    FP8STATE_DISABLE_CUDA: set to 1 to never build or load the kernels (reference only).

Ahead of time: ``python -m lightning_fp8state.ops.cuda`` builds into the cache and prints
the library's path and SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import torch

from ..shipped import shipped_dir

__all__ = [
    "HEADERS",
    "SOURCES",
    "build",
    "build_tag",
    "ensure_loaded",
    "extension_info",
    "is_loaded",
    "load_check",
    "load_for",
    "source_dir",
    "source_hash",
]

_NAME = "fp8state_cuda"
# compiled: FP8, fused prologues (LayerNorm, GELU, RMSNorm), FP4, the LayerNorm and RMSNorm backward,
# the stateless scalings, the SwiGLU prologue and its backward, the block scalings (as ops/ splits them)
SOURCES = (
    "fp8_ops.cu",
    "fused_ops.cu",
    "fp4_ops.cu",
    "ln_ops.cu",
    "dynamic_ops.cu",
    "swiglu_ops.cu",
    "blockwise_ops.cu",
)
# included by the sources; not compiled on their own
HEADERS = ("fp8state_common.cuh", "fp8_encode.cuh", "swiglu_math.cuh")
_HASHED_SUFFIXES = (".cu", ".cuh", ".h")
_lock = threading.Lock()
_state: dict = {"tried": False, "loaded": False, "error": None, "library": None}


def source_dir() -> Path:
    """The ``csrc/`` folder: inside the installed package, or at the root of a source checkout."""
    return shipped_dir("csrc")


def _archs() -> str:
    return os.environ.get("FP8STATE_CUDA_ARCHS", "9.0+PTX")


def source_hash() -> str:
    """The first 16 hex digits of a SHA-256 over the CUDA sources and headers in ``csrc/``.

    Every ``.cu``, ``.cuh`` and ``.h`` file, sorted by name, contributes its name and its
    content, so editing, adding, removing or renaming any of them changes the hash.
    """
    digest = hashlib.sha256()
    files = sorted(
        (p for p in source_dir().iterdir() if p.is_file() and p.suffix in _HASHED_SUFFIXES), key=lambda p: p.name
    )
    for path in files:
        data = path.read_bytes()
        for part in (path.name.encode(), len(data).to_bytes(8, "little"), data):
            digest.update(part)
    return digest.hexdigest()[:16]


def build_tag() -> str:
    """The name of this configuration's build directory in the cache.

    Returns:
        ``torch<version>-cuda<version>-sm<archs>-src<source_hash()>``, with ``+`` replaced by
        ``_`` and spaces removed.
    """
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{_archs()}-src{source_hash()}"
    return tag.replace("+", "_").replace(" ", "")


def _private_dir(path: Path) -> Path:
    """``path``, created (0700) if missing; RuntimeError unless it is a folder of this user that
    neither group nor others may write (a library is loaded from it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder (a link?)"
    elif st.st_uid != uid:
        problem = f"belongs to user id {st.st_uid}, not to this user ({uid})"
    elif st.st_mode & 0o022:
        problem = f"may be written by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    else:
        return path
    raise RuntimeError(
        f"the extension cache {path} {problem}: a library there is not loaded; set FP8STATE_CACHE_DIR to a "
        "folder of yours that only you may write (chmod 700)"
    )


def _build_dir() -> Path:
    root = Path(os.environ.get("FP8STATE_CACHE_DIR", Path.home() / ".cache" / "lightning_fp8state"))
    _private_dir(root)
    return _private_dir(root / build_tag())


def _library_digest(library: Path) -> str:
    return hashlib.sha256(library.read_bytes()).hexdigest()


def _check_library(build_dir: Path) -> None:
    """Before loading: the library in ``build_dir`` is the one built there (its SHA-256 equals the
    record). A library without a record (an earlier version's build) is removed, so the build
    that follows makes it afresh; one that does not match its record is refused (RuntimeError)."""
    library, record = build_dir / f"{_NAME}.so", build_dir / f"{_NAME}.so.sha256"
    if not library.exists():
        return
    if not record.is_file():
        library.unlink()
        return
    expected = record.read_text(encoding="utf-8").strip()
    found = _library_digest(library)
    if found != expected:
        raise RuntimeError(
            f"{library} does not match the SHA-256 recorded at its build ({found[:16]}... against {expected[:16]}...): "
            f"it was changed after the build and is not loaded; remove {build_dir} to build it afresh"
        )


def _record_library(build_dir: Path) -> None:
    library = build_dir / f"{_NAME}.so"
    (build_dir / f"{_NAME}.so.sha256").write_text(_library_digest(library) + "\n", encoding="utf-8")


def build(verbose: bool = False) -> Path:
    """Build (or reuse the cached build of) the extension, load it, return the library path."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (heavy; only on first CUDA use)

    sources = [str(source_dir() / s) for s in SOURCES]
    for s in (*sources, *(str(source_dir() / h) for h in HEADERS)):
        if not Path(s).is_file():
            raise FileNotFoundError(f"CUDA source {s} is missing from the installed package")
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = _archs()
    try:
        build_dir = _build_dir()
        _check_library(build_dir)
        checked = _stamp(build_dir / f"{_NAME}.so")
        cpp_extension.load(
            name=_NAME,
            sources=sources,
            extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous
    library = build_dir / f"{_NAME}.so"
    # built just now: the first build, or a rebuild over the checked library (the compiler's build
    # tool relinks when a source's time is newer than its object, e.g. the package copied afresh to
    # the same place with the same content, so the same build folder): record what was loaded
    if library.is_file() and (not (build_dir / f"{_NAME}.so.sha256").is_file() or _stamp(library) != checked):
        _record_library(build_dir)
    return library


def _stamp(library: Path) -> tuple[int, int, int] | None:
    """The file's identity and modification time (None where it does not exist): a rebuild
    changes it."""
    try:
        st = library.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _schema_hash() -> str:
    """Hash of the Python files defining the ops' schemas (the other side of registration)."""
    h = hashlib.sha256()
    for name in (
        "library.py",
        "library_dynamic.py",
        "library_fp4.py",
        "library_fused.py",
        "library_rms.py",
        "library_swiglu.py",
        "library_blockwise.py",
    ):
        h.update((Path(__file__).resolve().parent / name).read_bytes())
    return h.hexdigest()[:16]


def _load_marker() -> Path:
    return _build_dir() / f"load-ok-{_schema_hash()}"


def _write_load_marker() -> Path:
    """Record that this build, with these op schemas, loaded cleanly once."""
    marker = _load_marker()
    marker.write_text(f"{build_tag()} {_schema_hash()}\n")
    return marker


def _load_check_command() -> list[str]:
    """``python -I`` (no environment variables, no user site, no working directory on the path)
    with this process's own ``sys.path`` (the working directory, where it is on it, spelled out):
    the child imports exactly what this process imports."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    code = f"import sys; sys.path[:] = {paths!r}; from lightning_fp8state.ops import cuda; cuda.build()"
    return [sys.executable, "-I", "-c", code]


def load_check(timeout_s: float = 3600.0) -> Path:
    """Build and load the extension in a child process unless this build, with these op
    schemas, already loaded cleanly once; returns the marker file. Raises RuntimeError with
    the child's exit status and the tail of its output if it failed or died."""
    marker = _load_marker()
    if marker.is_file():
        return marker
    # the child imports the package from where this process does: its sys.path, passed in the
    # command (python -I ignores PYTHONPATH), not only the environment's
    try:
        child = subprocess.run(_load_check_command(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"building and loading the extension in a child process took over {timeout_s:.0f} s"
        ) from exc
    if child.returncode != 0:
        tail = (child.stdout + child.stderr).strip()[-2000:]
        raise RuntimeError(
            f"building and loading the extension in a child process failed (exit status {child.returncode}); "
            f"its output ends with:\n{tail}"
        )
    return _write_load_marker()


def ensure_loaded() -> bool:
    """Load the kernels once per process; False (after one warning) if they cannot be."""
    if _state["tried"]:
        return _state["loaded"]
    with _lock:
        if _state["tried"]:
            return _state["loaded"]
        try:
            if os.environ.get("FP8STATE_DISABLE_CUDA", "0") not in ("", "0"):
                raise RuntimeError("disabled by FP8STATE_DISABLE_CUDA")
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            load_check()
            _state["library"] = build()
            _state["loaded"] = True
        except Exception as exc:  # noqa: BLE001  (any build failure falls back to the reference)
            _state["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"lightning_fp8state: CUDA kernels unavailable ({_state['error']}); "
                "the pure-torch reference ops serve CUDA tensors instead (correct, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
        finally:
            _state["tried"] = True
    return _state["loaded"]


def load_for(t: torch.Tensor) -> None:
    """Load the kernels before ``t``'s first CUDA op (one dict lookup after the first call).

    Every public op wrapper calls this: an op reached on a CUDA tensor before the extension is
    loaded dispatches to the reference (``CompositeExplicitAutograd``), correct but several
    times slower (fp8_rowwise ran its whole training on the reference so, 2026-12-02)."""
    if t.is_cuda and not _state["tried"]:
        ensure_loaded()


def is_loaded() -> bool:
    return bool(_state["loaded"])


def extension_info() -> dict:
    """What serves CUDA tensors: loaded or not, the library path and its SHA-256, the error.

    ``source_hash`` is that of the ``csrc/`` this process would build (and, once loaded, did).
    """
    info = {"loaded": is_loaded(), "library": None, "sha256": None, "error": _state["error"], "archs": _archs()}
    try:
        info["source_hash"] = source_hash()
    except OSError as exc:  # a broken install must not break provenance
        info["source_hash"] = f"unavailable ({type(exc).__name__})"
    lib = _state["library"]
    if lib is not None and Path(lib).is_file():
        info["library"] = str(lib)
        info["sha256"] = hashlib.sha256(Path(lib).read_bytes()).hexdigest()
    return info


if __name__ == "__main__":
    path = build(verbose=True)  # loads it here: a rejected registration aborts this command
    _write_load_marker()
    _state.update(tried=True, loaded=True, library=path)
    info = extension_info()
    print(f"built {info['library']}\nsha256 {info['sha256']}\nsources {info['source_hash']}")
