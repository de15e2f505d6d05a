"""FP8 all-gather of FSDP2-sharded Fp8Linear weights: at the event's frozen delayed scale, or
(a stateless recipe such as ``fp8_current``) at the full weight's per-call scale.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers a parameter's shards before each
use. Its extension hooks let the local shard choose what travels: a sharded parameter whose
local tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` sends the tensors the
first returns and rebuilds the unsharded parameter from what the second gets back.

:class:`Fp8ShardedWeight` is that local tensor for an :class:`~lightning_fp8state.nn.Fp8Linear`
weight: in every other respect it behaves as the high-precision shard it wraps (the optimizer,
gradient clipping and checkpoints see that). Before the all-gather it asks the layer's protocol
to quantize the shard at the event's weight scale (:meth:`QuantProtocol.gather_weight`: the
snapshot the layer's call pairs with the data), so one byte an element travels. Delayed scaling
knows that scale before the step (the frozen one; the shard's amax is recorded, no collective
for the scale); a per-call weight scale is the full weight's, which the protocol derives at the
event's start for every gathered weight from the shards' amaxes in one all-reduce (MAX) over the
shard group (the recipe's :meth:`~lightning_fp8state.quant_recipes.Recipe.gather_scales`). After
it, the layer's weight is a :class:`Fp8GatheredWeight`: the gathered FP8 codes and their
snapshot, with the parameter's dtype and shape for autograd; Fp8Linear consumes the codes
(:meth:`QuantProtocol.adopt`) and returns the weight's gradient in the parameter's dtype, which
FSDP2 reduce-scatters as usual. Quantization is elementwise, so the gathered codes are bitwise
those of quantizing the full weight at that scale. A backward re-gather (FSDP2 reshards after
the forward; a checkpointed region's recompute) quantizes with the same snapshot: same bytes.
What travels and how the full weight's codes and snapshot are assembled is the recipe's
(``Recipe.all_gather_inputs`` / ``Recipe.all_gathered``: block scales travel with the codes);
a weight whose split the recipe cannot gather in FP8 (``Recipe.shard_gather_problem``: block
scales need shards of whole blocks) gathers in high precision, warned about once per layer.

Call :func:`enable_fp8_all_gather` on a converted model before ``fully_shard``.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..config import QuantConfig, require_that
from ..errors import ConfigError, ConversionWarning
from ..protocol import ShardSource
from ..quant_recipes import recipe_for
from .experts import Fp8Experts
from .linear import Fp8Linear

__all__ = [
    "Fp8GatheredWeight",
    "Fp8ShardedWeight",
    "enable_fp8_all_gather",
    "fp8_all_gather_problem",
    "gathered_layers",
    "mark_sharded",
    "plain_shard",
    "step_on_local_shards",
    "uneven_fp8_gathers",
]

aten = torch.ops.aten

# Ops through which the shard stays an Fp8ShardedWeight: what fully_shard does to the
# parameter while it shards and pads it (views, slices, splits, in-place copies). Every other
# op runs on the high-precision shard and returns plain tensors (optimizer states, gradients,
# checkpoint copies never carry the wrapper).
_KEEP_WRAPPER = {
    aten.detach.default,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.new_zeros.default,
    aten._to_copy.default,
    aten.copy_.default,
}


class Fp8ShardedWeight(torch.Tensor):
    """The local shard of an FSDP2-sharded Fp8Linear weight (a wrapper of the high-precision
    shard) whose all-gather sends FP8 codes at the event's weight scale."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            layout=tensor.layout,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is aten.detach.default:
            return cls(args[0]._tensor.detach())
        target = args[0] if func is aten.copy_.default else None  # in place: the same wrapper back
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if isinstance(target, cls):
            return target
        if func not in _KEEP_WRAPPER:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8ShardedWeight(inner["_tensor"])

    # -- FSDP2's all-gather extension --------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard as FP8 codes (bytes) at the event's weight scale."""
        require_that(
            isinstance(module, Fp8Linear),
            "the module FSDP2 gathers an Fp8ShardedWeight for",
            type(module).__name__,
            "an Fp8Linear (call enable_fp8_all_gather on the converted model)",
        )
        problem = _shard_gather_problem(module, outer_size, mesh.size())
        if problem is not None:  # the recipe cannot gather this split in FP8: high precision
            return self._high_precision_input(module, problem, outer_size, mesh.size(), mp_policy), None
        if self.size(0) * mesh.size() != outer_size[0]:
            raise ConfigError(
                f"layer {module.layer_name!r}: its weight {tuple(outer_size)} is sharded unevenly over "
                f"{mesh.size()} ranks; FP8 all-gather needs out_features divisible by the shard group size. "
                "Set fp8_all_gather=False, or exclude the layer from conversion"
            )
        protocol = module.protocol
        q, snap = protocol.gather_weight(module.layer_name, self._tensor, mesh.get_group())
        return protocol.recipe.all_gather_inputs(q, snap), (snap, q.dtype, protocol.recipe)

    def _high_precision_input(self, module, problem: str, outer_size, world: int, mp_policy) -> tuple:
        """This rank's shard as FSDP2's own gather sends it (in the parameter dtype, padded to
        the largest shard's rows), warned about once per layer."""
        if module not in _WARNED_HIGH_PRECISION:
            _WARNED_HIGH_PRECISION.add(module)
            warnings.warn(
                f"layer {module.layer_name!r}: its weight gathers in high precision under FSDP2, not FP8: {problem}",
                ConversionWarning,
                stacklevel=2,
            )
        shard = self._tensor.to(mp_policy.param_dtype or self.dtype)
        rows = -(-outer_size[0] // world)
        if shard.size(0) != rows:  # an uneven split: FSDP2 gathers padded shards
            shard = torch.cat([shard, shard.new_zeros((rows - shard.size(0), *shard.shape[1:]))])
        return (shard,)

    # FSDP2 reads this method's signature before every gather (to tell its two hook forms
    # apart): a signature kept on the function is returned as it is, not rebuilt from the code
    # (a rebuild per call, two gathers a step for every FP8-gathered weight, showed in the host's time)
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The layer's unsharded weight: the gathered codes and the snapshot they were made with
        (assembled by the recipe, :meth:`~lightning_fp8state.quant_recipes.Recipe.all_gathered`);
        or, gathered in high precision, the gathered values themselves."""
        outputs = tuple(all_gather_outputs)
        if metadata is None:  # high precision (_high_precision_input): FSDP2's own result
            return None if out is not None else (outputs[0], outputs)
        snap, dtype, recipe = metadata
        codes, snap = recipe.all_gathered(outputs, snap, dtype)
        if out is not None:  # the same buffers were refilled: only the snapshot is new
            out._snapshot = snap
            return None
        return Fp8GatheredWeight(codes, snap, param_dtype), outputs


class Fp8GatheredWeight(torch.Tensor):
    """An all-gathered Fp8Linear weight: FP8 codes (``fp8``) and their snapshot (``snapshot``),
    presented to autograd with the parameter's dtype and shape. Only Fp8Linear consumes it;
    any other op on it is refused (it holds no high-precision values)."""

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, snapshot, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, fp8.size(), strides=fp8.stride(), dtype=dtype, device=fp8.device, requires_grad=False
        )

    def __init__(self, fp8: torch.Tensor, snapshot, dtype: torch.dtype) -> None:
        self.fp8 = fp8
        self._snapshot = snapshot

    @property
    def snapshot(self):
        """The snapshot (frozen scale and descale, stamps) the codes were quantized with."""
        return self._snapshot

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, {self.fp8.dtype}, {self._snapshot})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        t = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default) and isinstance(t, cls):
            return cls(t.fp8, t._snapshot, t.dtype)
        if func is aten.as_strided.default and isinstance(t, cls):
            size, stride = list(args[1]), list(args[2])
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0) if kwargs else 0
            if size == list(t.shape) and stride == list(t.stride()) and not offset:
                return cls(t.fp8, t._snapshot, t.dtype)
        layer = getattr(getattr(t, "_snapshot", None), "owner", None)
        raise RuntimeError(
            f"{func} reached the FP8 all-gathered weight of {layer}: it holds FP8 codes only and is consumed "
            "by Fp8Linear. Code that reads this weight outside the layer's forward needs fp8_all_gather=False "
            "(or exclude the layer from conversion)"
        )

    def __tensor_flatten__(self):
        return ["fp8"], (self._snapshot, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        snapshot, dtype = meta
        return Fp8GatheredWeight(inner["fp8"], snapshot, dtype)


# the layers already warned about gathering in high precision (_high_precision_input)
_WARNED_HIGH_PRECISION: weakref.WeakSet = weakref.WeakSet()


def uneven_fp8_gathers(model: nn.Module, world: int) -> list[str]:
    """The layers of ``model`` whose weights gather in FP8 (:func:`enable_fp8_all_gather`) but
    cannot be split evenly over ``world`` ranks, which one scale per weight needs (a recipe with
    scales per shard answers for itself: it gathers such a weight in high precision). The
    strategy asks before anything is sharded or restored: the gather itself would refuse them
    only at the first forward, after a checkpoint's restore."""
    uneven = []
    for module in model.modules():
        if isinstance(module, Fp8Linear) and isinstance(module.weight, Fp8ShardedWeight):
            shape = tuple(module.weight.shape)
            if shape[0] % world and _shard_gather_problem(module, shape, world) is None:
                uneven.append(module.layer_name)
    return uneven


def _shard_gather_problem(module: Fp8Linear, full_shape, world: int) -> str | None:
    """Why ``module``'s weight, split by FSDP2 over ``world`` ranks along dim 0 (chunks of
    ``ceil(rows / world)``), gathers in high precision (the recipe's answer); ``None``: FP8."""
    chunk = -(-full_shape[0] // world)
    rows = [max(0, min(chunk, full_shape[0] - r * chunk)) for r in range(world)]
    return module.protocol.recipe.shard_gather_problem(tuple(full_shape), rows)


def fp8_all_gather_problem(config: QuantConfig) -> str | None:
    """Why ``config`` cannot gather weights in FP8 (``None``: it can). The recipe is asked first
    (:meth:`~lightning_fp8state.quant_recipes.Recipe.all_gather_problem`)."""
    recipe = recipe_for(config)
    problem = recipe.all_gather_problem()
    if problem is not None:
        return problem
    if config.mode != "safe":
        return f"QuantConfig.mode={config.mode!r}: FP8 all-gather needs mode='safe' (the naive modes are defects)"
    if config.ownership not in ("per_layer", "per_layer_rank"):
        return (
            f"QuantConfig.ownership={config.ownership!r}: FP8 all-gather needs 'per_layer' or 'per_layer_rank' "
            "(FSDP2 quantizes the shard on its own copy-in stream, not the stream that runs the layer, so a "
            "per-stream owner cannot be told there; per_model is the defect)"
        )
    # a delayed weight scale records each rank's shard amax: the commit must reduce them; a
    # per-call one is the full weight's by construction (Recipe.gather_scales' all-reduce)
    if recipe.stateful("weight") and config.reduction_of("weight") != "data_parallel":
        return (
            f"QuantConfig.amax_reduction gives the weight {config.reduction_of('weight')!r}: with FP8 all-gather "
            "each rank records only its shard's amax, so the weight's amax must be reduced over the shard "
            "group (amax_reduction={'weight': 'data_parallel', ...}, the default)"
        )
    return None


def enable_fp8_all_gather(model: nn.Module) -> list[str]:
    """Make every converted Fp8Linear of ``model`` gather its weight in FP8 under FSDP2.

    Call after conversion and before ``fully_shard``: each such layer's weight becomes an
    :class:`Fp8ShardedWeight` (same values, same ``nn.Parameter``) and its protocol learns the
    layer (its weight owner is then registered, and the event's scales frozen, at each event's
    start). Under the ``bf16`` recipe nothing changes (nothing is quantized). Returns the names
    of the layers.

    Raises:
        ConfigError: a protocol whose configuration cannot gather in FP8
            (:func:`fp8_all_gather_problem`), or a layer already sharded.
    """
    names = []
    for module in model.modules():
        if not isinstance(module, Fp8Linear) or not module.protocol.recipe.quantized:
            continue
        problem = fp8_all_gather_problem(module.protocol.config)
        if problem is not None:
            raise ConfigError(f"fp8_all_gather=True is not allowed with {problem}")
        weight = module.weight
        if isinstance(weight, Fp8ShardedWeight):  # enabled before: only the registration below
            module.protocol.gathered_layers[module.layer_name] = lambda m=module: _shard_source(m)
            names.append(module.layer_name)
            continue
        if type(weight.data) is not torch.Tensor:
            raise ConfigError(
                f"layer {module.layer_name!r}: its weight is a {type(weight.data).__name__} (already sharded?): "
                "call enable_fp8_all_gather before fully_shard"
            )
        module.weight = nn.Parameter(Fp8ShardedWeight(weight.data), requires_grad=weight.requires_grad)
        # read at each event's start: fully_shard may move the shard, FSDP2 swaps the parameter
        module.protocol.gathered_layers[module.layer_name] = lambda m=module: _shard_source(m)
        names.append(module.layer_name)
    return names


def _shard_source(module: Fp8Linear) -> ShardSource:
    """Where ``module``'s weight lives now: its device, this rank's high-precision shard (``None``
    while FSDP2 holds it unsharded) and the shard group (``None`` before ``fully_shard``: the
    whole weight is the shard). HSDP's mesh shards over its last dimension."""
    weight = module.weight
    local = getattr(weight, "_local_tensor", weight)  # a sharded DTensor's shard
    shard = local._tensor if isinstance(local, Fp8ShardedWeight) else None
    mesh = getattr(weight, "device_mesh", None)
    group = None if mesh is None else mesh.get_group(mesh.ndim - 1)
    return ShardSource(weight.device, shard, group)


def gathered_layers(model: nn.Module) -> list[str]:
    """Names of the Fp8Linear layers of ``model`` whose weight is gathered in FP8."""
    out = []
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            local = getattr(module.weight, "_local_tensor", module.weight)  # a sharded DTensor's shard
            mesh = getattr(module.weight, "device_mesh", None)
            world = 1 if mesh is None else mesh.size(mesh.ndim - 1)
            if isinstance(local, Fp8GatheredWeight) or (
                isinstance(local, Fp8ShardedWeight)
                and _shard_gather_problem(module, module.weight.shape, world) is None
            ):
                out.append(module.layer_name)
    return out


def mark_sharded(model: nn.Module, *, every_layer: bool = False) -> list[str]:
    """Tell each converted layer of ``model`` that sits in an FSDP2 unit (``fully_shard``) that
    its weight is sharded; call after ``fully_shard`` (``fp8state_fsdp`` does). With
    ``every_layer``, every converted layer (DeepSpeed ZeRO-3 partitions every parameter:
    ``fp8state_deepspeed`` at stage 3 does this). Returns their names.

    Under ``fp8_delayed`` a checkpointed call keeps its weight's codes from the true forward for
    its recompute (``QuantConfig.weight_codes_once``). A layer whose weight FSDP2 reshards after
    the forward would then hold a full weight's codes per call until its backward, a byte a
    parameter of the whole model on every rank. A marked layer keeps none, and its recompute
    encodes the re-gathered weight again, to the same codes. Layers gathered in FP8
    (:func:`enable_fp8_all_gather`) keep none either way: their codes come from the gather.

    The experts of a mixture-of-experts layer (:class:`~lightning_fp8state.nn.Fp8Experts`) are
    marked too, every expert of every projection (``<experts>.<projection>.<e>``): FSDP2 shards
    their 3-D parameters along the expert dimension and gathers them whole before the unit's
    forward, so each expert's weight is quantized from the gathered parameter, and a call that kept
    its codes would hold an expert's full weight until the backward."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415  (FSDP2, torch >= 2.6)

    units = [model] if every_layer else [m for m in model.modules() if isinstance(m, FSDPModule)]
    names = set()
    for unit in units:
        for module in unit.modules():
            if isinstance(module, Fp8Linear):
                module.protocol.sharded_layers.add(module.layer_name)
                names.add(module.layer_name)
            elif isinstance(module, Fp8Experts):
                module.protocol.sharded_layers.update(module.owner_layers())
                names.update(module.owner_layers())
    return sorted(names)


def plain_shard(t: torch.Tensor) -> torch.Tensor:
    """``t`` without the wrapper: a DTensor whose local shard is an :class:`Fp8ShardedWeight`
    becomes the same DTensor over the plain high-precision shard (sharing its storage), for
    checkpoints and comparisons; anything else is returned as it is."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, Fp8ShardedWeight):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415  (only with FSDP2 in use)

        return DTensor.from_local(
            local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    if isinstance(t, Fp8ShardedWeight):
        return t._tensor
    return t


# Optimizers whose update is elementwise and whose step keys nothing by the tensors that
# ``_init_group`` hands it (SGD stores its momentum buffers back by parameter: not here)
_LOCAL_STEP_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


def _local_shard(t):
    """This rank's plain shard of ``t`` (a DTensor, or its Fp8ShardedWeight local), sharing its
    storage; anything else as it is."""
    local = getattr(t, "_local_tensor", t)
    return local._tensor if isinstance(local, Fp8ShardedWeight) else local


def _shard_local_update(params: list, grads: list) -> bool:
    """Whether updating the local tensors is what DTensor's dispatch would do: every DTensor
    gradient laid out as its parameter (no redistribution) and nothing ``Partial`` (a pending
    reduction DTensor would run first)."""
    for p, g in zip(params, grads, strict=True):
        placements = getattr(p, "placements", None)
        if placements is None:
            if hasattr(g, "placements"):
                return False
            continue
        if getattr(g, "placements", None) != placements or any(x.is_partial() for x in placements):
            return False
    return True


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``optimizer``'s step run on the local shards of its FSDP2 (DTensor) parameters and
    states, not through DTensor's dispatch. Returns whether it applies (``Adam`` and ``AdamW``
    exactly: an elementwise update, so each rank's shard is updated as the DTensor would be,
    bit for bit).

    On a sharded model every parameter, gradient and moment is a DTensor, and each op of the
    step (one fused kernel, or a few foreach ops) goes through DTensor's Python dispatch over
    hundreds of tensors, through the Fp8ShardedWeight wrapper as well where weights gather in
    FP8: milliseconds of host time a step at the 350M shape, where the FP8 step is host-bound
    (docs/PERFORMANCE.md). The step itself, its state and its state dict are torch's; only the
    lists its ``_init_group`` fills are replaced by the shards they hold (the same storage: the
    update lands in the DTensors).

    Where the local update would not be DTensor's, a step keeps the DTensor lists: a gradient
    laid out otherwise than its parameter or ``Partial`` (tensor parallelism), a
    ``differentiable`` group (autograd through the update needs the DTensors), and a step
    traced by ``torch.compile`` (dynamo would take the local tensors as constants of the graph:
    the first step's gradients, every step).
    """
    if type(optimizer) not in _LOCAL_STEP_OPTIMIZERS:
        return False
    if getattr(optimizer, "_fp8state_local_step", False):
        return True
    fill = type(optimizer)._init_group
    ref = weakref.ref(optimizer)  # the patch held by the optimizer holds it weakly: no cycle

    def init_group(group, *lists):
        before = [len(a) if isinstance(a, list) else None for a in lists]
        out = fill(ref(), group, *lists)
        if group.get("differentiable") or torch.compiler.is_compiling():
            return out
        params, grads = lists[0][before[0] :], lists[1][before[1] :]  # Adam's first two lists
        if not _shard_local_update(params, grads):
            return out
        for a, n in zip(lists, before, strict=True):
            if n is not None:
                a[n:] = [_local_shard(t) if isinstance(t, torch.Tensor) else t for t in a[n:]]
        return out

    optimizer._init_group = init_group
    optimizer._fp8state_local_step = True
    return True
