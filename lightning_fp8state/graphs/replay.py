"""One block's two CUDA graphs with their static buffers, and the autograd Function that
replays them: forward graph in the forward, backward graph (the recompute inside) in the
backward, the parameters' gradients handed back to autograd so a strategy's hooks stay eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import ConfigError, StateTransitionError
from ..nn.fsdp import Fp8GatheredWeight
from .fsdp_units import _static_copies, _unit_side_inputs, call_through_hooks

__all__: list[str] = []  # internal to GraphedBlocks


def _flat_layout(grads: Sequence[torch.Tensor | None]):
    """``(dtype, device, segment sizes, the segment of each gradient)`` for one buffer that
    holds every gradient of ``grads`` at a 16-byte-aligned offset (padding segments between),
    or ``False`` when they do not share a dtype and device or one is not contiguous."""
    live = [g for g in grads if g is not None]
    if not live or any(g.dtype != live[0].dtype or g.device != live[0].device for g in live):
        return False
    if not all(g.is_contiguous() for g in live):
        return False
    align = max(1, 16 // live[0].element_size())
    sizes, picks = [], []
    for g in live:
        n = g.numel()
        picks.append(len(sizes))
        sizes.append(n)
        pad = -n % align
        if pad:
            sizes.append(pad)
    return live[0].dtype, live[0].device, sizes, picks


def hidden_state(out, block: nn.Module) -> torch.Tensor:
    """The hidden state a block returned: the tensor itself, or the first element of a tuple
    whose other elements are None (a Hugging Face layer's ``(hidden, None)``). Another tensor
    output would be a graph output nobody chains: refused."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        extra = [k for k, v in enumerate(out) if k and v is not None]
        if not extra:
            return out[0]
        raise ConfigError(
            f"GraphedBlocks: {type(block).__name__} returned a {type(out).__name__} with outputs besides the hidden "
            f"state (at positions {extra}); per-block graphs chain the first and take no other output. Turn the "
            "others off (output_attentions=False, use_cache=False), or train without graphs"
        )
    raise ConfigError(
        f"GraphedBlocks: {type(block).__name__} returned a {type(out).__name__}; expected a tensor, or a tuple "
        "whose first element is the hidden state"
    )


def run_block(
    block: nn.Module,
    forward: Callable | None,
    args: tuple,
    kwargs: dict,
    lengths: dict | None = None,
    index: int = 0,
    x: torch.Tensor | None = None,
):
    """``block``'s hidden state for ``x`` and the side inputs (``forward``: what runs it, the
    module's call by default); ``lengths[index]``: the length of the tuple it returned, if one.
    A module in the arguments of a ``functools.partial`` of this is what a checkpoint's buffer
    restore looks for."""
    out = (block if forward is None else forward)(x, *args, **kwargs)
    if lengths is not None and isinstance(out, (tuple, list)):
        lengths[index] = len(out)
    return hidden_state(out, block)


class _BlockGraphs:
    """One block's two graphs and their static buffers.

    ``copy_params`` (an FSDP2 unit, gathered when this is built): the graphs read static copies
    of the gathered parameters, refilled from the live ones before each replay, because FSDP2
    frees the gathered memory after each use and allocates it again (at another address) at the
    next gather. Without it the graphs read the parameters' own memory through aliases."""

    def __init__(
        self,
        block: nn.Module,
        copy_params: bool = False,
        shared: dict | None = None,
        forward: Callable | None = None,
    ) -> None:
        self.block = block
        self.copy_params = copy_params
        self.forward = forward  # what runs the block (its module call by default)
        # the side inputs as the capture calls the block with them (static buffers for the
        # tensors), the buffers, and the captured spec a replay's call must match
        self.side_args: tuple = ()
        self.side_kwargs: dict = {}
        self.sides: list = []
        self.side_spec: tuple = ()
        self.defer_forward = False  # a per-layer capture replays the forwards after the last block
        self.input_filled = False  # a per-layer capture's first block: static_in holds the call's x already
        self.params = [p for p in block.parameters() if p.requires_grad]
        if copy_params:
            self.aliases = _static_copies(block, {} if shared is None else shared)
        else:
            # the capture differentiates leaf aliases of the parameters (same memory), not the
            # parameters: a strategy's hooks keep the parameters' AccumulateGrad nodes alive,
            # bound to the stream they were made on, and the capture's backward may not wait on it
            self.aliases = {name: p.detach().requires_grad_(p.requires_grad) for name, p in block.named_parameters()}
        # (an FSDP2 unit) where each parameter's gradient goes among all its parameters
        self.grad_slots = [i for i, a in enumerate(self.aliases.values()) if a.requires_grad]
        # (aliases) where the parameters live: checked before each replay, which reads them there
        # (the parameters themselves, listed once: named_parameters() walks the submodules, which
        # costs more than the check itself)
        self.aliased = None if copy_params else list(block.named_parameters())
        self.addresses = None if copy_params else [a.data_ptr() for a in self.aliases.values()]
        self.fwd = self.bwd = None
        self.static_in: torch.Tensor | None = None
        self.static_out: torch.Tensor | None = None
        self.static_grad_out: torch.Tensor | None = None
        self.static_grad_in: torch.Tensor | None = None
        self.static_grad_params: tuple = ()
        self._grad_layout = None  # fresh_grads' segments, worked out at its first call

    def check_addresses(self) -> None:
        """The aliased parameters are still where the capture read them (an FSDP2 unit above
        the blocks, or anything else that re-allocates them, would leave the graphs reading freed
        memory): a host check per replay, no device work."""
        if self.addresses is None:
            return
        for (name, p), where in zip(self.aliased, self.addresses, strict=True):
            if p.data_ptr() != where:
                raise StateTransitionError(
                    f"GraphedBlocks: {type(self.block).__name__}.{name} moved since the capture (its memory was "
                    "re-allocated: an FSDP2 unit above the blocks gathers it anew each step?); the graphs read "
                    "it where it was. Make every block an FSDP2 unit of its own (fully_shard each block), or "
                    "train without graphs"
                )

    def call_with_aliases(self, x: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.side_args, self.side_kwargs
        if self.copy_params:
            # the unit's own forward, past FSDP2's hooks (they would gather inside the capture),
            # its side inputs cast as the hooks cast them (from the static buffers, every replay)
            args, kwargs = _unit_side_inputs(self.block, args, kwargs)
            with torch.nn.utils.stateless._reparametrize_module(self.block, self.aliases, tie_weights=True):
                return hidden_state(type(self.block).forward(self.block, x, *args, **kwargs), self.block)
        if self.forward is not None:  # a layer whose own call routes here: its forward, under aliases
            with torch.nn.utils.stateless._reparametrize_module(self.block, self.aliases, tie_weights=True):
                return hidden_state(self.forward(x, *args, **kwargs), self.block)
        return hidden_state(torch.func.functional_call(self.block, self.aliases, (x, *args), kwargs), self.block)

    def load_params(self, live: Sequence[torch.Tensor]) -> None:
        """Copy the live (gathered) parameters into the graphs' static ones. An FP8-gathered
        weight: its codes, and its snapshot's scale, descale (and amax) into the captured
        snapshot's tensors, which the graphs read (a delayed scale's are views of the event's
        frozen copy, refilled by the template already: the same values; a stateless recipe's are
        the full weight's, derived anew every event)."""
        # one batched copy per dtype for the block, not a launch per tensor: torch's foreach
        # copy takes its one-kernel route only when every source shares a dtype, and walks a
        # mixed list (FP8 codes as uint8 beside float32 scales and biases) one copy_ at a time,
        # a launch and its host work for every tensor of every block on every replay
        groups: dict[torch.dtype, tuple[list, list]] = {}

        def add(d: torch.Tensor, s: torch.Tensor) -> None:
            pair = groups.get(d.dtype)
            if pair is None:
                pair = groups[d.dtype] = ([], [])
            pair[0].append(d)
            pair[1].append(s)

        for alias, p in zip(self.aliases.values(), live, strict=True):
            if isinstance(alias, Fp8GatheredWeight):
                add(alias.fp8.view(torch.uint8), p.fp8.view(torch.uint8))  # the codes' bytes
                held, now = alias.snapshot, p.snapshot
                if held is not now:
                    add(held.scale, now.scale)
                    add(held.descale, now.descale)
                    if held.amax is not None and now.amax is not None:
                        add(held.amax, now.amax)
            else:
                add(alias, p)
        with torch.no_grad():
            for dst, src in groups.values():
                torch._foreach_copy_(dst, src)

    def fresh_grads(self) -> tuple:
        """The parameters' gradients of the last backward replay, out of the graph's memory:
        one allocation and one batched copy for the block, where a ``clone()`` per gradient costs
        a launch and its host work for each of them (a dozen a GPT block, hundreds a step).
        Each gradient is a view of its own 16-byte-aligned segment of the new buffer (autograd
        keeps it or accumulates it like a clone; the buffer lives while any view does). Mixed
        dtypes or devices, or a non-contiguous static gradient: a clone each."""
        static = self.static_grad_params
        if self._grad_layout is None:
            self._grad_layout = _flat_layout(static)
        layout = self._grad_layout
        if layout is False:
            return tuple(None if g is None else g.clone() for g in static)
        dtype, device, sizes, picks = layout
        parts = torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes)
        live = [g for g in static if g is not None]
        views = [parts[i].view(g.shape) for i, g in zip(picks, live, strict=True)]
        torch._foreach_copy_(views, live)
        it = iter(views)
        return tuple(None if g is None else next(it) for g in static)

    def live_params(self) -> list[torch.Tensor]:
        """What a replay hands the autograd Function: the parameters that require grad (aliased
        by the graphs), or an FSDP2 unit's every parameter as gathered now, in the static
        copies' order (FSDP2 registers the gathered ones on the module at each gather)."""
        if not self.copy_params:
            return self.params
        live = dict(self.block.named_parameters())
        return [live[n] for n in self.aliases]

    def run_unit(self, x: torch.Tensor) -> torch.Tensor:
        """The replayed block, called through the FSDP2 unit's ``__call__``: its pre-forward hook
        gathers the parameters (registered on the module until its post-forward reshards them)
        and hooks the backward (gather again, then reduce-scatter the gradients autograd
        accumulates into the gathered parameters)."""
        return call_through_hooks(self.block, lambda inp: _BlockReplay.apply(self, inp, *self.live_params()), x)


class _BlockReplay(torch.autograd.Function):
    """Forward: the block's forward graph; backward: its backward graph (with the recompute)."""

    @staticmethod
    def forward(ctx, graphs: _BlockGraphs, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if graphs.copy_params:  # an FSDP2 unit: every parameter, as gathered now
            graphs.load_params(params)
            ctx.params = params  # not saved_tensors: the backward's gather rewrites them in place
        if graphs.defer_forward:
            # the capture's pass (call_block): static_in was cloned from x at the capture (a copy
            # here would bump the version its checkpoint saved), the forwards are replayed once
            # every block is captured
            graphs.defer_forward = False
        else:
            if graphs.input_filled:  # cloned from this x at the capture: no copy before the backwards' capture
                graphs.input_filled = False
            elif x.data_ptr() != graphs.static_in.data_ptr():  # chained blocks read the last output in place
                graphs.static_in.copy_(x)
            graphs.fwd.replay()
        ctx.graphs = graphs
        return graphs.static_out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        graphs = ctx.graphs
        if graphs.copy_params:  # FSDP2's pre-backward hook gathered them again
            graphs.load_params(ctx.params)
        if grad.data_ptr() != graphs.static_grad_out.data_ptr():
            graphs.static_grad_out.copy_(grad)
        graphs.bwd.replay()
        # the parameters' gradients leave the graph's memory: autograd may keep (accumulate
        # into) what it is given, and the next replay overwrites the graph's buffers
        grads = graphs.fresh_grads()
        if graphs.copy_params:  # one slot per parameter, None for the frozen ones
            spread: list = [None] * len(graphs.aliases)
            for slot, g in zip(graphs.grad_slots, grads, strict=True):
                spread[slot] = g
            grads = tuple(spread)
        return (None, graphs.static_grad_in, *grads)
