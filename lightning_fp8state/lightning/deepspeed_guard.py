"""The non-finite step guard and gradient clipping of DeepSpeed ZeRO-1/2 under bf16, on the device.

DeepSpeed's ZeRO optimizer decides on the host. Under bf16 its ``step()`` checks every gradient
partition for inf/NaN (``bf16.check_grad_overflow``, one ``.item()``), and its clipping tests
the global norm with ``bool(...)`` before it scales. Each is a host-device sync per optimizer
step, so the host waits for the whole backward before it issues the next step, and the step
becomes host-bound (docs/PERFORMANCE.md, the DeepSpeed profile of 2026-12-02).

:func:`install` moves both decisions onto the device, with the same arithmetic:
- DeepSpeed still computes the global gradient norm (``_global_grad_norm``, a device tensor,
  ``inf`` when any gradient is not finite) and reduces it across ranks;
- the engine's own overflow check and clipping are turned off (``check_grad_overflow=False``,
  ``clip_grad=0``);
- a step pre-hook on the basic optimizer (a fused ``torch.optim`` Adam/AdamW) clips the
  partition's gradients by DeepSpeed's formula, ``g * 1 / clamp((norm + 1e-6) / clip, min=1)``,
  and hands the fused kernel ``found_inf = not isfinite(norm)``: the kernel skips the update
  on the device, parameters, moments and step count untouched, as torch's GradScaler does;
- the flag stays on the engine (``engine.fp8state_found_inf``) for the telemetry, which counts
  the step as skipped when its flag is set, read on log steps only;
- DeepSpeed's norm masks a non-finite norm to -1 with a fill value it first copies to the device
  (``torch.tensor(-1.0, device=...)``, a synchronous copy): its ZeRO-1/2 module gets an
  equivalent that fills with the Python scalar (the same values, bit for bit, no copy).

Only where every piece is known to be there: a ``DeepSpeedZeroOptimizer`` (ZeRO-1/2, no
offload) with a norm, under bf16, around a fused torch Adam/AdamW. Otherwise nothing changes,
DeepSpeed's own check stays on, and :func:`install` says why.
"""

from __future__ import annotations

import torch

from ..telemetry.engines import FOUND_INF_ATTR

__all__ = ["install", "unsupported_reason"]


def unsupported_reason(engine) -> str | None:
    """Why the device guard cannot run on ``engine`` (``None``: it can)."""
    zero = getattr(engine, "optimizer", None)
    basic = getattr(engine, "basic_optimizer", None)
    if type(zero).__name__ != "DeepSpeedZeroOptimizer":
        return f"the engine's optimizer is {type(zero).__name__}, not DeepSpeed's ZeRO-1/2 optimizer"
    for attr in ("check_grad_overflow", "clip_grad", "_global_grad_norm", "compute_grad_norm", "loss_scale"):
        if not hasattr(zero, attr):
            return f"this DeepSpeed's ZeRO optimizer has no {attr!r}"
    if getattr(zero, "dtype", None) != torch.bfloat16:
        return "the engine does not train in bf16 (fp16 keeps DeepSpeed's loss scaler)"
    if getattr(zero, "cpu_offload", False):
        return "optimizer offload (its step runs on the CPU)"
    if not zero.compute_grad_norm:
        return "zero_optimization.compute_grad_norm=false (the guard reads DeepSpeed's norm)"
    if getattr(zero, "torch_autocast_gradscaler", None) is not None:
        return "DeepSpeed's torch-autocast grad scaler steps the optimizer itself"
    if not isinstance(basic, (torch.optim.Adam, torch.optim.AdamW)) or not all(
        g.get("fused") for g in basic.param_groups
    ):
        return (
            f"the basic optimizer is {type(basic).__name__} without fused=True (only the fused torch "
            "Adam/AdamW kernels skip a step on the device)"
        )
    return None


def install(engine) -> str | None:
    """Move ``engine``'s non-finite check and clipping onto the device (see the module doc).
    Returns ``None`` when installed, else why not (and then leaves DeepSpeed's check on)."""
    reason = unsupported_reason(engine)
    zero = getattr(engine, "optimizer", None)
    if reason is not None:
        if hasattr(zero, "check_grad_overflow"):
            zero.check_grad_overflow = True  # the engine's own (host) check, as DeepSpeed defaults
        return reason
    basic = engine.basic_optimizer
    clip = float(zero.clip_grad)
    zero.clip_grad = 0.0  # clipped in the hook instead: DeepSpeed's clip tests the norm on the host
    zero.check_grad_overflow = False
    setattr(engine, FOUND_INF_ATTR, None)

    def before_step(optimizer, args, kwargs):
        norm = zero._global_grad_norm
        if not isinstance(norm, torch.Tensor):  # no norm this step (DeepSpeed computed none)
            norm = torch.tensor(float(norm), dtype=torch.float32, device=_device(optimizer))
        norm = norm.reshape(()).to(torch.float32)
        if clip > 0.0:  # DeepSpeed's unscale_and_clip_grads, with its loss scale of 1 under bf16
            scale = zero.loss_scale
            combined = torch.clamp(((norm / scale) + 1e-6) / clip, min=1.0) * scale
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / combined)
        found_inf = (~torch.isfinite(norm)).to(torch.float32)
        optimizer.found_inf = found_inf  # read by the fused kernel: it skips the update
        setattr(engine, FOUND_INF_ATTR, found_inf)

    def after_step(optimizer, args, kwargs):
        if hasattr(optimizer, "found_inf"):
            del optimizer.found_inf  # this step's flag only

    basic.register_step_pre_hook(before_step)
    basic.register_step_post_hook(after_step)
    _patch_norm_mask()
    return None


def mask_nan_or_inf_with_val_inplace(input: torch.Tensor, device=None, val: float = -1.0) -> None:
    """DeepSpeed's ``runtime.utils.mask_nan_or_inf_with_val_inplace`` without its host-to-device
    copy of ``val``: the same elements get the same value."""
    input.masked_fill_(~torch.isfinite(input), val)


def _patch_norm_mask() -> None:
    try:
        from deepspeed.runtime.zero import stage_1_and_2  # noqa: PLC0415  (only once DeepSpeed runs)
    except ImportError:  # a DeepSpeed-shaped engine without DeepSpeed (tests)
        return
    if hasattr(stage_1_and_2, "mask_nan_or_inf_with_val_inplace"):
        stage_1_and_2.mask_nan_or_inf_with_val_inplace = mask_nan_or_inf_with_val_inplace


def _device(optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
