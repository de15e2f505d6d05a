"""QuantProtocol: the one object converted modules talk to, per event and per call.

It holds the state every part reads (config, recipe, bank, clock, ledger, guard, stash, the
open event, one lock) and the events (begin, commit, end, abort); each call's work is
delegated to the parts, whose methods on the hot path (:meth:`enter_call`, :meth:`quantize`)
are bound once at construction, so a call pays no lookup for them: owners and call records
(:mod:`.records`), quantize and encode (:mod:`.encode`), commits and the amax reduction
(:mod:`.events`), sharded weights (:mod:`.sharded`), CUDA-graph templates (:mod:`.templates`)
and what comes in from outside, a quantize policy and the auditors (:mod:`.policy`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from ..config import QuantConfig, require_type
from ..encoders import Prologue
from ..errors import StateTransitionError
from ..quant_recipes import Recipe, recipe_for
from ..recompute import CallRecord, Phase, SnapshotStash, current_frame, in_backward
from ..sac import outside_selective_checkpoint
from ..state import (
    ConcurrencyGuard,
    Event,
    FrozenScales,
    Ledger,
    LogicalClock,
    QuantSnapshot,
    StateBank,
    StreamOrder,
)
from .encode import Quantizer
from .events import (
    Commits,
    OpenEvent,
    check_reduction_roles,
    data_parallel_reducer,
    keep,
    release_kept,
    require_open,
)
from .fallback import FallbackMonitor
from .policy import observe_operand, observe_output
from .records import CallRecords
from .sharded import ShardedWeights, ShardSource
from .templates import GraphTemplate, GraphTemplates

__all__ = ["QuantProtocol"]


class QuantProtocol:
    """Owns the bank, clock, ledger, guard and stash of one process's quantizers."""

    def __init__(self, config: QuantConfig, *, rank: int = 0, policy=None) -> None:
        """
        Args:
            config: the quantization configuration.
            rank: this process's data-parallel rank (part of the owner keys).
            policy: ``None`` (the rules), or a quantize policy that replaces the rules for
                true-forward and recompute calls (:mod:`lightning_fp8state.defects`: the
                seed's defects, for the audit); it gets a :class:`~.policy.PolicyPort`.

        Raises:
            ConfigError: ``config.amax_reduction`` names an unknown role.
        """
        require_type("config", config, QuantConfig, "a QuantConfig")
        self.config = config
        # the plug-in that answers every per-recipe question (encoders, GEMM, all-gather, telemetry)
        self.recipe: Recipe = recipe_for(config)
        self.rank = int(rank)
        self._open: OpenEvent | None = None
        self._lock = threading.RLock()
        self.guard = ConcurrencyGuard()
        self.stash = SnapshotStash()
        # Orders bank accesses across CUDA streams once a second stream enters (no-op otherwise).
        self.stream_order = StreamOrder()
        self.auditors: list = []
        # Set by enable_amax_reduction(): combines pending amaxes across data-parallel ranks
        # right before each commit (the rules only; a defect policy never reduces).
        self.amax_reducer = None
        check_reduction_roles(config)
        self._encoders: dict[str, object] = {}  # role -> the recipe's encoder (cached)
        self._stateful: dict[str, bool] = {}  # role -> the recipe's answer (cached)
        self._policy = policy
        # QuantConfig.fallback (protocol/fallback.py): layer -> step of its move to high precision,
        # read by every converted call (empty, and no monitor, when the fallback is off)
        self.fallback = FallbackMonitor(self) if config.fallback else None
        self.fallen_back: dict[str, int] = self.fallback.fallen if self.fallback is not None else {}
        # layer -> the recipe a moved layer's calls run instead of self.recipe (the fallback's target)
        self.layer_recipes: dict[str, Recipe] = self.fallback.routes if self.fallback is not None else {}
        # Layers whose weight arrives quantized from an FP8 all-gather (FSDP2, nn/fsdp.py): layer ->
        # where its weight lives now (a ShardSource). Layers whose weight FSDP2 shards or ZeRO-3
        # partitions (nn.fsdp.mark_sharded). What either means for a call: sharded.py.
        self.gathered_layers: dict[str, Callable[[], ShardSource]] = {}
        self.sharded_layers: set[str] = set()
        # the parts (each reads the shared state above through this object)
        self._records = CallRecords(self)
        self._commits = Commits(self)
        self._quantizer = Quantizer(self, self._records, self._commits, policy)
        self._sharded = ShardedWeights(self, self._records, self._quantizer)
        self._templates = GraphTemplates(self)
        # the hot path's steps, bound once
        self._new_record = self._records.new_record
        self._live_record = self._records.live_record
        self._quantize = self._quantizer.quantize
        # recipe_of(layer): the recipe that layer's calls run (self.recipe, or its fallback move's)
        self.recipe_of = self._records.recipe_of
        self.reset()  # the bank, clock and ledger (and the stateless owners), fresh

    def reset(self) -> None:
        """Forget every owner's state: a fresh bank, clock and ledger, as constructed (a state
        that turned out to belong to another model is discarded this way).

        Raises:
            StateTransitionError: inside an open event.
        """
        if self._open is not None:
            raise StateTransitionError(f"reset() inside event {self._open.event}: reset between events")
        with self._lock:
            self.bank = StateBank(self.config.history_len)
            self.clock = LogicalClock()
            self.ledger = Ledger(strict=self.config.strict, window=self.config.ledger_window)
            self._records.reset()
            if self.fallback is not None:
                self.fallback.reset()

    # -- events --------------------------------------------------------------------
    def begin_event(self, step: int | None = None, microbatch: int = 0) -> Event:
        with self._lock:
            event = self.clock.begin(step, microbatch)
            self._open = OpenEvent(event)
            self._sharded.prepare(self._open)  # FP8-gathered weights: owners and scales, now
            return event

    def _require_open(self, what: str) -> OpenEvent:
        return require_open(self._open, what)

    def commit_forward(self) -> None:
        """Advance the forward roles (input, weight, attention operands) observed so far."""
        ev = self._require_open("commit_forward()")
        self._commits.commit(ev, {"forward"}, reduce_phases={"forward"})
        ev.forward_committed = True

    def enable_amax_reduction(self, *, group=None, device: torch.device | None = None) -> bool:
        """Reduce pending amaxes across the data-parallel ``group`` before every commit, for
        the roles ``config.amax_reduction`` marks ``data_parallel``.

        Every rank must enable it and run the same events. Does nothing (returns False)
        without an initialized process group of more than one rank, under the bf16 recipe,
        or when no role reduces.
        """
        reducer = data_parallel_reducer(self.config, self.recipe, group=group, device=device)
        if reducer is None:
            return False
        self.amax_reducer = reducer
        return True

    def end_event(self) -> None:
        """Commit what is left (backward roles, or all if commit_forward was not called)."""
        ev = self._require_open("end_event()")
        try:
            late = {"backward"} if ev.forward_committed else {"forward", "backward"}
            self._commits.commit(ev, {"forward", "backward"}, reduce_phases=late)
            self.ledger.check_event(ev.event)
            if self.fallback is not None:  # at the boundary: one host read, the same on every rank
                self.fallback.decide(ev.event)
        finally:
            self._close(ev)

    def abort_event(self) -> None:
        """Close the open event without committing; its pending amaxes are discarded."""
        ev = self._open
        if ev is None:
            return
        self._commits.discard_pending(ev)
        if self.fallback is not None:
            self.fallback.discard()
        self._close(ev)

    def _close(self, ev: OpenEvent) -> None:
        with self._lock:
            release_kept(ev)
            self.stash.release()
            self.guard.clear()
            self.clock.end()
            self._open = None

    @property
    def event(self) -> Event | None:
        return self.clock.event

    # -- what it holds -------------------------------------------------------------
    def owners(self) -> list:
        """Every owner registered so far: the bank's (delayed state), in bank order, then the
        stateless roles' owners (a recipe whose scale comes from each call's own tensor)."""
        return [*self.bank.owners, *self._records.dynamic]

    def stateful(self, role: str) -> bool:
        """Whether ``role``'s scale is delayed state in the bank (the recipe's answer)."""
        known = self._stateful.get(role)
        if known is None:
            known = self._stateful[role] = self.recipe.stateful(role)
        return known

    def encoder(self, role: str):
        """The encoder of ``role``: the recipe's (:meth:`Recipe.encoder`), fixed by the config."""
        enc = self._encoders.get(role)
        if enc is None:
            enc = self._encoders[role] = self.recipe.encoder(role)
        return enc

    def dynamic_snapshots(self) -> dict:
        """Stateless owner -> its latest true-forward snapshot (scale, descale and amax of that
        call), for telemetry; owners not yet called in a true forward are left out."""
        return self._records.dynamic_snapshots()

    # -- per-block CUDA graphs (block_graphs.py) ------------------------------------
    def freeze_event(self, device: torch.device) -> FrozenScales:
        """Take the open event's frozen scales now (eagerly), if no call took them yet."""
        return self._templates.freeze_event(device)

    def graph_template(self, since: GraphTemplate | None = None) -> GraphTemplate:
        """What the open event's calls did on the host so far, less what it had done at
        ``since`` (taken before the capture): the calls captured in CUDA graphs, for
        :meth:`replay_template` to repeat in later events without Python per call."""
        return self._templates.take(since)

    def replay_template(self, template: GraphTemplate) -> None:
        """Count the open event as running ``template``'s captured calls again: their owners
        observed (and committed, where the capture committed: a defect policy), the ledger's
        records added, and the event's scales frozen into the copy the graphs read.

        Raises:
            StateTransitionError: no open event, or the bank changed since the capture.
        """
        self._templates.replay(template)

    # -- calls ---------------------------------------------------------------------
    def enter_call(
        self,
        layer: str,
        roles: tuple[str, ...],
        device: torch.device,
        *,
        channels: Mapping[str, int] | None = None,
        grad_enabled: bool | None = None,
    ) -> tuple[Phase, CallRecord]:
        """Identify one call of ``layer``: its phase and its call record.

        A true-forward call gets a new record (owners registered, snapshots taken from
        the event's frozen scales) that is stashed; a recompute gets the stashed record
        of the true-forward call it replays.

        Args:
            layer: the module's name (one per layer).
            roles: the roles it quantizes in this call.
            device: where its tensors live.
            channels: per role, the size of the last dimension of the tensor it will
                quantize; needed for centered FP4 roles (their running center has one value
                per channel).
            grad_enabled: whether the call builds a graph for a backward; default
                ``torch.is_grad_enabled()`` (a compiled graph's op passes what held at trace
                time: inside it autograd runs with gradients off).

        Raises:
            StateTransitionError: a training forward (grad enabled) outside any event.
            AmbiguousRecomputeError: a recompute that matches no unique true-forward call.
        """
        frame = current_frame()
        backward = in_backward()
        ev = self._open
        if ev is None:
            if (torch.is_grad_enabled() if grad_enabled is None else grad_enabled) or backward:
                raise StateTransitionError(
                    f"layer {layer!r} ran a training forward outside a logical event: its amax "
                    "would belong to no step. Wrap forward and backward in `with state.step(step, "
                    "microbatch)` (the Lightning callback does this), or run under torch.no_grad() "
                    "for evaluation"
                )
            return Phase.INFERENCE, self._live_record(layer, roles, device, frame, channels)
        if (frame is not None and frame.phase is Phase.RECOMPUTE) or backward:
            return Phase.RECOMPUTE, self.stash.find(ev.event, frame, layer)
        # registration and the event's freeze happen in the true forward only: unseen by SAC
        return Phase.FORWARD, outside_selective_checkpoint(self._new_record, ev, layer, roles, device, frame, channels)

    def quantize(
        self, record: CallRecord, role: str, x: torch.Tensor, phase: Phase, prologue: Prologue | None = None
    ) -> tuple[object, QuantSnapshot]:
        """Quantize ``x`` for ``role`` of ``record``; returns the data and its paired snapshot.

        The data is an FP8 tensor, or for FP4 roles the pair ``(packed uint8, block_scales)``
        (decode it with ``ops.dequantize_fp4(..., snap.descale, snap.layout, dtype, snap.center)``).
        ``phase`` is the call's phase for forward roles and FORWARD for backward roles
        (a backward pass runs once per event; checkpointing re-runs only forwards).
        With a :class:`~lightning_fp8state.encoders.Prologue`, what is quantized (and recorded)
        is the prologue's output on ``x``, fused into one pass where a kernel takes it.
        """
        q, snap = self._quantize(record, role, x, phase, prologue)
        record.used[role] = snap
        if self.fallback is not None:
            self.fallback.observe_operand(record, role, phase, x, q, snap, prologue)
        if self.auditors:  # the quantized operand itself: early stop may never produce the output
            # a stateless scale is re-derived by the recompute from its own input: exact only if
            # that input is bitwise the true forward's, so the auditors compare the input too
            stateful = record.indices[role] >= 0  # (the layer's recipe's answer: a moved layer's may differ)
            observe_operand(self.auditors, record, role, phase, q if stateful else (q, x), snap)
        return q, snap

    def check_consumer(self, record: CallRecord, role: str, snap: QuantSnapshot) -> QuantSnapshot:
        """A consumer's check that ``snap`` belongs to it: ``role``'s owner in ``record``, in
        the open event (rule 6). Every consumer of quantized data calls this before reading
        the snapshot's scales.

        Raises:
            StaleSnapshotError: the snapshot is another owner's or another event's.
        """
        owner, event = record.owners[role], self.clock.event
        # the check itself, without building expect()'s table: the common case costs two compares
        if snap.owner is owner and (event is None or (snap.step == event[0] and snap.microbatch == event[1])):
            return snap
        return snap.expect(owner=owner, event=event)

    def keep_for_backward(self, key: int, state) -> None:
        """Hold ``state`` (what a call's backward needs besides its saved tensors) under ``key``
        for an opaque op's backward, which takes it with :func:`take_kept` (torch.compile's
        Fp8Linear, nn/linear_call.py: the key is the address of the call's input codes, unique
        among live tensors). Released when taken or at the event's end; a key reused by a
        later call (the first holder's tensor freed) is that call's."""
        keep(self._require_open("keeping a call's state for its backward"), key, state)

    def observe_output(self, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
        """Hand one module output (a tensor, or a tuple of tensors) and the snapshots it
        consumed (a copy of ``snaps``, taken only when an auditor is attached) to the auditors,
        and to the fallback's non-finite trigger."""
        if self.fallback is not None:
            self.fallback.observe_output(record, phase, output)
        if self.auditors:
            observe_output(self.auditors, record, phase, output, snaps)

    # -- FP8 all-gather of sharded weights (FSDP2: lightning_fp8state.nn.fsdp) ---------
    def gather_weight(self, layer: str, shard: torch.Tensor, group=None) -> tuple[torch.Tensor, QuantSnapshot]:
        """Quantize this rank's shard of ``layer``'s weight for an FP8 all-gather.

        The scale is the event's frozen weight scale (the snapshot the layer's call will use),
        so the gathered codes are bitwise those of quantizing the full weight at that scale.
        Under a per-call weight scale (a stateless recipe) it is the full weight's own, derived
        at :meth:`begin_event`, and nothing is recorded: the codes are bitwise the unsharded
        call's.

        - True forward: the shard's amax is recorded into the weight owner's pending slot
          (the amax reduction at ``commit_forward`` takes the MAX over the shard group: the
          full weight's amax); an owner with no scale yet (``initial_scale="calibrate"``)
          takes it from the MAX of the shards' amaxes (one all-reduce over ``group``, in its
          first event only). The snapshot is kept for the event.
        - Backward (FSDP re-gathers a resharded weight, also for a recompute): read-only, with
          the snapshot of the event's forward gather: the same bytes.
        - No event, gradients off (evaluation): a copy of the live scale, nothing recorded.

        Every structural change (registration, the event's freeze) happened at
        :meth:`begin_event`; here the bank is only read and one pending amax recorded, on the
        stream FSDP2 quantizes on (its copy-in stream, ordered after the training stream at
        the root's forward; the training stream waits for the gather before the layer runs).

        Raises:
            StateTransitionError: a training forward outside an event, a second forward gather
                of the layer in one event, or a backward gather with no forward gather.
        """
        return self._sharded.gather(layer, shard, group)

    def adopt(self, record: CallRecord, role: str, data: torch.Tensor, snap: QuantSnapshot, phase: Phase):
        """Take ``role``'s operand already quantized before the call (an FP8 all-gather of the
        weight, :meth:`gather_weight`) with its snapshot, instead of quantizing it here: the
        true forward observes the owner (its amax was recorded at the gather), a recompute
        reads it. Returns ``(data, snap)`` as :meth:`quantize` does.

        Raises:
            StateTransitionError: the snapshot belongs to another owner of the layer (a second
                call site of a layer whose weight is gathered once per event).
            StaleSnapshotError: the snapshot belongs to another event.
        """
        self._quantizer.adopt(record, role, snap, phase)
        record.used[role] = snap
        if self.auditors:
            observe_operand(self.auditors, record, role, phase, data, snap)
        return data, snap
