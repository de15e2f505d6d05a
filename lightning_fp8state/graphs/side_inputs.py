"""A graphed block's side inputs: every argument of its call after the chained hidden state.

A Hugging Face decoder layer is called as ``layer(hidden, attention_mask=..., position_ids=...,
position_embeddings=(cos, sin), use_cache=False, ...)``: the hidden state is chained from
block to block, every other argument is a constant of the step's shape (rotary tables, masks,
position ids, flags). A CUDA graph reads fixed memory and repeats no Python, so:

- a tensor among them becomes a static input of the graphs: copied into a buffer of the
  capture's before each replay, once per pass for blocks that share it, and not at all while it
  is the very tensor (unchanged) the buffer was last filled from;
- a plain value (None, bool, int, float, str, a dtype, a device, an enum) is part of what was
  captured: it must be equal at every call;
- anything else (a key-value cache object, a tensor that requires grad) is refused by name.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["SideInputs", "StaticSide"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def argument_names(forward: Callable, n_positional: int) -> list[str]:
    """The names of ``forward``'s positional parameters after the first (the hidden state),
    ``args[k]`` where the signature does not say (``*args``, a builtin)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    named = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [named[k] if k < len(named) else f"args[{k}]" for k in range(1, n_positional + 1)]


def _flatten(name: str, value: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, (tuple, list)):
        for k, item in enumerate(value):
            _flatten(f"{name}[{k}]", item, out)
    elif isinstance(value, _PLAIN):
        out.append((name, value))
    else:
        cache = name.startswith("past_key_value") or "cache" in type(value).__name__.lower()
        hint = " (a key-value cache: pass use_cache=False while training)" if cache else ""
        raise ConfigError(
            f"GraphedBlocks: argument '{name}' is a {type(value).__name__}: a graphed block's side inputs are "
            f"tensors, tuples of tensors or plain values (None, bool, int, float, str){hint}; train this model "
            "without graphs otherwise"
        )


def _rebuild(value: Any, leaves) -> Any:
    """``value`` with its leaves taken in order from the iterator ``leaves`` (as _flatten walks)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(item, leaves) for item in value)
    return next(leaves)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}, {value.dtype} on {value.device}"
    return repr(value)


class StaticSide:
    """The graphs' buffer for one side-input tensor (shared by the blocks that received the
    same tensor at the capture), with what it was last filled from."""

    def __init__(self, tensor: torch.Tensor, pass_id: int) -> None:
        self.buffer = tensor.detach().clone()
        self.source: torch.Tensor | None = tensor
        self.version = tensor._version
        self.filled_in = pass_id  # the runner's pass that last filled it

    def fill(self, tensor: torch.Tensor, pass_id: int, name: str) -> None:
        """Make the buffer hold ``tensor``'s values for pass ``pass_id``. No copy while it is the
        very tensor the buffer last copied, unchanged; within one pass the buffer is read by
        every block sharing it (their backwards included), so another tensor there is refused."""
        if self.filled_in == pass_id:
            if tensor is not self.source:
                raise ConfigError(
                    f"GraphedBlocks: argument '{name}' is another tensor than the one an earlier block got in this "
                    "pass, while at the capture the blocks shared one: the graphs read one buffer for both. Pass "
                    "the blocks the same tensor, or capture again"
                )
            return
        if tensor is not self.source or tensor._version != self.version:
            with torch.no_grad():
                self.buffer.copy_(tensor)
            self.source, self.version = tensor, tensor._version
        self.filled_in = pass_id


class SideInputs:
    """One block's side inputs at one call: their names, leaves and structure.

    Args:
        args: the positional arguments after the hidden state.
        kwargs: the keyword arguments.
        names: the positional arguments' names (:func:`argument_names`).

    Raises:
        ConfigError: an argument of another kind than a tensor, a tuple of them or a plain
            value; a side-input tensor that requires grad.
    """

    def __init__(self, args: Sequence, kwargs: dict, names: Sequence[str]) -> None:
        self.args, self.kwargs = tuple(args), dict(kwargs)
        leaves: list[tuple[str, Any]] = []
        for name, value in zip(names, self.args, strict=True):
            _flatten(name, value, leaves)
        for name, value in self.kwargs.items():
            _flatten(name, value, leaves)
        self.leaves = leaves
        for name, value in leaves:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ConfigError(
                    f"GraphedBlocks: argument '{name}' requires grad: a graphed block's side inputs are constants "
                    "of the step (the graphs return no gradient for them). Detach it, or make it the block's "
                    "first (chained) input"
                )
        self.tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]

    @property
    def empty(self) -> bool:
        return not self.leaves

    def spec(self) -> tuple:
        """What a later call must match: names, and per leaf its shape, dtype and device (a
        tensor) or its value."""
        return tuple(
            (name, (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else ("value", v))
            for name, v in self.leaves
        )

    def check_against(self, spec: tuple, block: str) -> None:
        """ConfigError naming the first argument that differs from the captured ``spec``."""
        names = [n for n, _ in spec]
        if [n for n, _ in self.leaves] != names:
            raise ConfigError(
                f"GraphedBlocks: {block} was captured with the side inputs {names}, now called with "
                f"{[n for n, _ in self.leaves]}: call it with the same arguments every step"
            )
        for (name, want), (_, value) in zip(spec, self.leaves, strict=True):
            if isinstance(value, torch.Tensor):
                if want[0] == "value" or (tuple(value.shape), value.dtype, value.device) != want:
                    was = repr(want[1]) if want[0] == "value" else f"{want[0]}, {want[1]} on {want[2]}"
                    raise ConfigError(
                        f"GraphedBlocks: dynamic shapes are not captured: argument '{name}' of {block} changed from "
                        f"{was} to {_describe(value)}; keep the step's shapes fixed (drop_last=True, fixed padding)"
                    )
            elif want[0] != "value" or type(value) is not type(want[1]) or value != want[1]:
                was = f"a tensor {want[0]}" if want[0] != "value" else repr(want[1])
                raise ConfigError(
                    f"GraphedBlocks: argument '{name}' of {block} changed from {was} to {_describe(value)}: a "
                    "non-tensor side input is a constant of the capture; keep it fixed, or train without graphs"
                )

    def static(self, shared: dict[int, StaticSide], pass_id: int) -> tuple[list[StaticSide], tuple, dict]:
        """The capture's buffers for this call's tensors (one per distinct tensor, in
        ``shared`` by the tensor's id for the blocks after), and the arguments with the
        buffers in the tensors' places, for the capture to call the block with."""
        sides = []
        for t in self.tensors:
            entry = shared.get(id(t))
            if entry is None or entry.source is not t:
                entry = shared[id(t)] = StaticSide(t, pass_id)
            sides.append(entry)
        buffers = iter([s.buffer for s in sides])
        values = iter([next(buffers) if isinstance(v, torch.Tensor) else v for _, v in self.leaves])
        args = tuple(_rebuild(a, values) for a in self.args)
        kwargs = {k: _rebuild(v, values) for k, v in self.kwargs.items()}
        return sides, args, kwargs

    def load(self, sides: Sequence[StaticSide], pass_id: int) -> None:
        """Fill the captured buffers ``sides`` with this call's tensors, for the replays."""
        names = [n for n, v in self.leaves if isinstance(v, torch.Tensor)]
        for side, t, name in zip(sides, self.tensors, names, strict=True):
            side.fill(t, pass_id, name)
