"""Per-layer fallback (``QuantConfig.fallback``, opt-in).

A layer that FP8 fails on is moved at an event's end, on every rank at once, and stays moved:
to high precision (``fallback_to="bf16"``) or to FP8 scaled from each call's own amax
(``fallback_to="current"``: the ``fp8_current`` recipe's route for that layer only, with no
delayed state to go stale). The moved layers, with the step, the reason and the target of each
move, are part of the quantizer state (saved in checkpoints, restored on resume).

How a moved layer runs is a per-layer recipe override, :attr:`FallbackMonitor.routes` (layer ->
the :class:`~lightning_fp8state.quant_recipes.Recipe` its calls ask; the protocol's
``layer_recipes``): ``Fp8Linear``, the call records (owners, snapshots) and the quantizer read
it where they read the protocol's recipe. Under ``current`` the layer's roles are stateless
owners of the same keys: stamped snapshots, counted in the ledger, committed there only, and a
recompute re-derives its scale from its own input, recording nothing (as under ``fp8_current``).
Its delayed owners stay in the bank, never observed again (their history is frozen). Only a
layer whose module runs that route moves (:attr:`FallbackMonitor.movable`: ``Fp8Linear``,
``Fp8Conv1D`` and the attention projections add their own); experts and FP4 attention operands are
watched, not moved.

Two triggers, both measured on the device while the event runs (no host sync in a call):

- non-finite: a true-forward call whose output holds a non-finite value while the pending amaxes
  of its quantized operands (input, weight) are finite. The fault starts in that layer's FP8 call
  (a descale product that overflows float32, say), not upstream of it; the layers downstream,
  whose amaxes turn non-finite as a consequence, are not moved.
- saturation: an operand (input, weight, grad_output) with more than ``fallback_saturation`` of
  its elements clamped to ``±fmax`` by the encode in ``fallback_patience`` consecutive events
  (``|x * scale| > fmax``, counted by the quantize kernels into ``StateBank.saturation``: the
  event's counts are the counters' growth since the previous event's end).

At the event's end the per-layer flags are stacked into one vector, MAX-reduced across the
data-parallel group (the amax reduction's group; ranks register the same layers in the same
order, which that reduction checks) and read on the host once: the one host read per event.
Under per-block CUDA graphs both triggers see replayed calls (the non-finite flags and the
saturation counters are buffers updated in place, which the graphs hold); a move bumps
:attr:`FallbackMonitor.version`, and ``GraphedBlocks`` captures again once at its next pass. The
whole-step ``GraphedStep`` captures the event's end too: there the decision is deferred
(:meth:`FallbackMonitor.decide` reads nothing while a CUDA graph captures) and taken by
``GraphedStep`` after each replay (:meth:`FallbackMonitor.decide_replayed`), which captures again
once after a move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import FALLBACK_TARGETS
from ..encoders import ACTIVATIONS, NORMS
from ..errors import StateLoadError
from ..quant_recipes import recipe_class
from ..recompute import Phase

__all__ = ["FallbackEvent", "FallbackMonitor"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
REASONS = ("nonfinite", "saturation")
# fallback_to -> the recipe a moved layer's calls run (FALLBACK_TARGETS)
TARGET_RECIPES = {"bf16": "bf16", "current": "fp8_current"}
_VALUE_PROLOGUES = (*NORMS, *ACTIVATIONS)


@dataclass(frozen=True)
class FallbackEvent:
    """One layer moved: at the end of ``step``'s event (``microbatch``), why, and to what."""

    layer: str
    step: int
    microbatch: int
    reason: str  # "nonfinite" | "saturation"
    target: str = "bf16"  # QuantConfig.fallback_to when it moved: "bf16" | "current"


