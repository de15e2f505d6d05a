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
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..config import require_bool
from ..errors import ConfigError, StateTransitionError
from ..protocol import GraphTemplate, QuantProtocol
from ..recompute import checkpoint
from .capture import CudaGraphBackend, capture_chain, require_warmup
from .fsdp_units import _refuse_nested_units, _warn_unit_hooks, fsdp_unit
from .replay import _BlockGraphs, _BlockReplay

__all__ = ["GraphedBlocks"]


class GraphedBlocks:
    """Run a stack of blocks (``x = block(x)`` for each, checkpointed) from per-block CUDA graphs.

    Example::

        model.blocks_runner = f8s.GraphedBlocks(model.blocks, warmup=3)
        # in the model's forward, while training:  x = self.blocks_runner(x)
        # under DDP / DeepSpeed, inside the events the Lightning callback opens

    Args:
        blocks: the blocks, in the order they run; each takes the previous one's output.
        warmup: training calls run eagerly before the capture (at least 1): owners register
            and calibrate their first scale there, and the side stream's libraries warm up.
        checkpoint: activation-checkpoint every block (torch's non-reentrant checkpoint through
            :func:`lightning_fp8state.checkpoint`, no RNG state); False runs them plainly.
        backend: what captures and replays (``CudaGraphBackend`` by default); a stand-in with
            its interface can run the same path on the CPU, for tests.

    Raises:
        ConfigError: no blocks, ``warmup < 1``, blocks that draw random numbers (at the
            warm-up), an auditor attached to the blocks' state, inputs of another shape.
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
    ) -> None:
        self.blocks = list(blocks)
        if not self.blocks or not all(isinstance(b, nn.Module) for b in self.blocks):
            raise ConfigError(f"blocks: expected a non-empty sequence of nn.Module, got {blocks!r}")
        require_warmup(warmup)
        require_bool("checkpoint", checkpoint)
        self.warmup = warmup
        self.checkpoint = checkpoint
        self.backend = backend
        self.eager_calls = 0
        self.replays = 0
        self.graphs: list[_BlockGraphs] | None = None
        self._template: GraphTemplate | None = None
        self._side = None
        self._last_event = None
        self._captured_config = None
        self._captured_protocol: QuantProtocol | None = None
        self._input_spec: tuple | None = None

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
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Run the stack on ``x``: eagerly without gradients (evaluation) and for the warm-up,
        captured at the next training call, replayed after that."""
        if not torch.is_grad_enabled():
            for block in self.blocks:
                x = block(x)
            return x
        protocol = self.protocol
        self._check_call(protocol, x)
        if self.backend is None:
            self.backend = CudaGraphBackend()
        if self._side is None:
            self._side = self.backend.side_stream(x.device)
        if self.graphs is None:
            if self.eager_calls < self.warmup:
                self.eager_calls += 1
                return self._eager(x, protocol)
            return self._capture(x, protocol)
        self._check_replayable(protocol)
        if protocol is not None:
            protocol.replay_template(self._template)
        return self._replay(x)

    def _eager(self, x: torch.Tensor, protocol: QuantProtocol | None) -> torch.Tensor:
        def run():
            y = x
            for block in self.blocks:
                y = self._region(block, y)
            return y

        before = self.backend.rng_state(x.device)
        out = self.backend.on_side(self._side, protocol, run)
        if not torch.equal(before, self.backend.rng_state(x.device)):
            raise ConfigError(
                "GraphedBlocks: the blocks draw random numbers (dropout?): the recompute inside a CUDA graph "
                "cannot replay the forward's random stream. Set their dropout to 0, or train without graphs"
            )
        return out

    def _capture(self, x: torch.Tensor, protocol: QuantProtocol | None) -> torch.Tensor:
        if protocol is not None and protocol.bank.fresh:
            first = protocol.bank.owners[min(protocol.bank.fresh)]
            raise StateTransitionError(
                f"GraphedBlocks: {len(protocol.bank.fresh)} owner(s) have no delayed scale yet (e.g. {first}): "
                "their first event calibrates on the host's decision, which a replay cannot repeat; raise warmup"
            )
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
            self._capture_gathered(x, protocol, units, version, before, pool)
        except BaseException:  # a failed capture leaves no unit gathered (the first error is raised)
            for block in gathered:
                with contextlib.suppress(Exception):
                    block.reshard()
            raise
        return self._replay(x)  # the capture recorded this event's work; run it

    def _capture_gathered(self, x, protocol, units, version, before, pool) -> None:
        """Capture every block's two graphs (FSDP2 units gathered by the caller)."""
        backend = self.backend
        shared: dict = {}  # the units' static parameters, one set per layout
        graphs = [_BlockGraphs(block, copy_params=block in units, shared=shared) for block in self.blocks]
        side, region = self._side, self._region
        backend.on_side(side, protocol, lambda: capture_chain(graphs, x, backend, pool, side, region))
        if protocol is not None:
            if protocol.bank.version != version:
                raise StateTransitionError(
                    "GraphedBlocks: an owner registered during the capture (the bank was reallocated); raise warmup "
                    "so that every layer runs in an eager event first"
                )
            self._template = protocol.graph_template(since=before)
            self._captured_config = protocol.config
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
