"""The open event of a :class:`~lightning_fp8state.protocol.QuantProtocol` and its commits.

An event (one step × microbatch) is opened by ``begin_event`` and closed by ``end_event`` or
``abort_event``; in between, :class:`OpenEvent` collects what its calls did on the host
(owners observed and committed, call sites, the frozen scales). :class:`Commits` advances
the observed owners in batches (rule 4: one commit per owner per event), reducing their
pending amaxes across data-parallel ranks right before, where the config asks for it. The
state a compiled call keeps for its backward (:func:`keep`, :func:`take_kept`) lives until
its event closes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import QuantConfig
from ..errors import ConfigError, StateTransitionError
from ..quant_recipes import Recipe
from ..state import BACKWARD_ROLES, FORWARD_ROLES, AmaxReducer, Event, FrozenScales

__all__ = ["Commits", "OpenEvent", "keep", "release_kept", "require_open", "take_kept"]

# keep_for_backward: key -> a call's host-side state, across protocols (a backward names only the key)
_KEPT: dict[int, object] = {}


@dataclass
class OpenEvent:
    """What the open event's calls did on the host so far (one per event, dropped at its close)."""

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


def require_open(ev: OpenEvent | None, what: str) -> OpenEvent:
    """``ev``, the open event; ``what`` names the step that needs one in the error.

    Raises:
        StateTransitionError: no event is open.
    """
    if ev is None:
        raise StateTransitionError(f"{what} outside a logical event: call it inside `with state.step(...)`")
    return ev


def _roles_of(phases: set[str]) -> set[str]:
    """The roles of ``phases`` (``"forward"``, ``"backward"``)."""
    return (FORWARD_ROLES if "forward" in phases else set()) | (BACKWARD_ROLES if "backward" in phases else set())


def check_reduction_roles(config: QuantConfig) -> None:
    """Fail at construction on a role ``config.amax_reduction`` names that no layer has.

    Raises:
        ConfigError: an unknown role (neither a forward or backward role nor ``"*"``).
    """
    unknown = sorted({r for r, _ in config.amax_reduction} - FORWARD_ROLES - BACKWARD_ROLES - {"*"})
    if unknown:
        raise ConfigError(
            f"amax_reduction names unknown role(s) {unknown}: expected roles from "
            f"{sorted(FORWARD_ROLES | BACKWARD_ROLES)} or '*'"
        )


def data_parallel_reducer(
    config: QuantConfig, recipe: Recipe, *, group=None, device: torch.device | None = None
) -> AmaxReducer | None:
    """The reducer of pending amaxes across the data-parallel ``group`` for the roles
    ``config.amax_reduction`` marks ``data_parallel``, or None where there is nothing to
    reduce: no initialized process group of more than one rank, the bf16 recipe, or no
    stateful role that reduces (a stateless role has no pending amax)."""
    roles = {r for r in FORWARD_ROLES | BACKWARD_ROLES if recipe.stateful(r)}  # stateless: nothing pends
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    if not recipe.quantized or not any(config.reduction_of(r) == "data_parallel" for r in roles):
        return None
    return AmaxReducer(config.reduction_of, group=group, device=device)


class Commits:
    """Advances a protocol's observed owners: in batches at ``commit_forward`` and the event's
    end (the rules), or one at once (a quantize policy's ``commit_now``)."""

    def __init__(self, protocol) -> None:
        """
        Args:
            protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` whose bank, ledger,
                open event and ``amax_reducer`` it reads (each may be replaced: read per use).
        """
        self._protocol = protocol
        self._config = protocol.config
        self._recipe = protocol.recipe
        self._lock = protocol._lock
        self._guard = protocol.guard
        self._stream_order = protocol.stream_order
        self._rules = protocol._policy is None  # a defect policy never reduces

    def reduces(self, phases: set[str]) -> bool:
        """Whether a role of ``phases`` has its pending amax reduced across ranks before commit."""
        reducer = self._protocol.amax_reducer
        if reducer is None or not self._rules or not self._recipe.quantized:
            return False
        return any(reducer.reduces(r) for r in _roles_of(phases))

    def commit(self, ev: OpenEvent, phases: set[str], *, reduce_phases: set[str]) -> None:
        """Commit the owners of ``phases`` observed in ``ev`` and not committed yet, in one
        batched bank update, after reducing the pending amaxes of ``reduce_phases``' roles."""
        protocol = self._protocol
        config = self._config
        with self._lock:
            # (the roles of ``phases``, looked up once: an observed owner's role is a known one)
            roles = _roles_of(phases)
            committed = ev.committed
            owners = [o for o in ev.observed if o.role in roles and o not in committed]
            # a stateless owner (index -1) commits in the ledger only: it has no bank state
            indices = tuple(i for i in (ev.observed[o] for o in owners) if i >= 0)
            # The collective runs whenever a role of ``reduce_phases`` reduces, even with
            # nothing to commit here: every rank must reach it at the same points.
            bank = protocol.bank
            self._stream_order.structural(bank.device)
            if self.reduces(reduce_phases):
                protocol.amax_reducer.reduce(bank, indices)
            if not owners:
                return
            if indices:
                bank.commit(indices, config.amax_algo, config.margin, config.attn_center_momentum)
            ev.committed.update(owners)
            self._guard.release(owners)
            protocol.ledger.commit(ev.event, owners)

    def commit_now(self, owner, index: int, event: Event) -> None:
        """Commit one owner at once (for quantize policies; the rules commit in batches at
        ``commit_forward`` and ``end_event``)."""
        protocol = self._protocol
        config = self._config
        with self._lock:
            bank = protocol.bank
            self._stream_order.structural(bank.device)
            bank.commit((index,), config.amax_algo, config.margin, config.attn_center_momentum)
            protocol._open.committed.add(owner)
        protocol.ledger.commit(event, [owner])

    def discard_pending(self, ev: OpenEvent) -> None:
        """Drop the pending amaxes of the owners ``ev`` observed and did not commit (an abort)."""
        with self._lock:
            bank = self._protocol.bank
            pending = tuple(i for o, i in ev.observed.items() if o not in ev.committed and i >= 0)
            if pending:
                self._stream_order.structural(bank.device)
            bank.discard_pending(pending)


def keep(ev: OpenEvent, key: int, state) -> None:
    """Hold ``state`` under ``key`` for a backward, until :func:`take_kept` or ``ev`` closes."""
    _KEPT[key] = state
    ev.kept.append((key, state))


def release_kept(ev: OpenEvent) -> None:
    """Drop what ``ev`` kept and no backward took (checkpointed true forwards)."""
    for key, state in ev.kept:
        if _KEPT.get(key) is state:
            del _KEPT[key]


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
