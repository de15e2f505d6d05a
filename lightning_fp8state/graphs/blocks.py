"""GraphedBlocks: each checkpointed block of a stack replayed from CUDA graphs, the strategy's hooks eager.

A whole-step graph (:class:`~.step.GraphedStep`) cannot hold a data-parallel strategy's backward:
DDP's, DeepSpeed's and FSDP2's gradient hooks, bucketing and reduction run Python while the
backward runs. Per-block graphs can (Megatron-LM's per-layer graphs and Transformer Engine's
``make_graphed_callables`` do the same with DDP): each block's forward is one graph, its
backward (the checkpoint's recompute included) another, and an autograd Function replays them,
returning the parameters' gradients to autograd, so the strategy's hooks fire eagerly between
the blocks' backwards, exactly as without graphs.

The protocol stays exact on replay because everything it decides per call is decided once, at
the capture, by the usual rules, and repeated by the host per event without Python per call:

- the capture runs in a real event: every block's forward and backward (recompute included)
  are captured in order, with chained static buffers (block ``i``'s input is block ``i-1``'s
  output, its output gradient block ``i+1``'s input gradient), while the protocol registers
  the calls, stashes their snapshots, and serves the read-only recompute; the ledger's
  records of those calls, the owners they observed and the frozen scales they read form the
  template (``QuantProtocol.graph_template``);
- each later event replays the template on the host first (``replay_template``: the owners
  observed, the ledger's counts, the event's scales frozen into the copy the graphs read),
  then the graphs: the same recordings into the same pending slots, the same read-only
  recompute. Commits stay eager and batched (``commit_forward`` / the event's end), so the
  amax reduction across ranks runs where it always does, and each owner advances once;
- checked on the host before each replay, with no device sync: the bank not reallocated, no
  auditor attached, one call per event, inputs of the captured shape and dtype.

Constraints: the blocks run in sequence, each taking the previous one's output (a transformer
stack); the blocks draw no random numbers (the recompute inside a graph cannot replay the
forward's random stream: checked at the warm-up); the recompute is torch's non-reentrant
checkpoint without RNG state (DeepSpeed's engine saves RNG state, which a capture forbids);
gradients of the blocks' parameters are returned (copied out of the graph) to autograd, which
accumulates them, so gradient accumulation works as without graphs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import require_bool
from ..errors import ConfigError, StateTransitionError
from ..protocol import GraphTemplate, QuantProtocol
from ..recompute import checkpoint
from .capture import CudaGraphBackend, capture_chain, require_warmup
from .fsdp_units import _refuse_nested_units, _warn_unit_hooks, call_through_hooks, fsdp_unit, unit_forward
from .layer_pass import LayerPass, open_layer_pass
from .replay import _BlockGraphs, _BlockReplay, run_block
from .side_inputs import SideInputs, argument_names

__all__ = ["GraphedBlocks"]


def _drop_if_stale(runner: GraphedBlocks, protocol: QuantProtocol | None) -> None:
    """Drop ``runner``'s graphs when ``QuantConfig.fallback`` moved a layer since they were
    captured: they hold its FP8 calls; the pass that finds it captures again (once per move)."""
    monitor = None if protocol is None else protocol.fallback
    if runner.graphs is not None and monitor is not None and monitor.version != runner._fallback_version:
        runner.graphs = None
        runner._input_spec = None
        runner.recaptures += 1


class GraphedBlocks:
    """Run a stack of blocks (``x = block(x)`` for each, checkpointed) from per-block CUDA graphs.

    Example::

        model.blocks_runner = f8s.GraphedBlocks(model.blocks, warmup=3)
        # in the model's forward, while training:  x = self.blocks_runner(x)
        # under DDP / DeepSpeed / FSDP2, inside the events the Lightning callback opens
        # blocks with side inputs (every block gets the same):  x = runner(x, cos, sin, mask=mask)
        # a loop that calls each block itself:  x = runner.call_block(i, x, mask=mask)

    Side inputs: the first positional tensor is the chained hidden state; every other argument
    is a constant of the step's shape (see :mod:`.side_inputs`): tensors become static inputs
    of the graphs, copied in before each replay; plain values must not change; tensors that
    require grad are refused. A block may return a tuple whose first element is the hidden
    state and whose others are None. An FSDP2 unit gets them as its ``MixedPrecisionPolicy``
    casts them: the whole-stack capture casts the static buffers inside the graphs, and a
    per-call pass runs inside the unit's call, after its hooks (see :mod:`.layer_pass`).

    Args:
        blocks: the blocks, in the order they run; each takes the previous one's output.
        warmup: training calls run eagerly before the capture (at least 1): owners register
            and calibrate their first scale there, and the side stream's libraries warm up.
        checkpoint: activation-checkpoint every block (torch's non-reentrant checkpoint through
            :func:`lightning_fp8state.checkpoint`, no RNG state); False runs them plainly.
        backend: what captures and replays (``CudaGraphBackend`` by default); a stand-in with
            its interface can run the same path on the CPU, for tests.
        forwards: what runs each block (its module call by default): a layer whose own call
            routes to this runner (:func:`~.hf_layers.graph_decoder_layers`) is run by its
            original forward.

    Raises:
        ConfigError: no blocks, ``warmup < 1``, blocks that draw random numbers (at the
            warm-up), an auditor attached to the blocks' state, inputs of another shape, side
            inputs that changed shape or value, require grad or are not tensors or plain values.
        StateTransitionError: a training call outside an event, a second call in one event,
            the state bank reallocated after the capture.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        *,
        warmup: int = 3,
        checkpoint: bool = True,
        backend=None,
        forwards: Sequence[Callable] | None = None,
    ) -> None:
        self.blocks = list(blocks)
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise ConfigError(f"blocks: expected a non-empty sequence of nn.Module, got {blocks!r}")
        self.forwards = [None] * len(self.blocks) if forwards is None else list(forwards)
        if len(self.forwards) != len(self.blocks) or not all(f is None or callable(f) for f in self.forwards):
            raise ConfigError(f"forwards: expected one callable (or None) per block, got {forwards!r}")
        require_warmup(warmup)
        require_bool("checkpoint", checkpoint)
        self.warmup = warmup
        self.checkpoint = checkpoint
        self.backend = backend
        self.eager_calls = 0
        self.replays = 0
        self.recaptures = 0  # captures after the first (a layer moved by QuantConfig.fallback)
        self._fallback_version: int | None = None  # the fallback's moves the graphs hold
        self.graphs: list[_BlockGraphs] | None = None
        self._template: GraphTemplate | None = None
        self._side = None
        self._last_event = None
        self._captured_config = None
        self._captured_protocol: QuantProtocol | None = None
        self._input_spec: tuple | None = None
        self._side_spec: tuple = ()  # the whole-stack call's side inputs, as captured
        self._passes = 0  # training calls of the stack so far (a static side input's fill is per pass)
        self._layer_pass: LayerPass | None = None  # call_block's pass in progress
        # per block the length of the tuple it returns (hidden state and Nones; absent: a tensor),
        # seen in the warm-up: call_block returns the same
        self._extra_outputs: dict[int, int] = {}

    # -- what the blocks belong to -----------------------------------------------------
    @property
    def protocol(self) -> QuantProtocol | None:
        """The protocol of the blocks' converted layers (None: nothing converted, a bf16 control).
        Looked up until the capture, then fixed: the graphs hold that protocol's tensors, and a
        converted layer is never bound to another state (``convert`` skips it)."""
        if self.graphs is not None:
            return self._captured_protocol
        for block in self.blocks:
            for module in block.modules():
                protocol = getattr(module, "protocol", None)
                if isinstance(protocol, QuantProtocol):
                    return protocol
        return None

    def _region(self, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not self.checkpoint:
            return block(x)
        # torch's engine, no RNG state: a capture forbids reading the generator's state
        return checkpoint(block, x, engine="torch", use_reentrant=False, preserve_rng_state=False)

    # -- the checks before each call -----------------------------------------------------
    def _check_call(self, protocol: QuantProtocol | None, x: torch.Tensor) -> None:
        if protocol is not None and protocol.auditors:
            raise ConfigError(
                "GraphedBlocks: an auditor is attached to the blocks' state; the audit compares every call in "
                "Python, which a CUDA-graph replay does not run. Audit without graphs"
            )
        event = None if protocol is None else protocol.event
        if protocol is not None and event is None:
            raise StateTransitionError(
                "GraphedBlocks ran a training forward outside a logical event: wrap forward and backward in "
                "`with state.step(step, microbatch)` (the Lightning callback does this)"
            )
        if event is not None and event == self._last_event:
            raise StateTransitionError(
                f"GraphedBlocks ran twice in event {event}: the capture holds one run of the stack per event; "
                "run it once per forward/backward, or without graphs"
            )
        self._last_event = event
        if self._input_spec is not None and (tuple(x.shape), x.dtype, x.device) != self._input_spec:
            shape, dtype, device = self._input_spec
            raise ConfigError(
                f"GraphedBlocks: expected an input of shape {shape}, {dtype} on {device} (the captured one), got "
                f"{tuple(x.shape)}, {x.dtype} on {x.device}: keep batch shapes fixed (drop_last=True)"
            )

    def _check_replayable(self, protocol: QuantProtocol | None) -> None:
        if protocol is not None and protocol.config is not self._captured_config:
            raise StateTransitionError("GraphedBlocks: the state's config changed after the capture: capture again")

    # -- running -------------------------------------------------------------------------
    def _side_inputs(self, i: int, args: tuple, kwargs: dict, forward: Callable | None = None) -> SideInputs:
        """Block ``i``'s side inputs, named after ``forward``'s parameters (what runs the block;
        by default its own forward: under call_through_hooks that is a stand-in, not named)."""
        forward = forward or self.forwards[i] or self.blocks[i].forward
        return SideInputs(args, kwargs, argument_names(forward, len(args)))

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Run the stack on ``x`` (every block given the side inputs ``args``/``kwargs`` too):
        eagerly without gradients (evaluation) and for the warm-up, captured at the next
        training call, replayed after that."""
        if not torch.is_grad_enabled():
            for block, forward in zip(self.blocks, self.forwards, strict=True):
                x = run_block(block, forward, args, kwargs, x=x)
            return x
        side = self._side_inputs(0, args, kwargs)
        protocol = self.protocol
        _drop_if_stale(self, protocol)
        self._check_call(protocol, x)
        if self.graphs is not None:
            side.check_against(self._side_spec, "the blocks")
        self._open_pass(x)
        if self.graphs is None:
            if self.eager_calls < self.warmup:
                self.eager_calls += 1
                return self._eager(x, protocol, side)
            return self._capture(x, protocol, side)
        self._check_replayable(protocol)
        if protocol is not None:
            protocol.replay_template(self._template)
        for g in self.graphs:
            side.load(g.sides, self._passes)
        return self._replay(x)

    def _eager(self, x: torch.Tensor, protocol: QuantProtocol | None, side: SideInputs) -> torch.Tensor:
        def run():
            y = x
            for block, forward in zip(self.blocks, self.forwards, strict=True):
                y = self._region(functools.partial(run_block, block, forward, side.args, side.kwargs, None, 0), y)
            return y

        return self._on_side_without_rng(x, protocol, run)

    def _on_side_without_rng(self, x: torch.Tensor, protocol: QuantProtocol | None, run: Callable):
        """``run()`` on the side stream; ConfigError if it drew random numbers."""
        before = self.backend.rng_state(x.device)
        out = self.backend.on_side(self._side, protocol, run)
        if not torch.equal(before, self.backend.rng_state(x.device)):
            raise ConfigError(
                "GraphedBlocks: the blocks draw random numbers (dropout?): the recompute inside a CUDA graph "
                "cannot replay the forward's random stream. Set their dropout to 0, or train without graphs"
            )
        return out

    def _capture(self, x: torch.Tensor, protocol: QuantProtocol | None, side: SideInputs) -> torch.Tensor:
        self._require_calibrated(protocol)
        if protocol is not None and protocol.recipe.quantized:
            protocol.freeze_event(x.device)  # eagerly, outside the graphs' memory: they read it
        version = None if protocol is None else protocol.bank.version
        before = None if protocol is None else protocol.graph_template()  # what eager calls did first
        pool = self.backend.new_pool()
        units = [block for block in self.blocks if fsdp_unit(block)]
        _refuse_nested_units(self.blocks)
        _warn_unit_hooks(units)
        # gathered for the capture, which reads copies of them, and left gathered: the event's
        # run after the capture finds them so (FSDP2's pre-forward does not gather twice, and an
        # FP8 gather happens once per event)
        gathered = []
        try:
            for block in units:
                block.unshard()
                gathered.append(block)
            self._capture_gathered(x, protocol, units, version, before, pool, side)
        except BaseException:  # a failed capture leaves no unit gathered (the first error is raised)
            for block in gathered:
                with contextlib.suppress(Exception):
                    block.reshard()
            raise
        return self._replay(x)  # the capture recorded this event's work; run it

    def _require_calibrated(self, protocol: QuantProtocol | None) -> None:
        if protocol is not None and protocol.bank.fresh:
            first = protocol.bank.owners[min(protocol.bank.fresh)]
            raise StateTransitionError(
                f"GraphedBlocks: {len(protocol.bank.fresh)} owner(s) have no delayed scale yet (e.g. {first}): "
                "their first event calibrates on the host's decision, which a replay cannot repeat; raise warmup"
            )

    def _capture_gathered(self, x, protocol, units, version, before, pool, side_inputs: SideInputs) -> None:
        """Capture every block's two graphs (FSDP2 units gathered by the caller)."""
        backend = self.backend
        shared: dict = {}  # the units' static parameters, one set per layout
        graphs = [
            _BlockGraphs(block, copy_params=block in units, shared=shared, forward=forward)
            for block, forward in zip(self.blocks, self.forwards, strict=True)
        ]
        statics: dict = {}  # one buffer per side-input tensor, shared by the blocks
        for g in graphs:
            g.sides, g.side_args, g.side_kwargs = side_inputs.static(statics, self._passes)
        side, region = self._side, self._region
        backend.on_side(side, protocol, lambda: capture_chain(graphs, x, backend, pool, side, region))
        self._side_spec = side_inputs.spec()
        self._finish_capture(protocol, version, before, graphs, x)

    def _finish_capture(self, protocol, version, before, graphs, x) -> None:
        """The template of what the captured calls did on the host; the graphs in place."""
        if protocol is not None:
            if protocol.bank.version != version:
                raise StateTransitionError(
                    "GraphedBlocks: an owner registered during the capture (the bank was reallocated); raise warmup "
                    "so that every layer runs in an eager event first"
                )
            self._template = protocol.graph_template(since=before)
            self._captured_config = protocol.config
            self._fallback_version = None if protocol.fallback is None else protocol.fallback.version
        self._captured_protocol = protocol
        self.graphs = graphs
        self._input_spec = (tuple(x.shape), x.dtype, x.device)

    def _replay(self, x: torch.Tensor) -> torch.Tensor:
        for g in self.graphs:
            if g.copy_params:
                x = g.run_unit(x)
            else:
                g.check_addresses()
                x = _BlockReplay.apply(g, x, *g.params)
        self.replays += 1
        return x

    # -- one block per call (a loop that calls each block itself) ------------------------
    def call_block(self, i: int, x: torch.Tensor, *args, **kwargs):
        """Run block ``i`` on ``x`` and its side inputs, as one step of a pass over the stack
        that the caller drives (a Hugging Face model's loop over its decoder layers): block 0
        opens the pass (the event's checks, warm-up, capture or replay decided there), the
        blocks follow in order, each once. Returns what the block returns (a tensor, or a
        tuple of the hidden state and Nones). An FSDP2 unit is run through its own call (its
        hooks gather the parameters and cast the inputs), then as :meth:`call_inside`.

        The capture's pass captures each block's forward graph at its call and, at the last
        block's, every backward graph in reverse (see :mod:`.layer_pass`). Until the pass ends
        the returned hidden states are the graphs' static buffers, so block ``i`` must be given
        block ``i-1``'s output as is.

        Raises:
            ConfigError: as :class:`GraphedBlocks`; a block's input that is not the previous
                block's output in the capture's pass; FSDP2 units with ``checkpoint=False``.
            StateTransitionError: blocks called out of order, or the checks of block 0.
        """
        block = self.blocks[i]
        if fsdp_unit(block):
            return call_through_hooks(block, functools.partial(self.call_inside, i), x, *args, **kwargs)
        return self.call_inside(i, x, *args, **kwargs)

    def call_inside(self, i: int, x: torch.Tensor, *args, **kwargs):
        """:meth:`call_block` from inside block ``i``'s own call, its module hooks run (an FSDP2
        unit's parameters gathered, its inputs cast): a layer whose forward routes here
        (:func:`~.hf_layers.graph_decoder_layers`)."""
        block = self.blocks[i]
        forward = self.forwards[i] or (unit_forward(block) if fsdp_unit(block) else None)
        if not torch.is_grad_enabled():
            return (block if forward is None else forward)(x, *args, **kwargs)
        side = self._side_inputs(i, args, kwargs, forward)
        p = self._begin_layer_pass(x) if i == 0 else self._layer_pass
        if p is None or p.next != i:
            expected = 0 if p is None else p.next
            self._layer_pass = None
            raise StateTransitionError(
                f"GraphedBlocks: block {i} was called, block {expected} was expected: call_block runs the blocks "
                "in order, each once per pass, starting from block 0"
            )
        out = None
        try:
            out = p.run(i, x, side, forward)
        finally:
            if out is None:  # a refusal mid-pass: the pass is over (a capture's partial graphs dropped)
                self._layer_pass = None
        p.next, p.out = i + 1, out
        if i == len(self.blocks) - 1:
            self._layer_pass = None
            if p.mode != "eager":  # the capture's pass ran its graphs too (as the whole-stack call counts)
                self.replays += 1
        extra = self._extra_outputs.get(i, 0)  # a tuple's Nones after the hidden state, as the block returned
        return out if not extra else (out,) + (None,) * (extra - 1)

    def _eager_layer(self, i: int, x: torch.Tensor, side: SideInputs, forward, protocol) -> torch.Tensor:
        """A warm-up pass's block ``i``: checkpointed, on the side stream, without random numbers."""
        call = functools.partial(run_block, self.blocks[i], forward, side.args, side.kwargs, self._extra_outputs, i)
        return self._on_side_without_rng(x, protocol, lambda: self._region(call, x))

    def _open_pass(self, x: torch.Tensor) -> None:
        """Count a training pass (whole stack or layer by layer) and make what a capture needs:
        the graph backend and its side stream on ``x``'s device."""
        self._passes += 1
        self._layer_pass = None
        if self.backend is None:
            self.backend = CudaGraphBackend()
        if self._side is None:
            self._side = self.backend.side_stream(x.device)

    def _begin_layer_pass(self, x: torch.Tensor) -> LayerPass:
        protocol = self.protocol
        _drop_if_stale(self, protocol)
        self._check_call(protocol, x)
        self._open_pass(x)
        self._layer_pass = open_layer_pass(self, x, protocol)
        return self._layer_pass
