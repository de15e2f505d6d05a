"""Sharded weights: the FP8 all-gather of FSDP2 and the weights FSDP2 or ZeRO-3 shard.

The one place of the protocol that knows about sharding. A layer whose weight FSDP2 gathers
in FP8 (:mod:`lightning_fp8state.nn.fsdp`) has its shard quantized here, before the
all-gather, with the snapshot its call will use (:class:`ShardedWeights`); the call then
adopts the gathered codes instead of quantizing. A recipe whose shards carry scales of their
own blocks (``Recipe.shard_scales``: ``fp8_blockwise``) encodes each shard at those, from the
shard's values, and the recipe gathers them with the codes. A layer whose weight is sharded at all
(FSDP2, or ZeRO-3 partitions, ``nn.fsdp.mark_sharded``) keeps no weight codes from its true
forward for the recompute (``QuantConfig.weight_codes_once``): they would hold a full weight
per call from the forward to the backward, the memory sharding exists to free; the recompute
encodes the re-gathered weight again (the same codes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..errors import StateTransitionError
from ..recompute import Phase, current_frame, in_backward
from ..state import QuantSnapshot
from .events import OpenEvent

__all__ = ["ShardSource", "ShardedWeights"]


class ShardSource(NamedTuple):
    """Where an FP8-gathered layer's weight lives now (:attr:`QuantProtocol.gathered_layers`)."""

    device: torch.device
    shard: torch.Tensor | None  # this rank's high-precision shard; None while the weight is unsharded
    group: object  # the shard group the all-gather runs over; None: the weight is not sharded


