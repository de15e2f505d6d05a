"""Owners and call records: who a call is (rule 1) and which snapshot it reads (rule 2).

A call of a layer enters on a stream at a call site; :class:`CallRecords` gives it an owner
per role (layer × role × rank × stream × site, scoped by ``config.ownership``), registered
in the bank at its first call, and a :class:`~lightning_fp8state.recompute.CallRecord` that
pairs the owners with their snapshots: views of the open event's frozen scales for a true
forward, copies of the live state outside an event. It also keeps the stateless roles'
owners (no bank slot), each with its latest true-forward snapshot, for telemetry.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import require_that
from ..errors import StateTransitionError
from ..recompute import CallRecord
from ..state import QuantSnapshot, current_stream_ident, scoped_owner
from .events import OpenEvent

__all__ = ["CallRecords", "recompute_may_follow"]


def recompute_may_follow(region: tuple | None) -> bool:
    """Whether a recompute of a call entered now may run in its event, so that its weight codes
    are worth holding (``QuantConfig.weight_codes_once``): inside a checkpoint region of ours,
    under saved-tensor hooks (torch's non-reentrant checkpoint, SAC, FSDP2's wrapper) or with
    gradients off (a reentrant checkpoint's forward runs so; so does evaluation). Otherwise plain
    autograd keeps what the backward reads and no recompute can come: held codes would only add a
    byte per weight element to the peak (Mixtral's experts: 1.4 GB). A recompute that came anyway
    encodes the weight again from the same snapshot: the same codes, one pass later."""
    if region is not None or not torch.is_grad_enabled():
        return True
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top_hooks is None or top_hooks(False) is not None  # (a torch without the query: keep them)


class _Entrant(NamedTuple):
    """One entrant's owners as registered in the bank at ``version`` (shared by its call
    records, which never change them)."""

    version: int
    owners: dict  # role -> OwnerKey
    indices: dict  # role -> bank index (-1: stateless)
    widths: dict  # role -> center width, for the banked roles
    banked: bool  # any role has bank state
    recipe: object  # the recipe its roles were registered under (a fallback move changes it)


class CallRecords:
    """The owners of a protocol's calls and the records that pair them with snapshots."""

    def __init__(self, protocol) -> None:
        """
        Args:
            protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` whose bank it
                registers owners in (read per use: :meth:`QuantProtocol.reset` replaces it),
                and whose encoders say each role's format.
        """
        self._protocol = protocol
        self._config = protocol.config
        self._recipe = protocol.recipe
        self._rank = protocol.rank
        self._lock = protocol._lock
        self._stash = protocol.stash
        self._stream_order = protocol.stream_order
        self._encoders = protocol._encoders  # role -> encoder, filled by protocol.encoder
        self._encoder = protocol.encoder
        self._stateful = protocol.stateful
        # layer -> the recipe a moved layer runs (QuantConfig.fallback; empty: every layer runs _recipe)
        self._layer_recipes = protocol.layer_recipes
        self._streams: dict[tuple, int] = {}
        self._owner_keys: dict[tuple, object] = {}  # (layer, role, rank, stream, site) -> OwnerKey
        self.reset()

    def reset(self) -> None:
        """Forget the registered entrants and stateless owners (the bank is new: under the lock)."""
        # Owners of stateless roles (their scale from each call's own tensor: no bank slot), in
        # order of registration, each with its latest true-forward snapshot (telemetry reads it).
        self.dynamic: dict = {}  # OwnerKey -> QuantSnapshot | None
        # (layer, roles, stream, site, channels) -> its owners as registered (_entrant)
        self._entrants: dict[tuple, _Entrant] = {}

    def dynamic_snapshots(self) -> dict:
        """See :meth:`QuantProtocol.dynamic_snapshots`."""
        with self._lock:
            return {o: s for o, s in self.dynamic.items() if s is not None}

    # -- who a call is --------------------------------------------------------------
    def recipe_of(self, layer: str):
        """The recipe ``layer``'s calls run: the protocol's, or a fallback move's target."""
        routes = self._layer_recipes
        return routes.get(layer, self._recipe) if routes else self._recipe

    def encoder_of(self, layer: str, role: str):
        """``role``'s encoder in ``layer``'s calls (the protocol's cached one, unless moved)."""
        recipe = self.recipe_of(layer)
        if recipe is self._recipe:
            return self._encoders.get(role) or self._encoder(role)
        return recipe.encoder(role)

    def _enter_stream(self, device: torch.device) -> tuple:
        """The entrant's identity (``current_stream_ident``), noting its CUDA stream for the
        cross-stream ordering; the current stream is looked up once."""
        if device.type == "cuda":
            current = self._stream_order.resolve(torch.cuda.current_stream(device))
            self._stream_order.enter(device, current)
            return current_stream_ident(device, current)
        return current_stream_ident(device)

    def _stream_ordinal(self, ident: tuple) -> int:
        n = self._streams.get(ident)
        if n is None:
            with self._lock:
                n = self._streams.setdefault(ident, len(self._streams))
        return n

    def register(self, layer, roles, device, stream, site, channels) -> tuple[dict, dict]:
        """The owners of ``roles`` at this entrant and their bank indices (-1: a stateless
        role), registering in the bank those it has not seen.

        Raises:
            ValueError: a centered role without its channel count in ``channels``.
            StateTransitionError: a new owner during a CUDA graph capture.
        """
        bank = self._protocol.bank
        owners, indices = {}, {}
        recipe = self.recipe_of(layer)
        stateful = self._stateful if recipe is self._recipe else recipe.stateful
        for role in roles:
            key = (layer, role, self._rank, stream, site)
            owner = self._owner_keys.get(key)
            if owner is None:  # one key object per entrant: dict lookups hit on identity
                owner = self._owner_keys[key] = scoped_owner(self._config.ownership, *key)
            if not stateful(role):  # no bank slot: its scale comes from each call's tensor
                owners[role], indices[role] = owner, -1
                self.dynamic.setdefault(owner, None)
                continue
            width = 0
            encoder = self.encoder_of(layer, role)
            if encoder.centered:
                require_that(
                    channels is not None and role in channels,
                    f"layer {layer!r}: enter_call(channels)",
                    channels,
                    f"the channel count of {role!r}, which is centered: channels={{{role!r}: x.shape[-1]}}",
                )
                width = int(channels[role])
            owners[role] = owner
            if bank.device is None or owner not in bank.index:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise StateTransitionError(
                        f"{owner} is first seen during a CUDA graph capture: registering it reallocates "
                        "the state bank and its first event calibrates on the host, which a replay cannot "
                        "repeat. Run every layer in an eager event first (GraphedStep's warmup)"
                    )
                self._stream_order.structural(device)  # registration reallocates the bank
            indices[role] = bank.register(owner, encoder.name, device, width)
        return owners, indices

    def _entrant(self, layer, roles, device, stream, site, channels) -> _Entrant:
        """The owners of one entrant (layer, roles, stream, site), registered, with their bank
        indices and center widths: worked out at its first call and reused while the bank keeps
        its version (a registration, load or move changes it; :meth:`reset` forgets them all).
        Under the lock."""
        roles = roles if type(roles) is tuple else tuple(roles)
        key = (layer, roles, stream, site, None if channels is None else tuple(channels.items()))
        bank = self._protocol.bank
        known = self._entrants.get(key)
        recipe = self.recipe_of(layer)
        if known is not None and known.version == bank.version and known.recipe is recipe:
            return known
        owners, indices = self.register(layer, roles, device, stream, site, channels) if recipe.quantized else ({}, {})
        widths = {role: bank.center_width[i] for role, i in indices.items() if i >= 0}
        known = self._entrants[key] = _Entrant(bank.version, owners, indices, widths, bool(widths), recipe)
        return known

    # -- which snapshot it reads ----------------------------------------------------
    def snapshot(self, owner, role, scale, descale, center, event, region, ordinal, enc=None) -> QuantSnapshot:
        """A snapshot of ``owner`` in ``role``'s format (``enc``'s, default the protocol's encoder
        of ``role``), stamped with its event, region and ordinal."""
        step, mb = (None, None) if event is None else event
        enc = enc or self._encoders.get(role) or self._encoder(role)
        return QuantSnapshot.stamped(owner, step, mb, region, ordinal, enc.dtype, scale, descale, enc.layout, center)

    def live_snapshot(self, owner, index, event, region, ordinal, role, *, copy: bool = True) -> QuantSnapshot:
        """A snapshot of ``owner``'s live (not frozen) state at bank ``index``: a copy unless
        ``copy`` is False; a stateless owner's (index -1) has no scale yet."""
        if index < 0:  # stateless: no live state, the scale comes at the quantize
            enc = self.encoder_of(owner.layer, role) if self._layer_recipes else None
            return self.snapshot(owner, role, None, None, None, event, region, ordinal, enc)
        bank = self._protocol.bank
        width = bank.center_width[index]
        scale, descale = bank.scale[index], bank.descale[index]
        center = bank.center[index, :width] if width else None
        if copy:
            scale, descale = scale.clone(), descale.clone()
            center = None if center is None else center.clone()
        return self.snapshot(owner, role, scale, descale, center, event, region, ordinal)

    def new_record(self, ev: OpenEvent, layer, roles, device, frame, channels) -> CallRecord:
        """A true-forward call's record: its owners registered, its snapshots views of the
        event's frozen scales (frozen now if no call froze them yet at this bank version),
        stashed for its recompute."""
        ident = self._enter_stream(device)
        stream = self._stream_ordinal(ident)
        protocol = self._protocol
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
            if entrant.banked and (ev.frozen is None or ev.frozen.version != protocol.bank.version):
                self._stream_order.structural(device)
                ev.frozen = protocol.bank.freeze()
            frozen = ev.frozen
        if entrant.banked:
            if self._stream_order.active:
                self._stream_order.use(device, frozen.scales)
            scales, descales = frozen.views()
        region = frame.key if frame is not None else None
        event = ev.event
        snapshots = {}
        for role, owner in owners.items():
            i = indices[role]
            if i < 0:  # stateless: stamps now, the scale at the quantize (from its own tensor)
                enc = self.encoder_of(layer, role) if entrant.recipe is not self._recipe else None
                snapshots[role] = self.snapshot(owner, role, None, None, None, event, region, ordinal, enc)
                continue
            center = frozen.center(i, widths[role]) if widths[role] else None
            snapshots[role] = self.snapshot(owner, role, scales[i], descales[i], center, event, region, ordinal)
        record = CallRecord(event, layer, site, region, ordinal, stream, ident, owners, indices, snapshots)
        record.may_recompute = recompute_may_follow(region)
        self._stash.put(record)
        return record

    def live_record(self, layer, roles, device, frame, channels) -> CallRecord:
        """A call's record outside an event (evaluation): copies of the live state, not stashed."""
        ident = self._enter_stream(device)
        stream = self._stream_ordinal(ident)
        quantized = self.recipe_of(layer).quantized
        owners, indices = self.register(layer, roles, device, stream, 0, channels) if quantized else ({}, {})
        region = frame.key if frame is not None else None
        snapshots = {
            role: self.live_snapshot(owner, indices[role], None, region, 0, role) for role, owner in owners.items()
        }
        return CallRecord(None, layer, 0, region, 0, stream, ident, owners, indices, snapshots)
