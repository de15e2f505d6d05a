"""QuantProtocol: the rules, enforced per call — own, snapshot, pair, commit once, replay.

Every converted module asks :meth:`QuantProtocol.enter_call` who it is and in which phase
it runs, then quantizes through :meth:`QuantProtocol.quantize`, and checks each snapshot it
consumes with :meth:`QuantProtocol.check_consumer`:

1. Ownership: each call gets owners for its roles (layer × role × rank × stream × site).
2. Snapshot before advance: a true-forward call's snapshot is a view of the event's frozen
   copy of all scales, taken before any commit in the event.
3. Pairing: quantize returns the snapshot with the data; consumers read only it.
4. One commit per owner per event: :meth:`commit_forward` / :meth:`end_event`, batched.
5. Recompute is read-only: it looks up the true forward's call record and records nothing.
6. Stamps: snapshots carry (event, owner, region, ordinal); consumers check them.

This module decides only *which* snapshot a call uses and *whether* it records; *how* a
role's tensor is encoded is its encoder's, and which encoder a role has is the recipe's
(:mod:`lightning_fp8state.quant_recipes`, the one ``config.recipe`` names: ``self.recipe``). The seed's defects, reproduced on
purpose for the audit (``mode="naive"`` / ``"naive_snapshot"``), are quantize policies in
:mod:`lightning_fp8state.defects`, handed in by the facade; this module does not import them.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from .config import QuantConfig, require_type
from .encoders import Prologue
from .errors import ConfigError, StaleSnapshotError, StateTransitionError
from .quant_recipes import Recipe, recipe_for
from .recompute import CallRecord, Phase, SnapshotStash, current_frame, in_backward
from .sac import in_selective_checkpoint, outside_selective_checkpoint
from .state import (
    BACKWARD_ROLES,
    FORWARD_ROLES,
    AmaxReducer,
    ConcurrencyGuard,
    Event,
    EventRecord,
    FrozenScales,
    Ledger,
    LogicalClock,
    QuantSnapshot,
    StateBank,
    StreamOrder,
    current_stream_ident,
    role_phase,
    scoped_owner,
)

__all__ = ["GraphTemplate", "QuantProtocol", "ShardSource", "release_weight_codes"]

# keep_for_backward: key -> a call's host-side state, across protocols (a backward names only the key)
_KEPT: dict[int, object] = {}
# CallRecord.derived's key for the weight's codes of a call's true forward (its recompute reuses them)
_CODES = "weight_codes"


def _parameter_key(x: torch.Tensor) -> tuple:
    """What identifies a parameter's contents inside an event: its memory, layout and version
    (an in-place update bumps the version; a view, e.g. Conv1D's transposed weight, shares it)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x._version)


def release_weight_codes(record: CallRecord) -> None:
    """Drop the weight codes ``record``'s true forward kept for its recompute (the call's
    backward, after which no recompute of it runs in the event, calls this)."""
    record.derived.pop(_CODES, None)


class _Scratch(NamedTuple):
    """Where recompute's quantize records to (read by no one): the bank's statistics' shape."""

    amax_pending: torch.Tensor
    center_max: torch.Tensor
    center_min: torch.Tensor


class _Entrant(NamedTuple):
    """One entrant's owners as registered in the bank at ``version`` (shared by its call
    records, which never change them)."""

    version: int
    owners: dict  # role -> OwnerKey
    indices: dict  # role -> bank index (-1: stateless)
    widths: dict  # role -> center width, for the banked roles
    banked: bool  # any role has bank state


class GraphTemplate(NamedTuple):
    """The host side of calls captured in CUDA graphs (:meth:`QuantProtocol.graph_template`)."""

    observed: dict  # OwnerKey -> bank index, as the capture observed them
    committed: frozenset  # owners the capture committed (a defect policy commits at once)
    records: dict  # OwnerKey -> EventRecord: the ledger's counts of the captured calls
    frozen: FrozenScales | None  # the frozen scales the graphs read
    version: int  # the bank version they were captured against


class ShardSource(NamedTuple):
    """Where an FP8-gathered layer's weight lives now (:attr:`QuantProtocol.gathered_layers`)."""

    device: torch.device
    shard: torch.Tensor | None  # this rank's high-precision shard; None while the weight is unsharded
    group: object  # the shard group the all-gather runs over; None: the weight is not sharded


@dataclass
class _OpenEvent:
    event: Event
    frozen: FrozenScales | None = None
    sites: defaultdict = field(default_factory=lambda: defaultdict(int))  # (layer, stream) -> n
    top_ordinals: defaultdict = field(default_factory=lambda: defaultdict(int))
    observed: dict = field(default_factory=dict)  # OwnerKey -> bank index, in order
    committed: set = field(default_factory=set)
    forward_committed: bool = False  # commit_forward() ran in this event
    calibrated: set = field(default_factory=set)  # bank indices whose frozen scale this event calibrated
    gathered: dict = field(default_factory=dict)  # layer -> the weight snapshot its FP8 all-gather used
    # layer -> (scale, descale, amax) of its full weight, for a per-call weight scale (a stateless
    # recipe): computed at begin_event for every gathered layer, in one all-reduce
    gather_scales: dict = field(default_factory=dict)
    kept: list = field(default_factory=list)  # (key, state) kept for a backward (compiled path), released at close


class QuantProtocol:
    """Owns the bank, clock, ledger, guard and stash of one process's quantizers."""

    def __init__(self, config: QuantConfig, *, rank: int = 0, policy=None) -> None:
        """
        Args:
            config: the quantization configuration.
            rank: this process's data-parallel rank (part of the owner keys).
            policy: ``None`` (the rules), or a quantize policy that replaces the rules for
                true-forward and recompute calls (:mod:`lightning_fp8state.defects`: the
                seed's defects, for the audit).
        """
        require_type("config", config, QuantConfig, "a QuantConfig")
        self.config = config
        # the plug-in that answers every per-recipe question (encoders, GEMM, all-gather, telemetry)
        self.recipe: Recipe = recipe_for(config)
        self.rank = int(rank)
        self._open: _OpenEvent | None = None
        self._lock = threading.RLock()
        self.reset()  # the bank, clock and ledger (and the stateless owners), fresh
        self.guard = ConcurrencyGuard()
        self.stash = SnapshotStash()
        # Orders bank accesses across CUDA streams once a second stream enters (no-op otherwise).
        self.stream_order = StreamOrder()
        self.auditors: list = []
        # Set by enable_amax_reduction(): combines pending amaxes across data-parallel ranks
        # right before each commit (the rules only; a defect policy never reduces).
        self.amax_reducer: AmaxReducer | None = None
        unknown = sorted({r for r, _ in config.amax_reduction} - FORWARD_ROLES - BACKWARD_ROLES - {"*"})
        if unknown:
            raise ConfigError(
                f"amax_reduction names unknown role(s) {unknown}: expected roles from "
                f"{sorted(FORWARD_ROLES | BACKWARD_ROLES)} or '*'"
            )
        self._streams: dict[tuple, int] = {}
        self._owner_keys: dict[tuple, object] = {}  # (layer, role, rank, stream, site) -> OwnerKey
        self._encoders: dict[str, object] = {}
        self._stateful: dict[str, bool] = {}  # role -> the recipe's answer (cached)
        self._discard: dict[tuple, _Scratch] = {}  # (device, center width) -> recompute's scratch slot
        self._policy = policy
        self._stream_scoped = config.ownership == "per_layer_rank_stream"  # the guard's error hint
        # Layers whose weight arrives quantized from an FP8 all-gather (FSDP2, nn/fsdp.py):
        # layer -> a callable giving where its weight lives now (a ShardSource). Their weight owners
        # are registered and the event's scales frozen (a delayed weight scale) or derived from the
        # full weights (a per-call one) at begin_event, on the training stream, before any
        # all-gather reads them.
        self.gathered_layers: dict[str, Callable[[], ShardSource]] = {}
        # Layers whose weight FSDP2 shards or ZeRO-3 partitions (nn.fsdp.mark_sharded): their true
        # forward keeps no weight codes for the recompute (QuantConfig.weight_codes_once), which
        # would hold a full weight per call from the forward to the backward, the memory sharding
        # exists to free; the recompute encodes the re-gathered weight again (the same codes).
        self.sharded_layers: set[str] = set()

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
            # Owners of stateless roles (their scale from each call's own tensor: no bank slot), in
            # order of registration, each with its latest true-forward snapshot (telemetry reads it).
            self._dynamic: dict = {}  # OwnerKey -> QuantSnapshot | None
            # (layer, roles, stream, site, channels) -> its owners as registered (_entrant)
            self._entrants: dict[tuple, _Entrant] = {}

    # -- events --------------------------------------------------------------------
    def begin_event(self, step: int | None = None, microbatch: int = 0) -> Event:
        with self._lock:
            event = self.clock.begin(step, microbatch)
            self._open = _OpenEvent(event)
            if self.gathered_layers and self.config.quantized and self._policy is None:
                self._prepare_gathers(self._open)
            return event

    def _prepare_gathers(self, ev: _OpenEvent) -> None:
        """Register the gathered layers' weight owners (first event) and freeze the event's
        scales now, on the training stream: FSDP2 runs the all-gather's quantize on its own
        copy-in stream, which it orders after the training stream at the root's forward, so
        no structural change of the bank may happen there (see :meth:`gather_weight`).

        A per-call weight scale (a stateless recipe) is the full weight's: derived here for
        every gathered layer from its shard, one collective over the shard group for all
        (:meth:`Recipe.gather_scales`). The weights do not change inside an event (the
        optimizer steps between events), so the forward's gather, the backward's re-gather and
        a recompute all use these values. Every rank opens the same events, so every rank
        reaches the collective; a layer that is unsharded right now (FSDP2 kept it gathered)
        gets its scale at its gather instead, if it is gathered in this event at all."""
        device, banked, per_call = None, False, {}
        for layer, source_of in self.gathered_layers.items():
            source = source_of()
            device = source.device
            _, index = self._gather_owner(layer, device)
            if index >= 0:
                banked = True
            elif source.shard is not None:
                per_call[layer] = source
        if banked:
            self.stream_order.structural(device)
            ev.frozen = self.bank.freeze()
        if per_call:
            ev.gather_scales = self._full_weight_scales(per_call)

    def _full_weight_scales(self, sources: dict[str, ShardSource]) -> dict[str, tuple]:
        """layer -> ``(scale, descale, amax)`` of its full weight (0-d float32), from this rank's
        shards: one :meth:`Recipe.gather_scales` (one collective) per shard group."""
        groups: list[tuple[object, list[str]]] = []  # in first-seen order: the same on every rank
        for layer, source in sources.items():
            for group, layers in groups:
                if group is source.group:
                    layers.append(layer)
                    break
            else:
                groups.append((source.group, [layer]))
        out = {}
        for group, layers in groups:
            scale, descale, amax = self.recipe.gather_scales([sources[n].shard for n in layers], group)
            out.update(zip(layers, zip(scale.unbind(0), descale.unbind(0), amax.unbind(0), strict=True), strict=True))
        return out

    def _require_open(self, what: str) -> _OpenEvent:
        if self._open is None:
            raise StateTransitionError(f"{what} outside a logical event: call it inside `with state.step(...)`")
        return self._open

    def commit_forward(self) -> None:
        """Advance the forward roles (input, weight, attention operands) observed so far."""
        ev = self._require_open("commit_forward()")
        self._commit(ev, {"forward"}, reduce_phases={"forward"})
        ev.forward_committed = True

    def enable_amax_reduction(self, *, group=None, device: torch.device | None = None) -> bool:
        """Reduce pending amaxes across the data-parallel ``group`` before every commit, for
        the roles ``config.amax_reduction`` marks ``data_parallel``.

        Every rank must enable it and run the same events. Does nothing (returns False)
        without an initialized process group of more than one rank, under the bf16 recipe,
        or when no role reduces.
        """
        roles = {r for r in FORWARD_ROLES | BACKWARD_ROLES if self.recipe.stateful(r)}  # stateless: nothing pends
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
            return False
        if not self.config.quantized or not any(self.config.reduction_of(r) == "data_parallel" for r in roles):
            return False
        self.amax_reducer = AmaxReducer(self.config.reduction_of, group=group, device=device)
        return True

    def _reduces(self, phases: set[str]) -> bool:
        reducer = self.amax_reducer
        if reducer is None or self._policy is not None or not self.config.quantized:
            return False
        roles = (FORWARD_ROLES if "forward" in phases else set()) | (BACKWARD_ROLES if "backward" in phases else set())
        return any(reducer.reduces(r) for r in roles)

    def _commit(self, ev: _OpenEvent, phases: set[str], *, reduce_phases: set[str]) -> None:
        with self._lock:
            # (the roles of ``phases``, looked up once: an observed owner's role is a known one)
            roles = (FORWARD_ROLES if "forward" in phases else set()) | (
                BACKWARD_ROLES if "backward" in phases else set()
            )
            committed = ev.committed
            owners = [o for o in ev.observed if o.role in roles and o not in committed]
            # a stateless owner (index -1) commits in the ledger only: it has no bank state
            indices = tuple(i for i in (ev.observed[o] for o in owners) if i >= 0)
            # The collective runs whenever a role of ``reduce_phases`` reduces, even with
            # nothing to commit here: every rank must reach it at the same points.
            self.stream_order.structural(self.bank.device)
            if self._reduces(reduce_phases):
                self.amax_reducer.reduce(self.bank, indices)
            if not owners:
                return
            if indices:
                self.bank.commit(indices, self.config.amax_algo, self.config.margin, self.config.attn_center_momentum)
            ev.committed.update(owners)
            self.guard.release(owners)
            self.ledger.commit(ev.event, owners)

    def end_event(self) -> None:
        """Commit what is left (backward roles, or all if commit_forward was not called)."""
        ev = self._require_open("end_event()")
        try:
            late = {"backward"} if ev.forward_committed else {"forward", "backward"}
            self._commit(ev, {"forward", "backward"}, reduce_phases=late)
            self.ledger.check_event(ev.event)
        finally:
            self._close(ev)

    def abort_event(self) -> None:
        """Close the open event without committing; its pending amaxes are discarded."""
        ev = self._open
        if ev is None:
            return
        with self._lock:
            pending = tuple(i for o, i in ev.observed.items() if o not in ev.committed and i >= 0)
            if pending:
                self.stream_order.structural(self.bank.device)
            self.bank.discard_pending(pending)
        self._close(ev)

    def _close(self, ev: _OpenEvent) -> None:
        with self._lock:
            for key, state in ev.kept:  # what no backward took (checkpointed true forwards)
                if _KEPT.get(key) is state:
                    del _KEPT[key]
            self.stash.release()
            self.guard.clear()
            self.clock.end()
            self._open = None

    @property
    def event(self) -> Event | None:
        return self.clock.event

    def owners(self) -> list:
        """Every owner registered so far: the bank's (delayed state), in bank order, then the
        stateless roles' owners (a recipe whose scale comes from each call's own tensor)."""
        return [*self.bank.owners, *self._dynamic]

    def stateful(self, role: str) -> bool:
        """Whether ``role``'s scale is delayed state in the bank (the recipe's answer)."""
        known = self._stateful.get(role)
        if known is None:
            known = self._stateful[role] = self.recipe.stateful(role)
        return known

    def dynamic_snapshots(self) -> dict:
        """Stateless owner -> its latest true-forward snapshot (scale, descale and amax of that
        call), for telemetry; owners not yet called in a true forward are left out."""
        with self._lock:
            return {o: s for o, s in self._dynamic.items() if s is not None}

    # -- per-block CUDA graphs (block_graphs.py) ------------------------------------
    def freeze_event(self, device: torch.device) -> FrozenScales:
        """Take the open event's frozen scales now (eagerly), if no call took them yet."""
        ev = self._require_open("freeze_event()")
        with self._lock:
            if ev.frozen is None or ev.frozen.version != self.bank.version:
                self.stream_order.structural(device)
                ev.frozen = self.bank.freeze()
            return ev.frozen

    def graph_template(self, since: GraphTemplate | None = None) -> GraphTemplate:
        """What the open event's calls did on the host so far, less what it had done at
        ``since`` (taken before the capture): the calls captured in CUDA graphs, for
        :meth:`replay_template` to repeat in later events without Python per call."""
        ev = self._require_open("graph_template()")
        with self._lock:
            records = {}
            for o, r in self.ledger.event(ev.event).items():
                b = since.records.get(o) if since is not None else None
                if b is None:
                    records[o] = EventRecord(
                        r.observations, r.commits, r.recompute_reads, r.recompute_records, set(r.sites)
                    )
                    continue
                counts = (
                    r.observations - b.observations,
                    r.commits - b.commits,
                    r.recompute_reads - b.recompute_reads,
                    r.recompute_records - b.recompute_records,
                )
                if any(counts):
                    records[o] = EventRecord(*counts, set(r.sites))
            observed = {o: i for o, i in ev.observed.items() if since is None or o not in since.observed}
            committed = frozenset(ev.committed - (since.committed if since is not None else frozenset()))
            return GraphTemplate(observed, committed, records, ev.frozen, self.bank.version)

    def replay_template(self, template: GraphTemplate) -> None:
        """Count the open event as running ``template``'s captured calls again: their owners
        observed (and committed, where the capture committed: a defect policy), the ledger's
        records added, and the event's scales frozen into the copy the graphs read.

        Raises:
            StateTransitionError: no open event, or the bank changed since the capture.
        """
        ev = self._require_open("a CUDA-graph replay")
        with self._lock:
            if template.version != self.bank.version:
                raise StateTransitionError(
                    "a CUDA-graph replay: the state bank was reallocated after the capture (a new owner "
                    "registered, or load_state_dict/to() ran), so the graphs would read and write the old "
                    "tensors: capture again"
                )
            if template.frozen is None:  # nothing quantized (the bf16 recipe)
                pass
            elif ev.frozen is None:
                self.stream_order.structural(self.bank.device)
                ev.frozen = self.bank.freeze_into(template.frozen)
            elif ev.frozen is not template.frozen:  # an eager call froze first: the same values
                template.frozen.scales.copy_(ev.frozen.scales)
                if template.frozen.centers is not None:
                    template.frozen.centers.copy_(ev.frozen.centers)
            for owner, index in template.observed.items():
                ev.observed.setdefault(owner, index)
            ev.committed.update(template.committed)
        self.ledger.replay(ev.event, template.records, partial=True)

    # -- calls ---------------------------------------------------------------------
    def _enter_stream(self, device: torch.device) -> tuple:
        """The entrant's identity (``current_stream_ident``), noting its CUDA stream for the
        cross-stream ordering; the current stream is looked up once."""
        if device.type == "cuda":
            current = self.stream_order.resolve(torch.cuda.current_stream(device))
            self.stream_order.enter(device, current)
            return current_stream_ident(device, current)
        return current_stream_ident(device)

    def _stream_ordinal(self, ident: tuple) -> int:
        n = self._streams.get(ident)
        if n is None:
            with self._lock:
                n = self._streams.setdefault(ident, len(self._streams))
        return n

    def encoder(self, role: str):
        """The encoder of ``role``: the recipe's (:meth:`Recipe.encoder`), fixed by the config."""
        enc = self._encoders.get(role)
        if enc is None:
            enc = self._encoders[role] = self.recipe.encoder(role)
        return enc

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

    def _owners(self, layer, roles, device, stream, site, channels) -> tuple[dict, dict]:
        owners, indices = {}, {}
        for role in roles:
            key = (layer, role, self.rank, stream, site)
            owner = self._owner_keys.get(key)
            if owner is None:  # one key object per entrant: dict lookups hit on identity
                owner = self._owner_keys[key] = scoped_owner(self.config.ownership, *key)
            if not self.stateful(role):  # no bank slot: its scale comes from each call's tensor
                owners[role], indices[role] = owner, -1
                self._dynamic.setdefault(owner, None)
                continue
            width = 0
            encoder = self.encoder(role)
            if encoder.centered:
                if channels is None or role not in channels:
                    raise ValueError(
                        f"layer {layer!r}: role {role!r} is centered, so enter_call needs its channel "
                        "count: pass channels={role: x.shape[-1]}"
                    )
                width = int(channels[role])
            owners[role] = owner
            if self.bank.device is None or owner not in self.bank.index:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise StateTransitionError(
                        f"{owner} is first seen during a CUDA graph capture: registering it reallocates "
                        "the state bank and its first event calibrates on the host, which a replay cannot "
                        "repeat. Run every layer in an eager event first (GraphedStep's warmup)"
                    )
                self.stream_order.structural(device)  # registration reallocates the bank
            indices[role] = self.bank.register(owner, encoder.name, device, width)
        return owners, indices

    def _snapshot(self, owner, role, scale, descale, center, event, region, ordinal) -> QuantSnapshot:
        step, mb = (None, None) if event is None else event
        enc = self._encoders.get(role) or self.encoder(role)
        return QuantSnapshot.stamped(owner, step, mb, region, ordinal, enc.dtype, scale, descale, enc.layout, center)

    def _entrant(self, layer, roles, device, stream, site, channels) -> _Entrant:
        """The owners of one entrant (layer, roles, stream, site), registered, with their bank
        indices and center widths: worked out at its first call and reused while the bank keeps
        its version (a registration, load or move changes it; :meth:`reset` forgets them all).
        Under the lock."""
        roles = roles if type(roles) is tuple else tuple(roles)
        key = (layer, roles, stream, site, None if channels is None else tuple(channels.items()))
        bank = self.bank
        known = self._entrants.get(key)
        if known is not None and known.version == bank.version:
            return known
        owners, indices = (
            self._owners(layer, roles, device, stream, site, channels) if self.config.quantized else ({}, {})
        )
        widths = {role: bank.center_width[i] for role, i in indices.items() if i >= 0}
        known = self._entrants[key] = _Entrant(bank.version, owners, indices, widths, bool(widths))
        return known

    def _new_record(self, ev: _OpenEvent, layer, roles, device, frame, channels) -> CallRecord:
        ident = self._enter_stream(device)
        stream = self._stream_ordinal(ident)
        with self._lock:
            site = ev.sites[(layer, stream)]
            ev.sites[(layer, stream)] = site + 1
            if frame is not None:
                ordinal = frame.next_ordinal(layer)
            else:
                ordinal = ev.top_ordinals[layer]
                ev.top_ordinals[layer] = ordinal + 1
            entrant = self._entrant(layer, roles, device, stream, site, channels)
            owners, indices, widths = entrant.owners, entrant.indices, entrant.widths
            if entrant.banked and (ev.frozen is None or ev.frozen.version != self.bank.version):
                self.stream_order.structural(device)
                ev.frozen = self.bank.freeze()
            frozen = ev.frozen
        if entrant.banked:
            if self.stream_order.active:
                self.stream_order.use(device, frozen.scales)
            scales, descales = frozen.views()
        region = frame.key if frame is not None else None
        event = ev.event
        snapshots = {}
        for role, owner in owners.items():
            i = indices[role]
            if i < 0:  # stateless: stamps now, the scale at the quantize (from its own tensor)
                snapshots[role] = self._snapshot(owner, role, None, None, None, event, region, ordinal)
                continue
            center = frozen.center(i, widths[role]) if widths[role] else None
            snapshots[role] = self._snapshot(owner, role, scales[i], descales[i], center, event, region, ordinal)
        record = CallRecord(event, layer, site, region, ordinal, stream, ident, owners, indices, snapshots)
        self.stash.put(record)
        return record

    def _live_record(self, layer, roles, device, frame, channels) -> CallRecord:
        ident = self._enter_stream(device)
        stream = self._stream_ordinal(ident)
        owners, indices = self._owners(layer, roles, device, stream, 0, channels) if self.config.quantized else ({}, {})
        region = frame.key if frame is not None else None
        snapshots = {
            role: self._live_snapshot(owner, indices[role], None, region, 0, role) for role, owner in owners.items()
        }
        return CallRecord(None, layer, 0, region, 0, stream, ident, owners, indices, snapshots)

    def _live_snapshot(self, owner, index, event, region, ordinal, role, *, copy: bool = True) -> QuantSnapshot:
        if index < 0:  # stateless: no live state, the scale comes at the quantize
            return self._snapshot(owner, role, None, None, None, event, region, ordinal)
        bank = self.bank
        width = bank.center_width[index]
        scale, descale = bank.scale[index], bank.descale[index]
        center = bank.center[index, :width] if width else None
        if copy:
            scale, descale = scale.clone(), descale.clone()
            center = None if center is None else center.clone()
        return self._snapshot(owner, role, scale, descale, center, event, region, ordinal)

    # -- quantize ------------------------------------------------------------------
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
        if self.auditors:  # the quantized operand itself: early stop may never produce the output
            # a stateless scale is re-derived by the recompute from its own input: exact only if
            # that input is bitwise the true forward's, so the auditors compare the input too
            self._observe_operand(record, role, phase, q if self.stateful(role) else (q, x), snap)
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
        ev = self._require_open("keeping a call's state for its backward")
        _KEPT[key] = state
        ev.kept.append((key, state))

    # -- FP8 all-gather of sharded weights (FSDP2: lightning_fp8state.nn.fsdp) ---------
    def _gather_owner(self, layer: str, device: torch.device) -> tuple[object, int]:
        """The weight owner of ``layer``'s one call site (site 0, stream 0), registered."""
        owners, indices = self._owners(layer, ("weight",), device, 0, 0, None)
        return owners["weight"], indices["weight"]

    def gather_weight(self, layer: str, shard: torch.Tensor, group=None) -> tuple[torch.Tensor, QuantSnapshot]:
        """Quantize this rank's shard of ``layer``'s weight for an FP8 all-gather.

        The scale is the event's frozen weight scale (the snapshot the layer's call will use),
        so the gathered codes are bitwise those of quantizing the full weight at that scale.
        Under a per-call weight scale (a stateless recipe) it is the full weight's own, derived
        at :meth:`begin_event` (:meth:`_prepare_gathers`), and nothing is recorded: the codes
        are bitwise the unsharded call's.

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
        ev = self._open
        if layer not in self.gathered_layers:
            raise StateTransitionError(
                f"layer {layer!r} gathers its weight in FP8 but was not prepared for it: call "
                "lightning_fp8state.nn.enable_fp8_all_gather(model) before fully_shard"
            )
        if ev is None:
            if torch.is_grad_enabled() or in_backward():
                raise StateTransitionError(
                    f"layer {layer!r}: its weight was all-gathered for a training forward outside a logical "
                    "event. Wrap forward and backward in `with state.step(step, microbatch)` (the Lightning "
                    "callback does this), or run under torch.no_grad() for evaluation"
                )
            owner, index = self._gather_owner(layer, shard.device)
            snap = self._live_snapshot(owner, index, None, None, 0, "weight")
            if index < 0:  # a per-call scale: the full weight's, one collective for this weight
                scale, descale, amax = self._full_weight_scales({layer: ShardSource(shard.device, shard, group)})[layer]
                snap = replace(snap, scale=scale, descale=descale, amax=amax)
            elif index in self.bank.fresh and self.config.initial_scale == "calibrate":
                self._calibrate_sharded(index, shard, snap, group)
            return self._encode(shard, snap, "weight"), snap
        frame = current_frame()
        if in_backward() or (frame is not None and frame.phase is Phase.RECOMPUTE):
            snap = ev.gathered.get(layer)
            if snap is None:
                raise StateTransitionError(
                    f"layer {layer!r}: its weight is all-gathered in the backward of event {ev.event}, but "
                    "its forward gathered none in this event: no snapshot to re-gather with"
                )
            return self._encode(shard, snap, "weight"), snap
        if layer in ev.gathered:
            raise StateTransitionError(
                f"layer {layer!r}: its weight was all-gathered twice in the forward of event {ev.event}. With "
                "FP8 all-gather a layer is called once per event (one weight owner, one gathered scale); "
                "a layer called at several sites (weight tying, a module reused) needs fp8_all_gather=False"
            )
        owner, index = self._gather_owner(layer, shard.device)  # registered at begin_event
        if index < 0:  # a per-call scale: the full weight's, derived at begin_event
            values = ev.gather_scales.get(layer)
            if values is None:  # unsharded at begin_event: this weight's own collective
                values = self._full_weight_scales({layer: ShardSource(shard.device, shard, group)})[layer]
            scale, descale, amax = values
            snap = self._snapshot(owner, "weight", scale, descale, None, ev.event, None, 0)
            snap = replace(snap, amax=amax)
            ev.gathered[layer] = snap
            return self._encode(shard, snap, "weight"), snap  # nothing to record: no delayed state
        # begin_event's frozen copy holds every gathered weight owner; owners registered later
        # in the event (inputs, in the first event) make the layers' calls freeze a newer copy,
        # with the same values: no commit happens before the forward ends
        frozen = ev.frozen
        snap = self._snapshot(owner, "weight", frozen.scale(index), frozen.descale(index), None, ev.event, None, 0)
        if index in self.bank.fresh and self.config.initial_scale == "calibrate" and index not in ev.calibrated:
            ev.calibrated.add(index)
            self._calibrate_sharded(index, shard, snap, group)
        ev.gathered[layer] = snap
        return self._encode_record(index, shard, snap, "weight"), snap

    def _calibrate_sharded(self, index: int, shard: torch.Tensor, snap: QuantSnapshot, group) -> None:
        """The first scale of a sharded weight from the full weight's amax: the MAX of every
        rank's shard amax (one all-reduce; an owner's first event only)."""
        amax = self.bank.amax_of(shard) if shard.numel() else torch.zeros(1, device=shard.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        self.bank.calibrate_from_amax(index, amax, snap.scale, snap.descale, self.config.margin)

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
        owner = record.owners[role]
        if snap.owner != owner:
            raise StateTransitionError(
                f"layer {record.layer!r}: its all-gathered FP8 weight belongs to {snap.owner}, this call is "
                f"{owner}: with FP8 all-gather a layer is called once per event; a layer called at several "
                "sites (weight tying, a module reused) needs fp8_all_gather=False"
            )
        if phase is not Phase.INFERENCE:
            event = self._require_open(f"adopting {owner}'s operand").event
            if snap.event != event:
                raise StaleSnapshotError(
                    f"{owner}: the all-gathered FP8 weight was quantized in event {snap.event}, this is event "
                    f"{event}: a weight gathered in one event cannot serve another"
                )
            if phase is Phase.RECOMPUTE:
                self.ledger.recompute_read(event, owner)
            else:
                self._observe(record, role, event, recompute=False)
                if record.indices[role] < 0:  # a per-call scale: the owner's latest (telemetry)
                    with self._lock:
                        self._dynamic[owner] = snap
        record.used[role] = snap
        if self.auditors:
            self._observe_operand(record, role, phase, data, snap)
        return data, snap

    def _encode(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue: Prologue | None = None):
        """Quantize with ``snap``, recording nothing."""
        self.stream_order.use(x.device, snap.scale)
        return self.encoder(role).encode(x, snap, prologue)

    def _discard_slot(self, device: torch.device, width: int) -> _Scratch:
        """Scratch statistics (amax ``[1]``, center max/min ``[1, width]``) that recompute
        records into and nobody reads: see :meth:`_encode_discard`."""
        key = (device, width)
        slot = self._discard.get(key)
        if slot is None:
            f32 = {"dtype": torch.float32, "device": device}
            # allocated during a recompute, which SAC must not see (its true forward did not)
            slot = outside_selective_checkpoint(
                lambda: _Scratch(torch.zeros(1, **f32), torch.zeros(1, width, **f32), torch.zeros(1, width, **f32))
            )
            slot = self._discard.setdefault(key, slot)
        return slot

    def _encode_discard(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Recompute's quantize: the true forward's own op (``*_record_amax``, same codes as the
        non-recording op) with ``snap``, its statistics folded into a scratch slot that is
        never read or committed. Issuing the same op as the true forward keeps the op sequence
        identical, which torch's selective activation checkpointing (SAC) requires: it numbers
        ops per overload and replays its saved outputs by that number (a policy may even save
        these codes). The bank is not touched: recompute stays read-only."""
        scratch = self._discard_slot(x.device, 0 if snap.center is None else snap.center.shape[-1])
        self.stream_order.use(x.device, scratch.amax_pending, snap.scale)
        return self.encoder(role).encode_record(x, snap, scratch, 0, prologue)

    def _encode_record(self, index: int, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Quantize with ``snap`` and record into owner ``index``'s pending statistics.

        Under the lock: a registration on another thread must not swap the pending buffers
        between reading them here and the record landing in them.
        """
        with self._lock:
            bank = self.bank
            self.stream_order.use(x.device, bank.amax_pending, snap.scale)
            return self.encoder(role).encode_record(x, snap, bank, index, prologue)

    def _quantize(self, record: CallRecord, role: str, x: torch.Tensor, phase: Phase, prologue=None):
        owner = record.owners[role]
        index = record.indices[role]
        if phase is Phase.INFERENCE:
            if index < 0:
                return self._quantize_dynamic(record, role, x, phase, None, prologue)
            snap = record.snapshots[role]  # a private copy of the live state
            if self._policy is None:
                self._calibrate_first_use(None, index, x, snap, role, prologue)
            return self._encode(x, snap, role, prologue), snap
        ev = self._open
        event = (ev if ev is not None else self._require_open(f"quantizing {owner}")).event
        if index < 0:
            return self._quantize_dynamic(record, role, x, phase, event, prologue)
        if self._policy is not None:
            return self._policy.quantize(self, record, role, x, phase, event, prologue)
        snap = record.snapshots[role]
        encoder = self._encoders.get(role) or self.encoder(role)
        order = self.stream_order
        if phase is Phase.RECOMPUTE:  # read-only: _encode_discard's body
            self.ledger.recompute_read(event, owner)
            held = record.derived.get(_CODES) if role == "weight" else None  # (kept if weight_codes_once)
            if (
                held is not None
                and held[1] is snap
                and held[2] is prologue
                and held[0] == _parameter_key(x)
                and not in_selective_checkpoint()  # SAC numbers the ops: the recompute issues them all
            ):
                return held[3], snap  # the true forward's codes of this weight, at this snapshot
            scratch = self._discard_slot(x.device, 0 if snap.center is None else snap.center.shape[-1])
            if order.active:
                order.use(x.device, scratch.amax_pending, snap.scale)
            return encoder.encode_record(x, snap, scratch, 0, prologue), snap
        # the true forward: _observe's and _encode_record's bodies, one lock
        if role in FORWARD_ROLES:
            self.guard.enter(owner, record.stream_ident, stream_scoped=self._stream_scoped)
        self.ledger.observe(event, owner, call_site=(record.layer, record.site), recompute=False)
        with self._lock:
            ev.observed.setdefault(owner, index)
        if index in self.bank.fresh:  # the first event only; its ops are unseen by SAC
            outside_selective_checkpoint(self._calibrate_first_use, ev.calibrated, index, x, snap, role, prologue)
        with self._lock:  # a registration on another thread must not swap the pending buffers meanwhile
            bank = self.bank
            if order.active:
                order.use(x.device, bank.amax_pending, snap.scale)
            data = encoder.encode_record(x, snap, bank, index, prologue)
        if role == "weight" and self.recipe.weight_codes_once and record.layer not in self.sharded_layers:
            # for the recompute: the same parameter, snapshot and stage give these codes
            record.derived[_CODES] = (_parameter_key(x), snap, prologue, data)
        return data, snap

    def _quantize_dynamic(self, record: CallRecord, role: str, x: torch.Tensor, phase: Phase, event, stage=None):
        """A stateless role: the recipe's encoder derives the scale from ``x`` itself and returns
        it with the data; the snapshot is the record's stamps with that scale, descale and amax.
        The ledger counts the call (an observation, or a recompute's read); nothing is recorded
        into the bank, so a recompute is read-only by construction (the rules 4 and 5 hold
        trivially), and it is exact when its input is bitwise the true forward's (audited)."""
        owner = record.owners[role]
        if phase is Phase.RECOMPUTE:
            self.ledger.recompute_read(event, owner)
        elif phase is Phase.FORWARD:
            self._observe(record, role, event, recompute=False)
        if stage is not None and isinstance(stage, Prologue):  # a recipe that does not fuse it
            x = stage.apply(x)
            stage = None
        data, scale, descale, amax = self.encoder(role).encode_dynamic(x, stage)
        snap = replace(record.snapshots[role], scale=scale, descale=descale, amax=amax)
        if phase is Phase.FORWARD:
            with self._lock:
                self._dynamic[owner] = snap
        return data, snap

    def _calibrate_first_use(
        self, calibrated: set | None, index: int, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None
    ) -> None:
        """``initial_scale="calibrate"``: an owner with no delayed scale yet gets one from this
        call's own tensor, written into the frozen cells its snapshot views before anything
        reads them (once per event: every later call of the owner in the event, and every
        recompute, reads the same value). Host-side check; the calibration runs on the device."""
        if index not in self.bank.fresh or self.config.initial_scale != "calibrate":
            return
        if calibrated is not None:
            if index in calibrated:
                return
            calibrated.add(index)
        x = self.encoder(role).source(x, prologue)  # the first event only: the prologue's output
        with self._lock:
            self.stream_order.use(x.device, snap.scale)
            self.bank.calibrate(index, x, snap.scale, snap.descale, self.config.margin, snap.center)

    def _observe(self, record: CallRecord, role: str, event: Event, *, recompute: bool) -> None:
        owner = record.owners[role]
        if role_phase(role) == "forward" and not recompute:
            self.guard.enter(owner, record.stream_ident, stream_scoped=self._stream_scoped)
        self.ledger.observe(event, owner, call_site=(record.layer, record.site), recompute=recompute)
        with self._lock:
            self._open.observed.setdefault(owner, record.indices[role])

    def _commit_now(self, owner, index: int, event: Event) -> None:
        """Commit one owner at once (for quantize policies; the rules commit in batches at
        :meth:`commit_forward` and :meth:`end_event`)."""
        with self._lock:
            self.stream_order.structural(self.bank.device)
            self.bank.commit((index,), self.config.amax_algo, self.config.margin, self.config.attn_center_momentum)
            self._open.committed.add(owner)
        self.ledger.commit(event, [owner])

    # -- the quantize-policy interface (defects.py: the seed's defects, for the audit) ----
    # What a policy handed to the constructor may do in place of the rules. Public and stable:
    # the policies use these and nothing private.
    def observe(self, record: CallRecord, role: str, event: Event, *, recompute: bool) -> None:
        """Count one call of ``role``'s owner in the ledger (an observation, or with
        ``recompute`` a recompute's observation) and mark the owner observed in the event."""
        self._observe(record, role, event, recompute=recompute)

    def live_snapshot(self, record: CallRecord, role: str, event: Event) -> QuantSnapshot:
        """A snapshot of ``role``'s owner holding a *copy* of its live (not frozen) state,
        stamped with ``record``'s region and ordinal."""
        owner, index = record.owners[role], record.indices[role]
        return self._live_snapshot(owner, index, event, record.region, record.ordinal, role, copy=True)

    def encode_record(self, record: CallRecord, role: str, x: torch.Tensor, snap: QuantSnapshot, prologue=None):
        """Encode ``x`` with ``snap`` and record its amax into the owner's pending slot."""
        return self._encode_record(record.indices[role], x, snap, role, prologue)

    def encode_discard(self, x: torch.Tensor, snap: QuantSnapshot, role: str, prologue=None):
        """Encode ``x`` with ``snap`` through the recording op, its statistics discarded
        (recompute's encode: the same op sequence as the true forward, the bank untouched)."""
        return self._encode_discard(x, snap, role, prologue)

    def commit_now(self, record: CallRecord, role: str, event: Event) -> None:
        """Commit ``role``'s owner at once (the rules commit in batches at :meth:`commit_forward`
        and :meth:`end_event`)."""
        self._commit_now(record.owners[role], record.indices[role], event)

    # -- audit ---------------------------------------------------------------------
    def _observe_operand(self, record: CallRecord, role: str, phase: Phase, data, snap: QuantSnapshot) -> None:
        """Hand one quantized operand (FP8 codes, or FP4 ``(packed, block_scales)``) and its
        snapshot to the auditors that compare operands (``observe_operand``)."""
        for auditor in self.auditors:
            observe = getattr(auditor, "observe_operand", None)
            if observe is not None:  # the auditors' copies: unseen by SAC
                outside_selective_checkpoint(observe, record, role, phase, data, snap)

    def observe_output(self, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
        """Hand one module output (a tensor, or a tuple of tensors) and the snapshots it
        consumed (a copy of ``snaps``, taken only when an auditor is attached) to the auditors."""
        if not self.auditors:
            return
        snaps = dict(snaps)
        for auditor in self.auditors:  # the auditors' copies: unseen by SAC
            outside_selective_checkpoint(auditor.observe, record, phase, output, snaps)


def take_kept(key: int):
    """The state :meth:`QuantProtocol.keep_for_backward` kept under ``key``, handed out once.

    Raises:
        StateTransitionError: none kept (the backward runs after its event ended, or a second
            time, or for a call that built no graph).
    """
    state = _KEPT.pop(key, None)
    if state is None:
        raise StateTransitionError(
            "a compiled Fp8Linear's backward found no state for its call: its event ended before the "
            "backward ran, or the backward ran twice. Run backward inside the event of its forward "
            "(`with state.step(...)`), once per forward"
        )
    return state
