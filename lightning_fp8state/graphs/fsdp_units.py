"""FSDP2 units (``fully_shard``ed blocks) inside per-block graphs: found, refused where a capture
cannot hold them, their static parameter copies and the input their forward is handed.

FSDP2 gathers a unit's parameters in its hooks into memory it frees after use and allocates
again (at another address) at the next gather, so a unit's graphs read static copies refilled
before each replay (:meth:`~.replay._BlockGraphs.load_params`), and the capture calls the unit's
forward past its hooks while every replay runs through them.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import ConfigError
from ..nn.fsdp import Fp8GatheredWeight

__all__ = ["call_through_hooks", "fsdp_unit", "unit_forward"]


def fsdp_unit(block: nn.Module) -> bool:
    """Whether ``block`` is an FSDP2 unit (``fully_shard``): its parameters are gathered by its
    own hooks into memory that is freed after use and allocated again by the next gather."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(block, FSDPModule)


def _static_copies(block: nn.Module, shared: dict) -> dict[str, torch.Tensor]:
    """The graphs' own copies of a gathered block's parameters, leaves like them. Blocks of the
    same parameter layout share one set (``shared``, by layout): every replay of a block fills
    them with that block's parameters first and the blocks replay one after another, so one
    block's worth of memory serves the stack. An FP8-gathered weight
    (``nn.fsdp.Fp8GatheredWeight``) shares its codes' buffer and keeps its own layer's captured
    snapshot, whose tensors the graphs read and each replay refreshes (:meth:`~.replay._BlockGraphs.load_params`)."""
    params = list(block.named_parameters())
    layout = tuple((n, type(p), tuple(p.shape), p.dtype, p.requires_grad) for n, p in params)
    buffers = shared.get(layout)
    if buffers is None:
        buffers = shared[layout] = {
            n: (p.fp8 if isinstance(p, Fp8GatheredWeight) else p)
            .detach()
            .clone()
            .requires_grad_(p.requires_grad and not isinstance(p, Fp8GatheredWeight))
            for n, p in params
        }
    return {
        n: Fp8GatheredWeight(buffers[n], p.snapshot, p.dtype).requires_grad_(p.requires_grad)
        if isinstance(p, Fp8GatheredWeight)
        else buffers[n]
        for n, p in params
    }


def _unit_cast_dtype(block: nn.Module) -> torch.dtype | None:
    """The dtype an FSDP2 unit's pre-forward casts floating inputs to (its
    ``MixedPrecisionPolicy.param_dtype`` with ``cast_forward_inputs``), or None: no cast."""
    state = block._get_fsdp_state() if hasattr(block, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    if policy is None or not getattr(policy, "cast_forward_inputs", False):
        return None
    return dtype


def _unit_input(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FSDP2 unit's pre-forward hands it to the unit's forward: cast to the unit's
    ``MixedPrecisionPolicy.param_dtype`` when the policy casts forward inputs (a leaf again, for
    the capture). The capture calls the forward past the hooks; a replay runs through them."""
    dtype = _unit_cast_dtype(block)
    if dtype is None or not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.detach().to(dtype).requires_grad_(x.requires_grad)


def _unit_side_inputs(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's side inputs as an FSDP2 unit's pre-forward casts them: every floating tensor
    (inside tuples, lists and dicts too) to the policy's ``param_dtype``, the rest as it is.
    Run inside the capture on the graphs' static buffers, so each replay casts what it was
    given, as the hook does on every call; a tensor already of that dtype is left alone (a
    call from inside the unit's hook gets it cast already)."""
    dtype = _unit_cast_dtype(block)
    if dtype is None:
        return args, kwargs

    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return tree_map(cast, args), tree_map(cast, kwargs)


def unit_forward(block: nn.Module) -> Callable:
    """An FSDP2 unit's own forward, past its ``__call__`` (and so past FSDP2's hooks): what runs
    the block from inside the unit's call, where the hooks ran already."""
    return types.MethodType(type(block).forward, block)


def call_through_hooks(block: nn.Module, forward: Callable, *args, **kwargs):
    """``block(*args, **kwargs)`` with ``forward`` in place of the block's forward for this call:
    the module's hooks (an FSDP2 unit's: gather the parameters, cast the inputs, hook the
    backward) run around ``forward``. An instance forward the block had is put back after."""
    own = block.__dict__.get("forward")
    block.forward = forward
    try:
        return block(*args, **kwargs)
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own


def _warn_unit_hooks(units: Sequence[nn.Module]) -> None:
    """The capture runs an FSDP2 unit's forward past its ``__call__``, so forward hooks of the
    unit itself (not FSDP2's) do not run there, while every replay runs them: a hook that
    changes the input or output would leave the graphs computing something else. Named in a
    warning (a hook that only observes is harmless)."""
    for block in units:
        state = block._get_fsdp_state() if hasattr(block, "_get_fsdp_state") else None
        hooks = [*block._forward_pre_hooks.values(), *block._forward_hooks.values()]
        other = [h for h in hooks if getattr(h, "__self__", None) is not state]
        if other:
            names = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in other)
            warnings.warn(
                f"GraphedBlocks: {type(block).__name__} (an FSDP2 unit) has forward hooks of its own ({names}); "
                "the capture runs its forward without them and every replay with them. A hook that changes the "
                "block's input or output belongs inside the block's forward",
                UserWarning,
                stacklevel=4,
            )


def _refuse_nested_units(blocks: Sequence[nn.Module]) -> None:
    """A block with an FSDP2 unit inside it (``shard_modules`` finer than the blocks) gathers
    part of itself in hooks the capture does not run: refused by name."""
    for block in blocks:
        for name, sub in block.named_modules():
            if name and fsdp_unit(sub):
                raise ConfigError(
                    f"GraphedBlocks: {type(block).__name__}.{name} is an FSDP2 unit inside a graphed block; per-block "
                    "graphs take each block whole: make the blocks the FSDP2 units (fully_shard each block, "
                    "not its parts), or train without graphs"
                )