class ShardedWeights:
    """Quantizes the shards of a protocol's FP8-gathered weights (FSDP2's all-gather)."""

    def __init__(self, protocol, records, quantizer) -> None:
        """
        Args:
            protocol: the :class:`~lightning_fp8state.protocol.QuantProtocol` whose bank and
                open event it reads (each may be replaced: read per use).
            records: its :class:`~lightning_fp8state.protocol.records.CallRecords` (the
                weight owners and their snapshots).
            quantizer: its :class:`~lightning_fp8state.protocol.encode.Quantizer` (the encodes).
        """
        self._protocol = protocol
        self._records = records
        self._quantizer = quantizer
        self._config = protocol.config
        self._recipe = protocol.recipe
        self._stream_order = protocol.stream_order
        self._rules = protocol._policy is None
        # layer -> where its weight lives now (filled by nn.fsdp.enable_fp8_all_gather)
        self.gathered_layers: dict[str, Callable[[], ShardSource]] = protocol.gathered_layers

    def owner(self, layer: str, device: torch.device) -> tuple[object, int]:
        """The weight owner of ``layer``'s one call site (site 0, stream 0), registered."""
        owners, indices = self._records.register(layer, ("weight",), device, 0, 0, None)
        return owners["weight"], indices["weight"]

    # -- at begin_event ------------------------------------------------------------------
    def prepare(self, ev: OpenEvent) -> None:
        """Register the gathered layers' weight owners (first event) and freeze the event's
        scales now, on the training stream: FSDP2 runs the all-gather's quantize on its own
        copy-in stream, which it orders after the training stream at the root's forward, so
        no structural change of the bank may happen there (see :meth:`gather`).

        A per-call weight scale (a stateless recipe) is the full weight's: derived here for
        every gathered layer from its shard, one collective over the shard group for all
        (:meth:`Recipe.gather_scales`). The weights do not change inside an event (the
        optimizer steps between events), so the forward's gather, the backward's re-gather and
        a recompute all use these values. Every rank opens the same events, so every rank
        reaches the collective; a layer that is unsharded right now (FSDP2 kept it gathered)
        gets its scale at its gather instead, if it is gathered in this event at all.

        Does nothing without gathered layers, under the bf16 recipe or a quantize policy."""
        if not (self.gathered_layers and self._recipe.quantized and self._rules):
            return
        device, banked, per_call = None, False, {}
        for layer, source_of in self.gathered_layers.items():
            source = source_of()
            device = source.device
            _, index = self.owner(layer, device)
            if index >= 0:
                banked = True
            elif source.shard is not None and not self._recipe.shard_scales:
                per_call[layer] = source
        if banked:
            self._stream_order.structural(device)
            ev.frozen = self._protocol.bank.freeze()
        if per_call:
            ev.gather_scales = self.full_weight_scales(per_call)

    def full_weight_scales(self, sources: dict[str, ShardSource]) -> dict[str, tuple]:
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
            scale, descale, amax = self._recipe.gather_scales([sources[n].shard for n in layers], group)
            out.update(zip(layers, zip(scale.unbind(0), descale.unbind(0), amax.unbind(0), strict=True), strict=True))
        return out

    def calibrate(self, index: int, shard: torch.Tensor, snap: QuantSnapshot, group) -> None:
        """The first scale of a sharded weight from the full weight's amax: the MAX of every
        rank's shard amax (one all-reduce; an owner's first event only)."""
        bank = self._protocol.bank
        amax = bank.amax_of(shard) if shard.numel() else torch.zeros(1, device=shard.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        bank.calibrate_from_amax(index, amax, snap.scale, snap.descale, self._config.margin)

    # -- at each gather --------------------------------------------------------------------
    def gather(self, layer: str, shard: torch.Tensor, group=None) -> tuple[torch.Tensor, QuantSnapshot]:
        """See :meth:`QuantProtocol.gather_weight`: by phase, the codes of ``shard`` and the
        snapshot they were quantized with."""
        ev = self._protocol._open
        if layer not in self.gathered_layers:
            raise StateTransitionError(
                f"layer {layer!r} gathers its weight in FP8 but was not prepared for it: call "
                "lightning_fp8state.nn.enable_fp8_all_gather(model) before fully_shard"
            )
        if ev is None:
            return self._gather_outside_event(layer, shard, group)
        frame = current_frame()
        if in_backward() or (frame is not None and frame.phase is Phase.RECOMPUTE):
            return self._regather(ev, layer, shard)
        if layer in ev.gathered:
            raise StateTransitionError(
                f"layer {layer!r}: its weight was all-gathered twice in the forward of event {ev.event}. With "
                "FP8 all-gather a layer is called once per event (one weight owner, one gathered scale); "
                "a layer called at several sites (weight tying, a module reused) needs fp8_all_gather=False"
            )
        owner, index = self.owner(layer, shard.device)  # registered at begin_event
        if index < 0:
            return self._gather_per_call(ev, layer, owner, shard, group)
        return self._gather_delayed(ev, layer, owner, index, shard, group)

    def _gather_outside_event(self, layer: str, shard: torch.Tensor, group):
        """No event, gradients off (evaluation): a copy of the live scale, nothing recorded."""
        if torch.is_grad_enabled() or in_backward():
            raise StateTransitionError(
                f"layer {layer!r}: its weight was all-gathered for a training forward outside a logical "
                "event. Wrap forward and backward in `with state.step(step, microbatch)` (the Lightning "
                "callback does this), or run under torch.no_grad() for evaluation"
            )
        owner, index = self.owner(layer, shard.device)
        snap = self._records.live_snapshot(owner, index, None, None, 0, "weight")
        if index < 0 and self._recipe.shard_scales:  # the shard's own blocks
            q, scale, descale, amax = self._own_scales(shard)
            return q, snap.with_scales(scale, descale, amax)
        if index < 0:  # a per-call scale: the full weight's, one collective for this weight
            scale, descale, amax = self.full_weight_scales({layer: ShardSource(shard.device, shard, group)})[layer]
            snap = snap.with_scales(scale, descale, amax)
        elif index in self._protocol.bank.fresh and self._config.initial_scale == "calibrate":
            self.calibrate(index, shard, snap, group)
        return self._quantizer.encode(shard, snap, "weight"), snap

    def _regather(self, ev: OpenEvent, layer: str, shard: torch.Tensor):
        """A backward's re-gather (also for a recompute): read-only, with the snapshot of the
        event's forward gather, so the same bytes.

        Raises:
            StateTransitionError: the layer's forward gathered none in this event.
        """
        snap = ev.gathered.get(layer)
        if snap is None:
            raise StateTransitionError(
                f"layer {layer!r}: its weight is all-gathered in the backward of event {ev.event}, but "
                "its forward gathered none in this event: no snapshot to re-gather with"
            )
        if self._recipe.shard_scales:  # the same blocks, the same values: the forward's scales
            return self._own_scales(shard)[0], snap
        return self._quantizer.encode(shard, snap, "weight"), snap

    def _own_scales(self, shard: torch.Tensor):
        """``(codes, scale, descale, amax)`` of ``shard`` at scales of its own blocks
        (:attr:`Recipe.shard_scales`): the weight encoder's per-call encode, deterministic, so a
        re-gather gives the forward gather's bytes."""
        return self._recipe.encoder("weight").encode_dynamic(shard)

    def _gather_per_call(self, ev: OpenEvent, layer: str, owner, shard: torch.Tensor, group):
        """A true forward's gather under a per-call weight scale: the full weight's, derived at
        begin_event, or the shard's own blocks' (:attr:`Recipe.shard_scales`, the recipe then
        gathers them with the codes); nothing recorded (no delayed state)."""
        q = None
        if self._recipe.shard_scales:
            q, scale, descale, amax = self._own_scales(shard)
        else:
            values = ev.gather_scales.get(layer)
            if values is None:  # unsharded at begin_event: this weight's own collective
                values = self.full_weight_scales({layer: ShardSource(shard.device, shard, group)})[layer]
            scale, descale, amax = values
        snap = self._records.snapshot(owner, "weight", scale, descale, None, ev.event, None, 0)
        snap = replace(snap, amax=amax)
        ev.gathered[layer] = snap
        return (self._quantizer.encode(shard, snap, "weight") if q is None else q), snap

    def _gather_delayed(self, ev: OpenEvent, layer: str, owner, index: int, shard: torch.Tensor, group):
        """A true forward's gather under a delayed weight scale: the event's frozen one, the
        shard's amax recorded into the owner's pending slot (calibrated first in its first
        event under ``initial_scale="calibrate"``)."""
        # begin_event's frozen copy holds every gathered weight owner; owners registered later
        # in the event (inputs, in the first event) make the layers' calls freeze a newer copy,
        # with the same values: no commit happens before the forward ends
        frozen = ev.frozen
        snap = self._records.snapshot(
            owner, "weight", frozen.scale(index), frozen.descale(index), None, ev.event, None, 0
        )
        fresh = index in self._protocol.bank.fresh
        if fresh and self._config.initial_scale == "calibrate" and index not in ev.calibrated:
            ev.calibrated.add(index)
            self.calibrate(index, shard, snap, group)
        ev.gathered[layer] = snap
        return self._quantizer.encode_record(index, shard, snap, "weight"), snap
