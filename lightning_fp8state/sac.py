"""Torch's selective activation checkpointing (SAC) with stateful quantizers: what keeps it
bitwise, and a policy helper that can save our quantized codes.

SAC (``checkpoint(fn, x, use_reentrant=False, context_fn=create_selective_checkpoint_contexts(policy))``)
runs the region's true forward under a dispatch mode that numbers every op per overload and
stores either its output (policy: save) or a "recompute" mark; the recompute runs under a
second mode that pops those entries in the same order and raises "... encountered during
backward but not found in storage" at the first op the true forward did not issue. So the
ops SAC sees must form the same sequence in both runs. Two rules keep it so:

1. The protocol's bookkeeping (owner registration, the event's freeze, the first event's
   calibration, the naive modes' copies and commits, the auditors' copies, the recompute's
   scratch slot) runs through :func:`outside_selective_checkpoint`: unseen by SAC.
2. The quantize itself stays visible (a policy may save its codes) and is the same op in both
   runs: the recompute calls the true forward's ``*_record_amax`` op with the same snapshot,
   its statistics going to a discarded scratch slot (``Quantizer.encode_discard``, protocol/encode.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import ops as _ops  # noqa: F401  (defines torch.ops.fp8state.*)
from .config import require_that
from .errors import ConfigError

__all__ = [
    "MATMUL_OPS",
    "QUANTIZE_OPS",
    "in_selective_checkpoint",
    "outside_selective_checkpoint",
    "selective_checkpoint_context",
    "selective_checkpoint_policy",
    "storage_mismatch",
]

try:  # private torch names (torch >= 2.4); without them there is no SAC to hide from
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    _SAC_MODES: tuple[type, ...] = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
except ImportError:  # pragma: no cover - older torch
    _SAC_MODES = ()

_aten = torch.ops.aten
_f8 = torch.ops.fp8state

#: The matmuls a typical SAC policy saves: the emulated FP8 GEMM (CPU, or shapes _scaled_mm
#: refuses) issues ``aten.mm``; the GPU path ``aten._scaled_mm``.
MATMUL_OPS: tuple = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default)

#: Every quantize op our true forward issues (and, since rule 2, our recompute too). Saving
#: their outputs keeps the FP8 codes (1 byte an element; packed FP4 codes and block scales;
#: the fused LayerNorm's codes with its mean and rstd) instead of recomputing them. That
#: includes the weights' codes: one byte per parameter of each checkpointed layer.
QUANTIZE_OPS: tuple = (
    _f8.quantize_fp8_record_amax.default,
    _f8.quantize_fp8_t_record_amax.default,  # a weight's codes with their transpose (fp8_delayed)
    _f8.gelu_quantize_fp8_record_amax.default,
    _f8.layer_norm_quantize_fp8_record_amax.default,
    _f8.quantize_fp4_record_amax.default,
    _f8.quantize_fp4_centered_record.default,
)


def in_selective_checkpoint() -> bool:
    """Whether torch's SAC modes are on the dispatch mode stack (a selective checkpoint's true
    forward or recompute is running): the ops issued now are numbered by SAC, so a recompute
    must issue every op its true forward issued (no reuse of the forward's results)."""
    if not torch._C._len_torch_dispatch_stack() or not _SAC_MODES:
        return False
    return any(isinstance(m, _SAC_MODES) for m in _get_current_dispatch_mode_stack())


def outside_selective_checkpoint(fn: Callable, *args: Any, **kwargs: Any):
    """``fn(*args, **kwargs)`` with torch's SAC dispatch modes taken off the mode stack, so
    the tensor ops inside are neither numbered nor cached by SAC; every other dispatch mode
    stays in place, in its order. Without any dispatch mode (the common case) this costs one
    C call besides ``fn``."""
    if not torch._C._len_torch_dispatch_stack() or not _SAC_MODES:
        return fn(*args, **kwargs)
    stack = _get_current_dispatch_mode_stack()
    lowest = next((i for i, m in enumerate(stack) if isinstance(m, _SAC_MODES)), None)
    if lowest is None:
        return fn(*args, **kwargs)
    popped = [_pop_mode() for _ in range(len(stack) - lowest)][::-1]  # bottom first
    kept = [m for m in popped if not isinstance(m, _SAC_MODES)]
    for mode in kept:
        _push_mode(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        for _ in kept:
            _pop_mode()
        for mode in popped:
            _push_mode(mode)


def _check_ops(save: Iterable) -> tuple:
    out = []
    for op in save:
        if isinstance(op, torch._ops.OpOverloadPacket):
            raise ConfigError(
                f"selective checkpoint: {op} is an op packet, not an overload: name one, e.g. "
                f"torch.ops.{op._qualified_op_name.replace('::', '.')}.default"
            )
        require_that(
            isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)),
            "selective checkpoint: an op to save",
            f"{op!r} ({type(op).__name__})",
            "torch op overloads to save (e.g. torch.ops.aten.mm.default)",
        )
        out.append(op)
    return tuple(out)


def selective_checkpoint_policy(save: Iterable = MATMUL_OPS, *, save_quantized: bool = False) -> Callable:
    """A SAC policy function: ``MUST_SAVE`` the ops in ``save`` (and with
    ``save_quantized``, our quantize ops: :data:`QUANTIZE_OPS`), ``PREFER_RECOMPUTE`` the rest.

    Args:
        save: op overloads whose outputs are kept (default :data:`MATMUL_OPS`); ``()`` saves
            nothing, which is full checkpointing.
        save_quantized: also keep the quantized codes of every input and weight, so the
            recompute does not quantize again (the codes are the true forward's, so the result
            is bitwise the same either way; this trades memory for the quantize passes).

    Raises:
        ConfigError: ``save`` holds something that is not an op overload.
    """
    saved = frozenset(_check_ops(save) + (QUANTIZE_OPS if save_quantized else ()))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_checkpoint_context(save: Iterable = MATMUL_OPS, *, save_quantized: bool = False) -> Callable:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` or
    :func:`lightning_fp8state.checkpoint`, from :func:`selective_checkpoint_policy`.

    Example::

        ctx = f8s.selective_checkpoint_context(save_quantized=True)
        y = f8s.checkpoint(block, x, context_fn=ctx)
    """
    return functools.partial(
        create_selective_checkpoint_contexts, selective_checkpoint_policy(save, save_quantized=save_quantized)
    )


def storage_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is SAC's "op sequence differs between forward and recompute" error."""
    return isinstance(exc, RuntimeError) and "encountered during backward but not found in storage" in str(exc)
