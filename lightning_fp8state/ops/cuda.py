"""Lazy build and load of the CUDA kernels in ``lightning_fp8state/csrc/``.

The first op called on a CUDA tensor builds the extension with
``torch.utils.cpp_extension`` (cached on disk: later processes load it in well under a
second) and registers its kernels under ``TORCH_LIBRARY_IMPL(fp8state, CUDA, m)``, which
then take precedence over the reference for CUDA tensors. If the build or the load fails,
a warning is issued once and the reference ops keep serving CUDA tensors.

Environment:
    FP8STATE_CUDA_ARCHS: ``TORCH_CUDA_ARCH_LIST`` syntax for the build (default ``9.0+PTX``).
    FP8STATE_CACHE_DIR: where builds are cached (default ``~/.cache/lightning_fp8state``).
    FP8STATE_DISABLE_CUDA: set to 1 to never build or load the kernels (reference only).

Ahead of time: ``python -m lightning_fp8state.ops.cuda`` builds into the cache and prints
the library's path and SHA-256.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["SOURCES", "build", "ensure_loaded", "extension_info", "is_loaded", "source_dir"]

_NAME = "fp8state_cuda"
SOURCES = ("fp8state_ops.cu", "fp4_ops.cu")
_lock = threading.Lock()
_state: dict = {"tried": False, "loaded": False, "error": None, "library": None}


def source_dir() -> Path:
    """The csrc/ folder shipped inside the installed package."""
    return Path(__file__).resolve().parent.parent / "csrc"


def _archs() -> str:
    return os.environ.get("FP8STATE_CUDA_ARCHS", "9.0+PTX")


def _build_dir() -> Path:
    root = Path(os.environ.get("FP8STATE_CACHE_DIR", Path.home() / ".cache" / "lightning_fp8state"))
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{_archs()}".replace("+", "_").replace(" ", "")
    path = root / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(verbose: bool = False) -> Path:
    """Build (or reuse the cached build of) the extension, load it, return the library path."""
    from torch.utils import cpp_extension  # noqa: PLC0415  (heavy; only on first CUDA use)

    sources = [str(source_dir() / s) for s in SOURCES]
    for s in sources:
        if not Path(s).is_file():
            raise FileNotFoundError(f"CUDA source {s} is missing from the installed package")
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = _archs()
    try:
        build_dir = _build_dir()
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
    return build_dir / f"{_NAME}.so"


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


def is_loaded() -> bool:
    return bool(_state["loaded"])


def extension_info() -> dict:
    """What serves CUDA tensors: loaded or not, the library path and its SHA-256, the error."""
    info = {"loaded": is_loaded(), "library": None, "sha256": None, "error": _state["error"], "archs": _archs()}
    lib = _state["library"]
    if lib is not None and Path(lib).is_file():
        info["library"] = str(lib)
        info["sha256"] = hashlib.sha256(Path(lib).read_bytes()).hexdigest()
    return info


if __name__ == "__main__":
    path = build(verbose=True)
    _state.update(tried=True, loaded=True, library=path)
    info = extension_info()
    print(f"built {info['library']}\nsha256 {info['sha256']}")
