"""Per-step training metrics as pure functions on device tensors: no host sync in here.

Each function returns ``dict[str, Tensor]`` of 0-d device tensors (the torchtitan shape,
one step earlier): the caller decides when they reach the host (only on log steps, see
:class:`~lightning_fp8state.telemetry.recorder.StepRecorder`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..config import require_choice, require_that, require_type

__all__ = [
    "CLIP_ALGORITHMS",
    "SOURCE_GROUPINGS",
    "clip_event",
    "device_memory",
    "gradient_norms",
    "gradient_summary",
    "loss_summary",
    "source_groups",
]

CLIP_ALGORITHMS = ("norm", "value")
# What a gradient source is (source_groups' by=): a layer (the module's path) or one parameter.
SOURCE_GROUPINGS = ("layer", "parameter")


def gradient_norms(grads: Sequence[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """The ``ord``-norm of every gradient tensor, stacked: a ``[P]`` float64 device tensor.

    Norms are accumulated in float64, so a 2-norm is finite exactly when every element of
    its gradient is finite (float32/bf16/fp16 squares cannot overflow float64), and one
    fused ``torch._foreach_norm`` pass per device serves both the norm and the finiteness
    check.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    if any(hasattr(g, "device_mesh") for g in grads):  # sharded (FSDP2 DTensor) gradients
        return _sharded_norms(grads, ord)
    if math.isinf(ord) and any(g.numel() == 0 for g in grads):
        # the largest element of nothing: 0 (torch's max-norm refuses an empty tensor; a rank's
        # shard of a small FSDP2 parameter can be empty)
        grads = [g if g.numel() else g.new_zeros(1) for g in grads]
    device = grads[0].device
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    if len(by_device) == 1:
        return torch.stack(torch._foreach_norm(list(grads), ord, dtype=torch.float64))
    out = torch.empty(len(grads), dtype=torch.float64, device=device)
    for idx in by_device.values():
        norms = torch.stack(torch._foreach_norm([grads[i] for i in idx], ord, dtype=torch.float64))
        out[torch.tensor(idx, device=device)] = norms.to(device, non_blocking=True)
    return out


_SHARD_MASKS: dict[tuple[tuple[bool, ...], torch.device], torch.Tensor] = {}