def _capturing(device: torch.device | None) -> bool:
    """Whether the current CUDA stream of the bank's device is capturing a graph (a host read
    would be illegal now)."""
    return device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _codes(q) -> torch.Tensor | None:
    """The FP8 codes of a quantize result (a tensor, or a stage's tuple whose first item is
    the codes); None for what holds none (FP4 packed bytes, high-precision operands)."""
    if isinstance(q, tuple):
        q = q[0] if q else None
    if isinstance(q, torch.Tensor) and q.dtype in _FP8_DTYPES:
        return q
    return None


class FallbackMonitor:
    """Watches one protocol's calls for the fallback's triggers and decides at each event's end.

    Args:
        protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` (its config, bank and
            amax reducer are read per use: each may be replaced).
    """

    def __init__(self, protocol) -> None:
        self._protocol = protocol
        config = protocol.config
        self.on_nonfinite = config.fallback_on_nonfinite
        self.threshold = config.fallback_saturation
        self.patience = config.fallback_patience
        self.target = config.fallback_to
        # layer -> the step of the event at whose end it fell back: the set the calls read
        self.fallen: dict[str, int] = {}
        # layer -> the recipe its calls run from then on (the protocol's layer_recipes)
        self.routes: dict[str, object] = {}
        self._recipes: dict[str, object] = {}  # target -> its recipe, bound to the config (one each)
        self.deferred: tuple[int, int] | None = None  # an event whose decision a CUDA graph capture deferred
        # the layers whose module runs the route a move gives it (Fp8Linear adds its own): only those
        # move; another converted module (FP4 attention operands, experts) would ignore the
        # route, or find its owners gone under bf16, so it is watched but not moved
        self.movable: set[str] = set()
        self.events: list[FallbackEvent] = []
        self.streaks: dict[str, int] = {}  # layer -> consecutive saturated events so far
        self.version = 0  # +1 at every move (CUDA graphs captured before it are stale)
        self._slots: dict[str, int] = {}  # layer -> its place in the decision's vector, first-seen order
        # layer -> bool, the non-finite trigger: one buffer per layer for the run, updated and zeroed
        # in place, so that a CUDA graph captured over the calls updates the same buffers at replay
        self._bad_output: dict[str, torch.Tensor] = {}
        # layer -> the bank indices of its FP8 operands; the counters at the last event's end
        self._owners: dict[str, set[int]] = {}
        # (bank indices, their layers' slots) as device tensors, made again when _owners grows
        self._owner_map: tuple[torch.Tensor, torch.Tensor] | None = None
        self._seen: torch.Tensor | None = None
        self._clear_event()

    def _clear_event(self) -> None:
        for flag in self._bad_output.values():
            flag.zero_()

    def _event_counts(self) -> torch.Tensor:
        """``[2, n]``: the saturation counters' growth since the last event's end (this event's
        clipped and encoded elements per owner); the next event counts from here. A counter
        that went back (a bank built afresh by a load) counts from zero."""
        sat = self._protocol.bank.saturation
        seen = self._baseline(sat)
        grown = torch.where(sat >= seen, sat - seen, sat)
        seen.copy_(sat)
        return grown

    def _baseline(self, sat: torch.Tensor) -> torch.Tensor:
        """The counters' values at the last event's end, shaped as the bank's now (an owner
        registered since then starts from zero: its counters did too)."""
        seen = self._seen
        if seen is None or seen.shape != sat.shape or seen.device != sat.device:
            grown = torch.zeros_like(sat)
            if seen is not None:
                k = min(seen.shape[1], sat.shape[1])
                grown[:, :k] = seen[:, :k].to(sat.device)
            seen = self._seen = grown
        return seen

    def reset(self) -> None:
        """Forget every move and streak (the protocol's ``reset``: a fresh state)."""
        self.fallen.clear()
        self.routes.clear()
        self.events.clear()
        self.streaks.clear()
        self._slots.clear()
        self.deferred = None
        self._bad_output = {}
        self._owners = {}
        self._owner_map = None
        self._seen = None
        self._clear_event()

    # -- in the calls (device work only) ----------------------------------------------------
    def _slot(self, layer: str) -> None:
        if layer not in self._slots:
            self._slots[layer] = len(self._slots)

    def observe_operand(self, record, role: str, phase: Phase, x: torch.Tensor, q, snap, prologue) -> None:
        """Note that ``role``'s owner belongs to ``record``'s layer (host only: the quantize kernel
        counts its clipped elements into the bank's saturation counters, in eager calls and CUDA
        graph replays alike; a recompute counts into a scratch counter, never twice). What a
        fused prologue encodes is its output, and that is what the kernel counts."""
        index = record.indices.get(role, -1)
        if phase is not Phase.FORWARD or index < 0:  # stateless: no delayed scale
            return
        if _codes(q) is None:
            return
        self._slot(record.layer)
        indices = self._owners.setdefault(record.layer, set())
        if index not in indices:
            indices.add(index)
            self._owner_map = None

    def observe_output(self, record, phase: Phase, output) -> None:
        """Flag ``record``'s layer when its output is not finite while its operands' pending
        amaxes are (true-forward calls only)."""
        if not self.on_nonfinite or phase is not Phase.FORWARD:
            return
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        self._slot(record.layer)
        # on the detached output: torch.isfinite is composite (abs, compare) and would save the
        # output for a backward, so a checkpointed true forward saved one tensor more than its
        # recompute (which skips this) and torch's checkpoint refused the recompute
        bad = ~torch.isfinite(out.detach()).all()
        pending = self._protocol.bank.amax_pending
        for role in ("input", "weight"):
            index = record.indices.get(role, -1)
            if index >= 0:  # (a view per owner: no index tensor copied to the device)
                bad = bad & torch.isfinite(pending[index]).to(bad.device)
        flag = self._bad_output.get(record.layer)
        if flag is None or flag.device != bad.device:
            flag = self._bad_output[record.layer] = torch.zeros((), dtype=torch.bool, device=bad.device)
        flag.logical_or_(bad)

    # -- at the event's end (one host read) -------------------------------------------------
    def _flags(self) -> torch.Tensor | None:
        """``[2, layers]`` float32: per layer, its output went non-finite; it saturated."""
        grown = self._event_counts()
        if not self._slots:
            return None
        device = grown.device
        flags = torch.zeros(2, len(self._slots), dtype=torch.float32, device=device)
        for layer, bad in self._bad_output.items():
            flags[0, self._slots[layer]] = bad.to(device, torch.float32)
        if self._owners:
            clipped, elements = grown.to(torch.float64)
            over = ((clipped / elements.clamp(min=1)) > self.threshold).to(torch.float32)  # per owner, this event
            owners, slots = self._owner_slots(device)
            flags[1].scatter_reduce_(0, slots, over[owners], reduce="amax")  # a layer: any of its owners
        return flags

    def _owner_slots(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Every watched owner's bank index and its layer's slot, as device tensors (one copy
        when a layer meets an owner it had not, none per event)."""
        cached = self._owner_map
        if cached is None or cached[0].device != device:
            owners, slots = [], []
            for layer, indices in self._owners.items():
                owners += sorted(indices)
                slots += [self._slots[layer]] * len(indices)
            cached = (torch.tensor(owners, device=device), torch.tensor(slots, device=device))
            self._owner_map = cached
        return cached

    def _reduce(self, flags: torch.Tensor) -> torch.Tensor:
        """MAX over the data-parallel group (the amax reduction's), where there is one."""
        if not (dist.is_available() and dist.is_initialized()):
            return flags
        reducer = self._protocol.amax_reducer
        group = reducer.group if reducer is not None else None
        if dist.get_world_size(group) < 2:
            return flags
        if reducer is not None and reducer.device is not None and flags.device != reducer.device:
            flags = flags.to(reducer.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return flags

    def decide(self, event: tuple[int, int]) -> list[FallbackEvent]:
        """Move the layers this event's flags name (every rank the same: the flags are reduced
        first); returns the moves. The event's counts are cleared.

        While the current CUDA stream captures a graph (``GraphedStep`` captures the event's end)
        nothing is read or cleared: the graph's replays update the flags in place, and
        :meth:`decide_replayed` decides after each replay; the event is kept in :attr:`deferred`."""
        if _capturing(self._protocol.bank.device):
            self.deferred = (int(event[0]), int(event[1]))
            return []
        flags = self._flags()
        self._clear_event()
        if flags is None:
            return []
        nonfinite, saturated = self._reduce(flags).cpu().tolist()  # the one host read of the event
        moves = []
        for layer, slot in self._slots.items():
            if layer in self.fallen or layer not in self.movable:
                continue
            self.streaks[layer] = self.streaks.get(layer, 0) + 1 if saturated[slot] else 0
            reason = "nonfinite" if nonfinite[slot] else "saturation" if self.streaks[layer] >= self.patience else None
            if reason is not None:
                moves.append(FallbackEvent(layer, int(event[0]), int(event[1]), reason, self.target))
        self._apply(moves)
        return moves

    def decide_replayed(self, event: tuple[int, int]) -> list[FallbackEvent]:
        """The decision of ``event``, run from a CUDA graph whose capture deferred it (see
        :meth:`decide`): the flags its replay left, read once, as at an eager event's end."""
        self.deferred = None
        return self.decide(event)

    def _apply(self, moves: list[FallbackEvent]) -> None:
        """Record ``moves``: each layer's route from now on (its target's recipe), the events."""
        for move in moves:
            self.fallen[move.layer] = move.step
            self.routes[move.layer] = self._recipe_of(move.target)
            self.streaks.pop(move.layer, None)
        if moves:
            self.events.extend(moves)
            self.version += 1

    def _recipe_of(self, target: str):
        """The recipe a layer moved to ``target`` runs (one instance per target, on this config)."""
        recipe = self._recipes.get(target)
        if recipe is None:
            recipe = self._recipes[target] = recipe_class(TARGET_RECIPES[target])(self._protocol.config)
        return recipe

    def discard(self) -> None:
        """Drop an aborted event's counts."""
        self._event_counts()
        self._clear_event()

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain values: the moves (layer, step, microbatch, reason, target), the streaks, the
        layers' order."""
        return {
            "events": [[e.layer, e.step, e.microbatch, e.reason, e.target] for e in self.events],
            "streaks": dict(self.streaks),
            "layers": list(self._slots),
        }

    @staticmethod
    def validate_state_dict(sd) -> list[FallbackEvent]:
        """The saved moves, checked.

        Raises:
            StateLoadError: not the shape :meth:`state_dict` writes.
        """
        try:
            # (a move saved before targets existed has four fields: it went to bf16)
            events = [
                FallbackEvent(str(a), int(b), int(c), str(d), *map(str, rest)) for a, b, c, d, *rest in sd["events"]
            ]
            streaks_ok = all(isinstance(k, str) and int(v) >= 0 for k, v in sd["streaks"].items())
            layers_ok = all(isinstance(n, str) for n in sd["layers"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateLoadError(f"saved quantizer state is corrupt: 'fallback' ({exc!r})") from exc
        if not (streaks_ok and layers_ok) or any(
            e.reason not in REASONS or e.target not in FALLBACK_TARGETS for e in events
        ):
            raise StateLoadError("saved quantizer state is corrupt: 'fallback' holds unknown reasons, targets or names")
        return events

    def load_state_dict(self, sd) -> None:
        """Restore :meth:`state_dict`'s values (validated first); a move restored counts as one
        for CUDA graphs (``version``; any restore does, moves or not)."""
        events = self.validate_state_dict(sd)
        self.reset()
        self._apply(events)  # each restored layer runs its own saved target, whatever fallback_to says now
        self.streaks.update({k: int(v) for k, v in sd["streaks"].items()})
        self._slots.update({name: i for i, name in enumerate(sd["layers"])})
        self.version += 1
