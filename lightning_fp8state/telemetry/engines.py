"""Reading an engine's own skipped steps (DeepSpeed fp16 loss scaling), defensively.

DeepSpeed's fp16 loss scaler skips a step itself when it finds an overflow and counts it
in ``DeepSpeedEngine.skipped_steps``; its optimizer exposes the overflow flag and the
current loss scale. Nothing here imports DeepSpeed: the engine is read by duck typing, so
any object with a ``skipped_steps`` attribute works (and tests use a small fake).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FOUND_INF_ATTR", "EngineStepInfo", "read_engine_step"]

# On an engine whose non-finite check runs on the device (lightning.deepspeed_guard): the last
# optimizer step's flag, a float32 0-d device tensor (1: the step was skipped), or None.
FOUND_INF_ATTR = "fp8state_found_inf"


@dataclass(frozen=True)
class EngineStepInfo:
    """What an engine reports after its optimizer step."""

    skipped_steps: int  # cumulative, as the engine counts them
    loss_scale: float | None = None  # the fp16 dynamic loss scale, if any
    overflow: bool | None = None  # the last step's overflow flag, if exposed
    grad_norm: torch.Tensor | float | None = None  # the engine's global grad norm, if exposed
    found_inf: torch.Tensor | None = None  # the device guard's flag of the last step (FOUND_INF_ATTR)


def _number(value):
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()) if value.numel() == 1 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def read_engine_step(engine) -> EngineStepInfo | None:
    """Read a DeepSpeed-like engine's skip counter, loss scale, overflow flag and grad norm.

    Returns ``None`` when ``engine`` is not such an engine. Every field but
    ``skipped_steps`` is optional and read only where it exists: the attribute names have
    moved between DeepSpeed versions (``optimizer.cur_scale`` / ``optimizer.loss_scale``,
    ``engine.get_global_grad_norm()`` / ``optimizer._global_grad_norm``). A tensor grad
    norm is returned as a device tensor (no sync here).
    """
    skipped = getattr(engine, "skipped_steps", None)
    if engine is None or isinstance(skipped, bool) or not isinstance(skipped, int):
        return None
    optimizer = getattr(engine, "optimizer", None)
    scale = None
    for name in ("cur_scale", "loss_scale"):
        scale = _number(getattr(optimizer, name, None))
        if scale is not None:
            break
    if isinstance(scale, torch.Tensor):
        scale = None  # DeepSpeed keeps it as a Python float; a tensor would need a sync
    overflow = getattr(optimizer, "overflow", None)
    overflow = bool(overflow) if isinstance(overflow, bool) else None
    norm = None
    getter = getattr(engine, "get_global_grad_norm", None)
    if callable(getter):
        try:
            norm = _number(getter())
        except Exception:  # an engine without a norm yet (e.g. before its first step)
            norm = None
    if norm is None:
        norm = _number(getattr(optimizer, "_global_grad_norm", None))
    found_inf = getattr(engine, FOUND_INF_ATTR, None)
    found_inf = found_inf if isinstance(found_inf, torch.Tensor) else None
    return EngineStepInfo(int(skipped), scale, overflow, norm, found_inf)
