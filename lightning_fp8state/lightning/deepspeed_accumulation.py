"""A DeepSpeed engine's gradient-accumulation window, saved and restored per rank (ZeRO stage 2).

Lightning's DeepSpeed strategy calls ``engine.step()`` after every microbatch; the engine counts
them (``engine.micro_steps``) and applies the optimizer only at its boundaries
(``(micro_steps + 1) % gradient_accumulation_steps == 0``). DeepSpeed's own checkpoint does not
store that counter, and ZeRO-2 keeps the window's gradients inside its optimizer, already
reduce-scattered, so each rank holds only its own partition's sum. Between two microbatches
(after the epilogue of ``DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue``) that
sum is, per parameter group ``i``:

* ``optimizer.all_grad_tensors[i]``: one tensor per parameter of the partition, summed in place
  every microbatch, when gradients accumulate in the parameters' dtype;
* ``optimizer.averaged_gradients[i].flat_partition``: one flat tensor of the partition, when
  they accumulate in fp32 apart from bf16/fp16 parameters (``data_types.grad_accum_dtype``).

Everything else is rebuilt for every microbatch (ipg buckets, ``params_already_reduced``,
``param.grad``). Saving those tensors with the two counters and writing them back after
``engine.load_checkpoint`` continues the window bit-identically. Only the configuration whose
layout is read here is supported: :func:`unsupported_reason` names any other.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import StateLoadError

__all__ = [
    "ACCUMULATION_FORMAT_VERSION",
    "ACCUMULATION_KEY",
    "capture_window",
    "check_format_version",
    "rank_file",
    "restore_window",
    "unsupported_reason",
    "window_position",
]

# checkpoint[ACCUMULATION_KEY] = {"format_version", "micro_steps", "gradient_accumulation_steps",
# "world_size", "mid_window", "grads": "saved" | "none" | "lost", "unsupported": str | None}; the
# gradients of rank r are in <checkpoint dir>/<Lightning's tag>/rank_file(r).
ACCUMULATION_KEY = "fp8state_deepspeed"
ACCUMULATION_FORMAT_VERSION = 1
LIGHTNING_TAG = "checkpoint"  # DeepSpeedStrategy.save_checkpoint's tag


def check_format_version(found: Any, what: str) -> None:
    """StateLoadError unless ``found`` is ACCUMULATION_FORMAT_VERSION (``what``: where it was read)."""
    if found != ACCUMULATION_FORMAT_VERSION:
        raise StateLoadError(
            f"{what} format_version {found!r} is not supported: expected {ACCUMULATION_FORMAT_VERSION}"
        )


def rank_file(checkpoint_dir: str, rank: int) -> str:
    """Where rank ``rank``'s accumulated gradients live inside a Lightning DeepSpeed checkpoint."""
    return os.path.join(checkpoint_dir, LIGHTNING_TAG, f"fp8state_accumulation_rank{rank:05d}.pt")


def window_position(engine: Any) -> tuple[int, int]:
    """``(micro_steps, gradient_accumulation_steps)`` of the engine."""
    return int(engine.micro_steps), int(engine.gradient_accumulation_steps())


def _zero_optimizer_class() -> type:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: PLC0415 (DeepSpeed is optional)

    return DeepSpeedZeroOptimizer


def unsupported_reason(engine: Any) -> str | None:
    """Why this engine's accumulated gradients cannot be saved exactly, or ``None`` when they can."""
    stage = int(engine.zero_optimization_stage())
    if stage != 2:
        what = {0: "ZeRO disabled (stage 0)", 1: "ZeRO stage 1", 3: "ZeRO stage 3"}.get(stage, f"ZeRO stage {stage}")
        return f"{what}: only ZeRO stage 2 keeps the window in buffers this strategy reads"
    optimizer = engine.optimizer
    cls = _zero_optimizer_class()
    if type(optimizer) is not cls:
        return f"the optimizer wrapper {type(optimizer).__name__} (only {cls.__name__} is supported)"
    if getattr(optimizer, "cpu_offload", False):
        return "optimizer offload (zero_optimization.offload_optimizer)"
    if getattr(optimizer, "zenflow", False):
        return "ZenFlow"
    if not getattr(optimizer, "partition_gradients", False):
        return "unpartitioned gradients"
    if getattr(optimizer, "_coalesce_grad_reduction", False):
        return "coalesce_grad_reduction"
    if hasattr(engine, "managed_gradient_accumulation") and not engine.managed_gradient_accumulation():
        return "managed_gradient_accumulation=false"
    if getattr(engine, "_is_gradient_accumulation_boundary", None) is not None:
        return "a boundary set by engine.set_gradient_accumulation_boundary()"
    if getattr(engine, "is_deepcompile_active", lambda: False)():
        return "DeepCompile"
    if getattr(engine, "pipeline_parallelism", False):
        return "pipeline parallelism"
    needed = ("all_grad_tensors", "averaged_gradients", "_use_compact_grad_partition_buffer", "micro_step_id")
    missing = [name for name in needed if not hasattr(optimizer, name)]
    if missing:
        import deepspeed  # noqa: PLC0415

        return f"DeepSpeed {deepspeed.__version__}, whose ZeRO-2 optimizer lacks {missing} (written for 0.19)"
    if any(getattr(p, "use_muon", False) for group in optimizer.bit16_groups for p in group):
        return "the Muon optimizer"
    for i, layout in enumerate(_layout(optimizer)):
        buffer = optimizer.averaged_gradients.get(i)
        if layout["compact"] and buffer is not None and getattr(buffer, "flat_partition", None) is None:
            return f"an fp32 accumulation buffer of group {i} without flat_partition (another DeepSpeed layout)"
        if not layout["compact"] and buffer is not None:
            return f"averaged_gradients of group {i} set inside the window (another DeepSpeed layout)"
    return None


