"""How a capture runs: on a side stream the protocol takes for the caller's, after eager warm-up
events, and (per-block graphs) one graph per block and pass, chained through static buffers.

Shared by the whole-step graph (:mod:`.step`) and the per-block graphs (:mod:`.blocks`):

- :func:`on_side_stream`: warm-up and capture run on a side stream (CUDA graphs want one),
  ordered after the caller's stream and aliased to it in the protocol's stream order, so the
  protocol sees one entrant, not two;
- :func:`require_warmup`: every graph replays only owners that registered and calibrated their
  first scale in an eager event, so at least one warm-up event runs first;
- :class:`CudaGraphBackend`: what a per-block capture asks of CUDA (graphs, a memory pool they
  share, the side stream, the generator's state), replaceable by a CPU stand-in in tests;
- :func:`capture_chain`: every block's forward graph in order, then every backward graph in
  reverse, block ``i``'s static input being block ``i-1``'s static output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..config import require_int
from ..errors import ConfigError
from ..protocol import QuantProtocol
from .fsdp_units import _unit_input

__all__ = [
    "CudaGraphBackend",
    "autocast_cache_off",
    "capture_backwards",
    "capture_chain",
    "capture_forward",
    "on_side_stream",
    "require_warmup",
]


def on_side_stream(side: torch.cuda.Stream, protocol: QuantProtocol | None, fn):
    """Run ``fn`` on the CUDA stream ``side`` (ordered after the caller's stream, and the
    caller's after it), which ``protocol`` treats as the caller's stream (one entrant, not two):
    warm-up and capture run there, as CUDA graphs want."""
    caller = torch.cuda.current_stream(side.device)
    order = None if protocol is None else protocol.stream_order
    side.wait_stream(caller)
    if order is not None:
        order.alias(side, caller)
    try:
        with torch.cuda.stream(side):
            return fn()
    finally:
        if order is not None:
            order.unalias(side)
        caller.wait_stream(side)


def require_warmup(warmup) -> None:
    """ConfigError unless ``warmup`` (eager events before the capture) is an integer >= 1."""
    require_int("warmup", warmup, 1, why="owners register and calibrate their first scale in eager events")


class CudaGraphBackend:
    """What a capture needs from CUDA: graphs, a memory pool shared by them, a side stream."""

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, graph, pool, side):
        # thread_local: a DataLoader's pin-memory thread may allocate pinned memory meanwhile
        return torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local")

    def side_stream(self, device: torch.device):
        if device.type != "cuda":  # (a CPU build of torch would raise from inside torch.cuda)
            raise ConfigError(
                f"CUDA graphs (GraphedBlocks, graph_decoder_layers) capture on a CUDA device; the blocks' input is "
                f"on {device.type!r}: move the model and its inputs to a GPU, or train without graphs"
            )
        return torch.cuda.Stream(device)

    def on_side(self, side, protocol: QuantProtocol | None, fn: Callable):
        return on_side_stream(side, protocol, fn)

    def rng_state(self, device: torch.device) -> torch.Tensor:
        """The device generator's state (seed and offset: host values, no device sync)."""
        return torch.cuda.get_rng_state(device)


def autocast_cache_off(device: str):
    """The caller's autocast, its weight cache off: a cast cached in one graph would be read by
    another."""
    return torch.autocast(
        device,
        dtype=torch.get_autocast_dtype(device),
        enabled=torch.is_autocast_enabled(device),
        cache_enabled=False,
    )


def capture_forward(g, inp: torch.Tensor, backend: CudaGraphBackend, pool, side, region: Callable) -> torch.Tensor:
    """Capture one block's forward graph (``region(block, input)``, the block read through its
    aliases) reading ``inp`` as its static input; returns the next block's static input (this
    one's static output, a leaf). Runs on the side stream, autocast's cache off."""
    if g.copy_params:  # the replay's input is FSDP2's cast of it: capture with that
        inp = _unit_input(g.block, inp)
    g.static_in = inp
    g.fwd = backend.new_graph()
    with backend.capture(g.fwd, pool, side):
        g.static_out = region(g.call_with_aliases, inp)
    return g.static_out.detach().requires_grad_(True)


def _layout(tensors: Sequence[torch.Tensor | None]) -> tuple:
    """What a buffer must match to take ``tensors`` by copy: each one's shape, strides, dtype
    and device (None kept in its place)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _into(target: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Copy ``grads`` into ``target`` (the same layout), one batched copy."""
    live = [(t, g) for t, g in zip(target, grads, strict=True) if g is not None]
    if live:
        torch._foreach_copy_([t for t, _ in live], [g for _, g in live])


def capture_backwards(graphs: Sequence, backend: CudaGraphBackend, pool, side) -> None:
    """Capture each block's backward graph (the recompute inside) in reverse, chaining the
    input gradients into the previous block's output gradient, after :func:`capture_forward`
    captured every forward. Runs on the side stream, autocast's cache off.

    The static gradients are shared where the blocks' layouts agree (a transformer stack's
    do): a replay's parameter gradients are copied out (``fresh_grads``) before the next
    block's replay, and its input gradient is read by the previous block's, so every block
    writes its parameters' gradients into the first captured block's buffers, and the input
    gradients alternate between two buffers (block ``i`` reads block ``i+1``'s and writes the
    one block ``i+2`` wrote, read already). Each buffer kept per block instead held one more
    copy of the stack's parameter gradients in the graphs' memory (a Llama 1B's 16 layers:
    3.6 GiB in float32) and a hidden state per block. A block whose layout differs keeps its own.

    Raises:
        ConfigError: a block's output does not depend on its input (not a chain of blocks).
    """
    grad = torch.empty_like(graphs[-1].static_out)
    param_buffers: dict[tuple, tuple] = {}  # a layout -> the gradients of the first block captured with it
    input_buffers: list[torch.Tensor] = []  # each captured block's input gradient, in capture order
    for g in reversed(graphs):
        aliases = [a for a in g.aliases.values() if a.requires_grad]
        wanted = ([g.static_in] if g.static_in.requires_grad else []) + aliases
        g.static_grad_out = grad
        g.bwd = backend.new_graph()
        with backend.capture(g.bwd, pool, side):
            grads = torch.autograd.grad(g.static_out, wanted, grad_outputs=grad, allow_unused=True)
            grad_in = None
            if g.static_in.requires_grad:
                grad_in, grads = grads[0], grads[1:]
            own = tuple(grads)
            shared = param_buffers.setdefault(_layout(own), own)
            if shared is not own:
                _into(shared, own)
            # the input gradient of the block captured two before: read by the block between
            spare = input_buffers[-2] if len(input_buffers) >= 2 else None
            if grad_in is not None and spare is not None and _layout([spare]) == _layout([grad_in]):
                spare.copy_(grad_in)
                grad_in = spare
        del grads, own  # a copied block's own gradients: graph memory a later capture may reuse
        g.static_grad_in = grad_in
        g.static_grad_params = shared
        g._grad_layout = None  # fresh_grads works its buffer out anew for these
        g.static_out = g.static_out.detach()  # the captured autograd graph is not needed again
        grad = g.static_grad_in
        if grad is None and g is not graphs[0]:
            raise ConfigError(
                "GraphedBlocks: a block's output does not depend on its input, so the stack is not a chain of blocks"
            )
        if grad is not None:
            input_buffers.append(grad)


def capture_chain(
    graphs: Sequence,
    x: torch.Tensor,
    backend: CudaGraphBackend,
    pool,
    side,
    region: Callable[[Callable, torch.Tensor], torch.Tensor],
) -> None:
    """Capture each block's forward graph in order (:func:`capture_forward`), then each
    block's backward graph in reverse (:func:`capture_backwards`), into ``graphs`` (one
    :class:`~.replay._BlockGraphs` per block): the forwards chain their static outputs into the
    next block's static input, the backwards their input gradients into the previous block's
    output gradient. Runs on the side stream, inside the caller's event.

    Raises:
        ConfigError: a block's output does not depend on its input (not a chain of blocks).
    """
    with autocast_cache_off(x.device.type):
        inp = x.detach().clone().requires_grad_(x.requires_grad)
        for g in graphs:
            inp = capture_forward(g, inp, backend, pool, side, region)
        capture_backwards(graphs, backend, pool, side)