def _shard_mask(sharded: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """Which gradients are sharded, as a bool device tensor made once per layout: building it
    from a list every step was a host-to-device copy that synchronized (FSDP2's one sync a
    step on the H200, benchmarks/lightning_host.py)."""
    key = (sharded, device)
    mask = _SHARD_MASKS.get(key)
    if mask is None:
        mask = _SHARD_MASKS[key] = torch.tensor(sharded, device=device)
    return mask


def _sharded_norms(grads: Sequence[torch.Tensor], ord: float) -> torch.Tensor:
    """:func:`gradient_norms` of DTensor gradients (FSDP2: sharded on a mesh): each rank's
    local norms, combined over the mesh in one all-reduce (SUM of squares, or MAX for the
    inf-norm); a replicated gradient counts once."""
    import torch.distributed as dist  # noqa: PLC0415  (only with sharded gradients)

    locals_ = [g.to_local() if hasattr(g, "device_mesh") else g for g in grads]
    norms = gradient_norms(locals_, ord)
    sharded = [hasattr(g, "device_mesh") and any(p.is_shard() for p in g.placements) for g in grads]
    mesh = next(g.device_mesh for g in grads if hasattr(g, "device_mesh"))
    require_that(mesh.ndim == 1, "the gradients' device mesh ndim", mesh.ndim, "1 (gradient norms of DTensors)")
    mask = _shard_mask(tuple(sharded), norms.device)
    group = mesh.get_group()
    if math.isinf(ord):
        part = torch.where(mask, norms, torch.zeros_like(norms))
        dist.all_reduce(part, op=dist.ReduceOp.MAX, group=group)
        return torch.where(mask, part, norms)
    part = torch.where(mask, norms.pow(ord), torch.zeros_like(norms))
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return torch.where(mask, part.pow(1.0 / ord), norms)


def source_groups(names: Sequence[str], by: str = "layer") -> tuple[list[str], list[int]]:
    """Group parameter names into gradient sources.

    Args:
        names: parameter names as ``named_parameters()`` gives them (``"blocks.0.fc1.weight"``).
        by: ``"layer"`` (the owning module's path, ``"blocks.0.fc1"``) or ``"parameter"``.

    Returns:
        The source names and, per parameter, the index of its source.
    """
    require_choice("by", by, SOURCE_GROUPINGS)
    sources: dict[str, int] = {}
    index = []
    for name in names:
        source = name.rsplit(".", 1)[0] if by == "layer" and "." in name else name
        index.append(sources.setdefault(source, len(sources)))
    return list(sources), index


def gradient_summary(param_norms: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> dict[str, torch.Tensor]:
    """Total gradient norm, finiteness and the dominant source, all on the device.

    Args:
        param_norms: ``[P]`` per-parameter 2-norms (:func:`gradient_norms`).
        group_index: ``[P]`` int64 source index of each parameter (:func:`source_groups`).
        n_groups: number of sources.

    Returns:
        ``grad_norm`` (total 2-norm), ``grad_finite`` (1.0 when every gradient element is
        finite), ``dominant_index`` (the source with the largest norm; a source holding a
        NaN wins, so a non-finite step names where the NaN is), ``dominant_share`` (that
        source's share of the total *squared* norm: shares of all sources sum to 1).
    """
    sq = param_norms.square()
    total_sq = sq.sum()
    group_sq = torch.zeros(n_groups, dtype=sq.dtype, device=sq.device).index_add_(0, group_index, sq)
    # max over a dim: the value and its index on the device (a NaN wins). Indexing with a 0-d
    # index tensor (group_sq[argmax]) would read the index on the host: a sync per step.
    largest, dominant = group_sq.max(dim=0)
    total = total_sq.sqrt()
    return {
        "grad_norm": total,
        "grad_finite": torch.isfinite(total).to(torch.float64),
        "dominant_index": dominant.to(torch.float64),
        "dominant_share": largest / total_sq,
    }


def clip_event(
    total_norm: torch.Tensor, max_abs: torch.Tensor | None, threshold: float, algorithm: str = "norm"
) -> torch.Tensor:
    """1.0 when clipping at ``threshold`` changes the gradients of a finite step, else 0.0.

    ``norm``: the criterion of ``torch.nn.utils.clip_grad_norm_`` (it scales by
    ``threshold / (norm + 1e-6)`` when that is below 1). ``value``: some element's
    magnitude exceeds ``threshold`` (``max_abs`` is the largest gradient magnitude).
    """
    require_choice("algorithm", algorithm, CLIP_ALGORITHMS)
    finite = torch.isfinite(total_norm)
    if algorithm == "norm":
        clipped = (threshold / (total_norm + 1e-6)) < 1.0
    else:
        require_type("max_abs", max_abs, torch.Tensor, "a tensor", why="value clipping compares it with the threshold")
        clipped = max_abs > threshold
    return (clipped & finite).to(torch.float64)


def loss_summary(loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's loss (detached, float64) and whether it is finite."""
    value = loss.detach().reshape(()).to(torch.float64)
    return {"loss": value, "loss_finite": torch.isfinite(value).to(torch.float64)}


def device_memory(device: torch.device | None) -> dict[str, float]:
    """The caching allocator's memory of a CUDA ``device`` in GiB: ``train/mem_peak_gib``, the
    most allocated at once since the process began (or since the caller's last
    ``torch.cuda.reset_peak_memory_stats``: never reset here, a user's own reading stays theirs),
    and ``train/mem_reserved_gib``, what the allocator holds now. Host counters only: no device
    sync. Empty for any other device."""
    if device is None or device.type != "cuda":
        return {}
    return {
        "train/mem_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "train/mem_reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
    }