def _layout(optimizer: Any) -> list[dict]:
    return [
        {
            "compact": bool(optimizer._use_compact_grad_partition_buffer(i)),
            "partition_size": int(optimizer.partition_size[i]),
            "shapes": [list(p.shape) for p in optimizer.params_in_partition[i]],
        }
        for i in range(len(optimizer.bit16_groups))
    ]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def capture_window(engine: Any, rank: int, world_size: int) -> dict:
    """This rank's accumulated gradients of the open window (plain tensors and values).

    Call between microbatches, on an engine :func:`unsupported_reason` accepts (it also checks
    that the buffers read here have the layout this module expects).
    """
    optimizer = engine.optimizer
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # overlap_comm reduces on a side stream
    groups = []
    for i, layout in enumerate(_layout(optimizer)):
        if layout["compact"]:
            flat = getattr(optimizer.averaged_gradients.get(i), "flat_partition", None)
            groups.append({"flat_partition": None if flat is None else _cpu(flat), "tensors": None})
        else:
            tensors = optimizer.all_grad_tensors.get(i)
            groups.append({"flat_partition": None, "tensors": None if tensors is None else [_cpu(t) for t in tensors]})
    micro_steps, gas = window_position(engine)
    return {
        "format_version": ACCUMULATION_FORMAT_VERSION,
        "rank": rank,
        "world_size": world_size,
        "micro_steps": micro_steps,
        "gradient_accumulation_steps": gas,
        "optimizer_micro_step_id": int(optimizer.micro_step_id),
        "layout": _layout(optimizer),
        "groups": groups,
    }


def restore_window(engine: Any, saved: dict, rank: int, world_size: int, device: torch.device) -> None:
    """Write ``saved`` (from :func:`capture_window` on this rank) back into the engine.

    Raises:
        StateLoadError: the saved window belongs to another rank, world size, accumulation
            length or partition layout; nothing is written then.
    """
    reason = unsupported_reason(engine)
    if reason is not None:
        raise StateLoadError(
            f"the checkpoint holds a ZeRO-2 gradient-accumulation window, but this run uses {reason}: "
            "resume with the configuration that saved it"
        )
    check_format_version(saved.get("format_version"), "accumulated-gradient file")
    optimizer = engine.optimizer
    micro_steps, gas = window_position(engine)
    expected = {
        "rank": rank,
        "world_size": world_size,
        "gradient_accumulation_steps": gas,
        "layout": _layout(optimizer),
    }
    for key, value in expected.items():
        if saved.get(key) != value:
            raise StateLoadError(
                f"the checkpoint's ZeRO-2 accumulation window does not fit this run: {key} expected {value!r}, "
                f"found {saved.get(key)!r}. Resume with the same devices, accumulate_grad_batches and model"
            )
    groups = []
    for i, group in enumerate(saved["groups"]):
        flat, tensors = group["flat_partition"], group["tensors"]
        if expected["layout"][i]["compact"]:
            if tensors is not None or (flat is not None and flat.dtype != optimizer.gradient_accumulation_dtype):
                raise StateLoadError(
                    f"ZeRO-2 group {i}: the saved fp32 accumulation buffer has the wrong kind or dtype"
                )
        elif flat is not None:
            raise StateLoadError(f"ZeRO-2 group {i}: the saved window has a flat buffer where tensors were expected")
        elif tensors is not None and [list(t.shape) for t in tensors] != expected["layout"][i]["shapes"]:
            raise StateLoadError(f"ZeRO-2 group {i}: the saved gradients' shapes differ from this partition's")
        groups.append((flat, tensors))
    for i, (flat, tensors) in enumerate(groups):
        if expected["layout"][i]["compact"]:
            if flat is None:
                optimizer.averaged_gradients[i] = None
            else:
                buffer = optimizer._build_compact_grad_partition_buffer(i)
                buffer.flat_partition.copy_(flat.to(buffer.flat_partition.device))
                optimizer.averaged_gradients[i] = buffer
        else:
            optimizer.averaged_gradients[i] = None
            optimizer.all_grad_tensors[i] = None if tensors is None else [t.to(device) for t in tensors]
    optimizer.micro_step_id = int(saved["optimizer_micro_step_id"])
    engine.micro_steps = int(saved["micro_steps"])
