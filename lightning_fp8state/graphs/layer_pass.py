"""One pass of :meth:`GraphedBlocks.call_block` over the stack: a loop that calls each block itself
(a Hugging Face model's loop over its decoder layers) drives the blocks one call at a time.

Block 0 opens the pass (:func:`open_layer_pass`), which decides once how every block of it runs:

- ``eager`` (the warm-up): each block checkpointed, on the side stream, without random numbers;
- ``capture``: each block's forward graph at its call and, at the last block's, every backward
  graph in reverse: the order and the memory pool of the whole-stack capture. The forwards then
  run from their graphs: all at the last block (deferred), because a replay before the
  backwards are captured writes buffers the captured forward's autograd graph may hold;
  except with FSDP2 units, where each forward runs at its own call (at once): FSDP2 frees a
  unit's gathered parameters after its call, and the graphs read static copies of them that
  blocks of one layout share, refilled before each replay. A replay before the backwards'
  capture is safe there because every block is checkpointed (its activations not saved), which
  those passes require;
- ``replay``: each block from its graphs, the side inputs copied in.

An FSDP2 unit runs from inside its own call (its hooks gathered the parameters and cast the
inputs, and hook the backward): the capture reads the gathered parameters into the static
copies and captures with the inputs as cast, and every replay hands the autograd Function the
parameters as gathered now, so FSDP2 reduce-scatters the gradients it returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import ConfigError
from .capture import autocast_cache_off, capture_backwards, capture_forward
from .fsdp_units import _refuse_nested_units, fsdp_unit
from .replay import _BlockGraphs, _BlockReplay
from .side_inputs import SideInputs

__all__: list[str] = []  # internal to GraphedBlocks


def _chained(x: torch.Tensor, previous: torch.Tensor) -> bool:
    """Whether ``x`` is the previous block's output: the tensor itself, or a view of all of it
    (FSDP2's pre-forward hands a unit an autograd view of each input that requires grad)."""
    if x is previous:
        return True
    return (
        x.data_ptr() == previous.data_ptr()
        and x.shape == previous.shape
        and x.stride() == previous.stride()
        and x.dtype == previous.dtype
    )


class LayerPass:
    """One pass of ``call_block`` over the blocks: how it runs, the block it expects next, the
    last block's output, and (a capture) what the capture builds until its last block."""

    def __init__(
        self, runner, mode: str, protocol
    ) -> None:  # runner: the GraphedBlocks (not imported: it imports this)
        self.runner, self.mode, self.protocol = runner, mode, protocol
        self.next, self.out = 0, None
        n = len(runner.blocks)
        self.graphs: list[_BlockGraphs | None] = [None] * n
        self.statics: dict = {}  # one buffer per side-input tensor, shared by the blocks
        self.shared: dict = {}  # the units' static parameters, one set per layout
        self.version = self.before = self.pool = None
        # each forward replayed at its own block's call (FSDP2 units), not after the last capture
        self.immediate = any(fsdp_unit(block) for block in runner.blocks)

    def run(self, i: int, x: torch.Tensor, side: SideInputs, forward: Callable | None):
        """Block ``i``'s hidden state for ``x`` (``forward``: what runs the block, the module's
        call by default), as this pass runs it."""
        if self.mode == "eager":
            return self.runner._eager_layer(i, x, side, forward, self.protocol)
        if self.mode == "capture":
            return self._capture(i, x, side, forward)
        return self._replay(i, x, side)

    def _capture(self, i: int, x: torch.Tensor, side: SideInputs, forward: Callable | None) -> torch.Tensor:
        runner, graphs, block = self.runner, self.graphs, self.runner.blocks[i]
        if i > 0 and not _chained(x, self.out):
            raise ConfigError(
                f"GraphedBlocks: block {i}'s input is not block {i - 1}'s output: in the capture's pass the blocks "
                "must be chained directly (nothing may read or change the hidden state between them; an FSDP2 "
                "unit whose MixedPrecisionPolicy casts the hidden state to another dtype counts as a change)"
            )
        unit = fsdp_unit(block)  # gathered now, inside its call: its static copies are filled from these
        g = graphs[i] = _BlockGraphs(block, copy_params=unit, shared=self.shared, forward=forward)
        if i == 0:
            inp = x.detach().clone().requires_grad_(x.requires_grad)
        else:
            inp = graphs[i - 1].static_out.detach().requires_grad_(True)
        g.sides, g.side_args, g.side_kwargs = side.static(self.statics, runner._passes)
        g.side_spec = side.spec()

        def capture():
            with autocast_cache_off(x.device.type):
                capture_forward(g, inp, runner.backend, self.pool, runner._side, runner._region)
                if i == len(graphs) - 1:
                    capture_backwards(graphs, runner.backend, self.pool, runner._side)

        runner.backend.on_side(runner._side, self.protocol, capture)
        g.defer_forward = not self.immediate
        g.input_filled = self.immediate and i == 0
        out = _BlockReplay.apply(g, x, *g.live_params())
        if i == len(graphs) - 1:
            runner._finish_capture(self.protocol, self.version, self.before, graphs, graphs[0].static_in)
            if not self.immediate:  # every block captured: this pass's forwards run now, in order
                for h in graphs:
                    h.fwd.replay()
        return out

    def _replay(self, i: int, x: torch.Tensor, side: SideInputs) -> torch.Tensor:
        runner = self.runner
        g = runner.graphs[i]
        spec = (tuple(g.static_in.shape), g.static_in.dtype, g.static_in.device)
        if (tuple(x.shape), x.dtype, x.device) != spec:
            raise ConfigError(
                f"GraphedBlocks: dynamic shapes are not captured: block {i}'s input changed from {spec[0]}, "
                f"{spec[1]} on {spec[2]} to {tuple(x.shape)}, {x.dtype} on {x.device}: keep batch shapes fixed "
                "(drop_last=True)"
            )
        side.check_against(g.side_spec, f"block {i}")
        side.load(g.sides, runner._passes)
        g.check_addresses()
        return _BlockReplay.apply(g, x, *g.live_params())


def open_layer_pass(runner, x: torch.Tensor, protocol) -> LayerPass:  # runner: the GraphedBlocks
    """The pass block 0's call opens, after the event's checks: eager (warm-up), capture or replay.

    Raises:
        ConfigError: as :class:`GraphedBlocks`; FSDP2 units without ``checkpoint`` (a capture's
            pass replays each unit's forward before the backwards are captured), or an FSDP2
            unit inside a block.
    """
    if runner.graphs is None and runner.eager_calls < runner.warmup:
        runner.eager_calls += 1
        return LayerPass(runner, "eager", protocol)
    if runner.graphs is not None:
        runner._check_replayable(protocol)
        if protocol is not None:
            protocol.replay_template(runner._template)
        return LayerPass(runner, "replay", protocol)
    p = LayerPass(runner, "capture", protocol)
    _refuse_nested_units(runner.blocks)
    if p.immediate and not runner.checkpoint:
        raise ConfigError(
            "GraphedBlocks(checkpoint=False) is not allowed with FSDP2 units called block by block: expected "
            "checkpoint=True (the capture's pass replays each unit's forward at its call, before the backward "
            "graphs are captured, which only checkpointed blocks allow), or call the whole stack (runner(x))"
        )
    runner._require_calibrated(protocol)
    if protocol is not None and protocol.recipe.quantized:
        protocol.freeze_event(x.device)  # eagerly, outside the graphs' memory: they read it
    p.version = None if protocol is None else protocol.bank.version
    p.before = None if protocol is None else protocol.graph_template()
    p.pool = runner.backend.new_pool()
    return p
