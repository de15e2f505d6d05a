"""GraphedBlocks: each checkpointed block of a stack replayed from CUDA graphs, the strategy's hooks eager.

A whole-step graph (``graphs.GraphedStep``) cannot hold a data-parallel strategy's backward:
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
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .config import require_bool
from .errors import ConfigError, StateTransitionError
from .graphs import on_side_stream, require_warmup
from .nn.fsdp import Fp8GatheredWeight
from .protocol import GraphTemplate, QuantProtocol
from .recompute import checkpoint

__all__ = ["CudaGraphBackend", "GraphedBlocks"]


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
        return torch.cuda.Stream(device)

    def on_side(self, side, protocol: QuantProtocol | None, fn: Callable):
        return on_side_stream(side, protocol, fn)

    def rng_state(self, device: torch.device) -> torch.Tensor:
        """The device generator's state (seed and offset: host values, no device sync)."""
        return torch.cuda.get_rng_state(device)


def fsdp_unit(block: nn.Module) -> bool:
    """Whether ``block`` is an FSDP2 unit (``fully_shard``): its parameters are gathered by its
    own hooks into memory that is freed after use and allocated again by the next gather."""
    try:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(block, FSDPModule)


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


class _BlockGraphs:
    """One block's two graphs and their static buffers.

    ``copy_params`` (an FSDP2 unit, gathered when this is built): the graphs read static copies
    of the gathered parameters, refilled from the live ones before each replay, because FSDP2
    frees the gathered memory after each use and allocates it again (at another address) at the
    next gather. Without it the graphs read the parameters' own memory through aliases."""

    def __init__(self, block: nn.Module, copy_params: bool = False, shared: dict | None = None) -> None:
        self.block = block
        self.copy_params = copy_params
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
        # (the parameters themselves, listed once: named_parameters() walks the submodules, ten
        # times the cost of the check on a GPT block)
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
        if self.copy_params:
            # the unit's own forward, past FSDP2's hooks (they would gather inside the capture)
            with torch.nn.utils.stateless._reparametrize_module(self.block, self.aliases, tie_weights=True):
                return type(self.block).forward(self.block, x)
        return torch.func.functional_call(self.block, self.aliases, (x,))

    def load_params(self, live: Sequence[torch.Tensor]) -> None:
        """Copy the live (gathered) parameters into the graphs' static ones. An FP8-gathered
        weight: its codes, and its snapshot's scale, descale (and amax) into the captured
        snapshot's tensors, which the graphs read (a delayed scale's are views of the event's
        frozen copy, refilled by the template already: the same values; a stateless recipe's are
        the full weight's, derived anew every event)."""
        # one batched copy per dtype for the block, not a launch per tensor: torch's foreach
        # copy takes its one-kernel route only when every source shares a dtype, and walks a
        # mixed list (FP8 codes as uint8 beside float32 scales and biases) one copy_ at a time
        # (0.23 ms a call against 0.04 for an all-float32 block, measured on the H200)
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
        one allocation and one batched copy for the block, where a ``clone()`` per gradient cost
        a launch and some microseconds of host time each (12 a GPT block, ~300 a step at 350M).
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

    def run_unit(self, x: torch.Tensor) -> torch.Tensor:
        """The replayed block, called through the FSDP2 unit's ``__call__``: its pre-forward hook
        gathers the parameters (registered on the module until its post-forward reshards them)
        and hooks the backward (gather again, then reduce-scatter the gradients autograd
        accumulates into the gathered parameters)."""
        block, names = self.block, list(self.aliases)

        def forward(inp):
            live = dict(block.named_parameters())
            return _BlockReplay.apply(self, inp, *(live[n] for n in names))

        own = block.__dict__.get("forward")  # an instance's own forward, put back after
        block.forward = forward
        try:
            return block(x)
        finally:
            if own is None:
                del block.forward
            else:
                block.forward = own


class _BlockReplay(torch.autograd.Function):
    """Forward: the block's forward graph; backward: its backward graph (with the recompute)."""

    @staticmethod
    def forward(ctx, graphs: _BlockGraphs, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if graphs.copy_params:  # an FSDP2 unit: every parameter, as gathered now
            graphs.load_params(params)
            ctx.params = params  # not saved_tensors: the backward's gather rewrites them in place
        if x.data_ptr() != graphs.static_in.data_ptr():  # chained blocks read the last output in place
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
        if protocol is not None and protocol.config.quantized:
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

        def capture_all():
            device = x.device.type
            # the autocast weight cache off: a cast cached in one graph would be read by another
            cache_off = torch.autocast(
                device,
                dtype=torch.get_autocast_dtype(device),
                enabled=torch.is_autocast_enabled(device),
                cache_enabled=False,
            )
            with cache_off:
                inp = x.detach().clone().requires_grad_(x.requires_grad)
                for g in graphs:
                    if g.copy_params:  # the replay's input is FSDP2's cast of it: capture with that
                        inp = _unit_input(g.block, inp)
                    g.static_in = inp
                    g.fwd = backend.new_graph()
                    with backend.capture(g.fwd, pool, self._side):
                        g.static_out = self._region(g.call_with_aliases, inp)
                    inp = g.static_out.detach().requires_grad_(True)
                grad = torch.empty_like(graphs[-1].static_out)
                for g in reversed(graphs):
                    aliases = [a for a in g.aliases.values() if a.requires_grad]
                    wanted = ([g.static_in] if g.static_in.requires_grad else []) + aliases
                    g.static_grad_out = grad
                    g.bwd = backend.new_graph()
                    with backend.capture(g.bwd, pool, self._side):
                        grads = torch.autograd.grad(g.static_out, wanted, grad_outputs=grad, allow_unused=True)
                    if g.static_in.requires_grad:
                        g.static_grad_in, grads = grads[0], grads[1:]
                    g.static_grad_params = tuple(grads)
                    g._grad_layout = None  # fresh_grads works its buffer out anew for these
                    g.static_out = g.static_out.detach()  # the captured autograd graph is not needed again
                    grad = g.static_grad_in
                    if grad is None and g is not graphs[0]:
                        raise ConfigError(
                            "GraphedBlocks: a block's output does not depend on its input, so the stack is not "
                            "a chain of blocks"
                        )

        backend.on_side(self._side, protocol, capture_all)
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


def _static_copies(block: nn.Module, shared: dict) -> dict[str, torch.Tensor]:
    """The graphs' own copies of a gathered block's parameters, leaves like them. Blocks of the
    same parameter layout share one set (``shared``, by layout): every replay of a block fills
    them with that block's parameters first and the blocks replay one after another, so one
    block's worth of memory serves the stack. An FP8-gathered weight
    (``nn.fsdp.Fp8GatheredWeight``) shares its codes' buffer and keeps its own layer's captured
    snapshot, whose tensors the graphs read and each replay refreshes (:meth:`_BlockGraphs.load_params`)."""
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


def _unit_input(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as an FSDP2 unit's pre-forward hands it to the unit's forward: cast to the unit's
    ``MixedPrecisionPolicy.param_dtype`` when the policy casts forward inputs (a leaf again, for
    the capture). The capture calls the forward past the hooks; a replay runs through them."""
    state = block._get_fsdp_state() if hasattr(block, "_get_fsdp_state") else None
    policy = getattr(state, "_mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    if policy is None or not getattr(policy, "cast_forward_inputs", False) or dtype is None:
        return x
    if not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.detach().to(dtype).requires_grad_(x.requires_grad)


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
