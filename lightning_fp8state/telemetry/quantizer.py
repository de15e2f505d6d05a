"""Quantizer health: scales, amaxes, saturation, commits per event, violations, mismatches.

:func:`quantizer_health` reads an :class:`~lightning_fp8state.Fp8State` (any
``QuantProtocol``) on a log step and returns ``dict[str, float]``. :class:`SaturationProbe`
counts, on armed steps only, how many elements each owner encoded at ``±fmax``.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from functools import partial

import torch
from torch import nn

from ..audit import RecomputeAuditor
from ..formats import fp8_format
from ..nn import Fp8Experts, Fp8Linear
from ..recompute import CallRecord, Phase
from ..state import OwnerKey

__all__ = ["SaturationProbe", "fallback_health", "find_protocol", "owner_label", "quantizer_health"]


def owner_label(owner: OwnerKey) -> str:
    """A short metric-key-safe name: ``layer.role``, plus ``#site``/``@rRANK``/``@sSTREAM`` when not 0."""
    label = f"{owner.layer}.{owner.role}"
    if owner.site:
        label += f"#{owner.site}"
    if owner.rank:
        label += f"@r{owner.rank}"
    if owner.stream:
        label += f"@s{owner.stream}"
    return label


def find_protocol(model: nn.Module | None):
    """The quantizer protocol (``Fp8State``) driving the first converted module of ``model`` (a
    converted linear, or a mixture-of-experts layer's experts)."""
    if model is None:
        return None
    for module in model.modules():
        if isinstance(module, (Fp8Linear, Fp8Experts)):
            return module.protocol
    return None


class SaturationProbe:
    """Counts saturated elements per owner on armed steps: those whose scaled magnitude
    ``|float32(x) * scale|`` exceeds ``fmax``, so that encoding clamps them to ``±fmax``.

    Attached to a protocol (as an output observer, like the audit) and to every
    ``Fp8Linear`` of a model (a forward hook). While :attr:`armed`, each true-forward call
    counts its input and weight against the scales of the snapshots it was paired with, and
    a hook on its output counts the gradient that arrives there (the ``grad_output`` role)
    against its snapshot. Recompute is not counted twice. Disarmed, a call costs one
    attribute check. Counting is device work (a comparison and a sum per tensor), no sync.

    In ``naive`` mode the grad_output snapshot differs from the live scale the defect uses,
    so that role's count is an approximation there; in ``safe`` mode it is exact.
    """

    def __init__(self, protocol, model: nn.Module) -> None:
        protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
        self.protocol = protocol
        self.armed = False
        self._tls = threading.local()
        self._saturated: dict[int, torch.Tensor] = {}
        self._elements: defaultdict[int, int] = defaultdict(int)
        self._hooked: dict[int, CallRecord] = {}  # id -> record (kept alive while armed)
        self._hooks = [
            m.register_forward_hook(self._after_forward, with_kwargs=True)
            for m in model.modules()
            if isinstance(m, Fp8Linear) and m.protocol is protocol
        ]
        protocol.auditors.append(self)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self in self.protocol.auditors:
            self.protocol.auditors.remove(self)

    # the protocol calls this after every converted module's forward (see QuantProtocol.observe_output)
    def observe(self, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
        if self.armed:
            self._tls.last = (record, phase)

    def _after_forward(self, module, args, kwargs, output) -> None:
        # Under torch.compile this hook is traced into the block's graph: disarmed it is a no-op
        # there (a guard on ``armed``); armed it runs eagerly after the layer's op, when the
        # protocol has handed its record over (a graph break on the probe's steps only).
        if self.armed:
            self._count_call(module, args, kwargs, output)

    @torch.compiler.disable
    def _count_call(self, module, args, kwargs, output) -> None:
        last = getattr(self._tls, "last", None)
        self._tls.last = None
        if not self.armed or last is None:
            return
        record, phase = last
        if record.layer != module.layer_name or not record.owners:
            return
        if phase is Phase.FORWARD:
            x = args[0]
            prologue = module._prologue(kwargs.get("prologue"), kwargs.get("norm"))
            if prologue is not None:  # what was quantized: the fused prologue's output
                x = prologue.apply(x)
            self._count(record, "input", x)
            # an FSDP2 FP8 all-gathered weight arrives as codes (nn/fsdp.py): the high-precision
            # values are spread over the ranks, so its saturation is not counted here
            if getattr(module.weight, "fp8", None) is None:
                self._count(record, "weight", module.weight)
        # The output that receives the gradient: the true forward's (no checkpoint,
        # non-reentrant) or the recompute's (reentrant engines run the first forward under
        # no_grad). One hook per call record.
        if (
            "grad_output" in record.owners
            and isinstance(output, torch.Tensor)
            and output.requires_grad
            and id(record) not in self._hooked
        ):
            self._hooked[id(record)] = record
            output.register_hook(partial(self._count_grad, record))

    def _count_grad(self, record: CallRecord, grad: torch.Tensor) -> None:
        self._count(record, "grad_output", grad)

    def _count(self, record: CallRecord, role: str, x: torch.Tensor) -> None:
        index = record.indices[role]
        if index < 0:  # a stateless owner (its scale from its own amax): nothing saturates but NaN
            return
        snap = record.used.get(role) or record.snapshots[role]
        fmax = fp8_format(snap.dtype).max
        with torch.no_grad():
            hits = ((x.detach().to(torch.float32) * snap.scale.to(torch.float32)).abs() > fmax).sum()
        prev = self._saturated.get(index)
        self._saturated[index] = hits if prev is None else prev + hits
        self._elements[index] += x.numel()

    def take(self) -> tuple[dict[int, torch.Tensor], dict[int, int]]:
        """Saturated counts (device) and element counts (host) per bank index; resets them."""
        sat, elements = self._saturated, dict(self._elements)
        self._saturated, self._elements, self._hooked = {}, defaultdict(int), {}
        return sat, elements


def _commits_per_event(ledger, after_event, open_event) -> tuple[list[int], object]:
    """Commit counts of every (event, owner) that observed or committed, for events after ``after_event``."""
    counts, last = [], after_event
    for event in ledger.events():
        if (after_event is not None and event <= after_event) or event == open_event:
            continue
        for rec in ledger.event(event).values():
            if rec.observations or rec.commits:
                counts.append(rec.commits)
        last = event
    return counts, last


def _stateless_health(protocol, per_owner: bool) -> dict[str, float]:
    """The fields the recipe defines for its stateless owners (``Recipe.telemetry``), from each
    owner's latest true-forward snapshot (one transfer): ``fp8state/<field>/<owner>``, and the
    min/max of every ``scale*`` and the max of every ``amax*`` field across owners."""
    snaps = protocol.dynamic_snapshots() if hasattr(protocol, "dynamic_snapshots") else {}
    names, values = [], []
    for owner, snap in snaps.items():
        recipe = protocol.recipe_of(owner.layer) if getattr(protocol, "layer_recipes", None) else protocol.recipe
        for key, value in recipe.telemetry(snap).items():
            names.append((owner, key))
            values.append(value.detach().reshape(()).to(torch.float32))
    if not values:
        return {}
    host = torch.stack([v.to(values[0].device) for v in values]).cpu().tolist()
    out: dict[str, float] = {}
    scales = [v for (_, k), v in zip(names, host, strict=True) if k.startswith("scale")]
    amaxes = [v for (_, k), v in zip(names, host, strict=True) if k.startswith("amax")]
    if scales:
        out["fp8state/scale_min"], out["fp8state/scale_max"] = min(scales), max(scales)
    if amaxes:
        out["fp8state/amax_max"] = max(amaxes)
    if per_owner:
        for (owner, key), value in zip(names, host, strict=True):
            out[f"fp8state/{key}/{owner_label(owner)}"] = value
    return out


def fallback_health(protocol) -> dict[str, float]:
    """The fallback's moves (``QuantConfig.fallback``), from the host (no device read):
    ``fp8state/fallback_layers`` and, per moved layer, ``fp8state/fallback/<layer>`` = the step
    at whose end it moved; a layer moved to current scaling (``fallback_to=current``) also as
    ``fp8state/fallback_current/<layer>`` (the others went to high precision). Empty when the
    fallback is off."""
    monitor = getattr(protocol, "fallback", None)
    if monitor is None:
        return {}
    out = {"fp8state/fallback_layers": float(len(monitor.fallen))}
    for move in monitor.events:
        out[f"fp8state/fallback/{move.layer}"] = float(move.step)
        if move.target == "current":
            out[f"fp8state/fallback_current/{move.layer}"] = float(move.step)
    return out


def quantizer_health(
    protocol,
    *,
    saturation: tuple[dict[int, torch.Tensor], dict[int, int]] | None = None,
    after_event=None,
    per_owner: bool = True,
) -> tuple[dict[str, float], object]:
    """Quantizer health on a log step (reads device memory: one transfer).

    Args:
        protocol: an ``Fp8State`` (or ``QuantProtocol``).
        saturation: :meth:`SaturationProbe.take` output for this log step, if measured.
        after_event: count commits only in events after this one (the previous log step's).
        per_owner: also return per-owner keys (``fp8state/scale/<owner>``, ...).

    Returns:
        The metrics and the last closed event counted (pass it back as ``after_event``).
    """
    protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
    bank, ledger = protocol.bank, protocol.ledger
    out: dict[str, float] = {"fp8state/owners": float(len(bank))}
    n = len(bank)
    sat_counts, elements = saturation if saturation is not None else ({}, {})
    if n:
        rows = [bank.scale, bank.amax_history[0], bank.nonfinite_count.to(torch.float32)]
        sat_idx = [i for i in sorted(sat_counts) if i < n and elements.get(i)]
        if sat_idx:
            rows.append(torch.zeros(n, dtype=torch.float32, device=bank.scale.device))
            for i in sat_idx:
                rows[-1][i] = sat_counts[i].to(rows[-1].device, torch.float32)
        host = torch.stack(rows).cpu().tolist()
        scale, amax, nonfinite = host[0], host[1], host[2]
        out["fp8state/scale_min"] = min(scale)
        out["fp8state/scale_max"] = max(scale)
        out["fp8state/amax_max"] = max(amax)
        out["fp8state/nonfinite_amax_events"] = float(sum(nonfinite))
        fractions = {}
        if sat_idx:
            hits = host[3]
            fractions = {i: hits[i] / elements[i] for i in sat_idx}
            out["fp8state/saturated_frac"] = sum(hits[i] for i in sat_idx) / sum(elements[i] for i in sat_idx)
            out["fp8state/saturated_frac_max"] = max(fractions.values())
        if per_owner:
            for i, owner in enumerate(bank.owners):
                label = owner_label(owner)
                out[f"fp8state/scale/{label}"] = scale[i]
                out[f"fp8state/amax/{label}"] = amax[i]
                if i in fractions:
                    out[f"fp8state/saturated_frac/{label}"] = fractions[i]
    for key, value in _stateless_health(protocol, per_owner).items():  # merged with the bank's owners
        if key in out and key.endswith(("_min", "_max")):
            value = min(value, out[key]) if key.endswith("_min") else max(value, out[key])
        out[key] = value
    counts, last = _commits_per_event(ledger, after_event, protocol.clock.event)
    if counts:
        out["fp8state/commits_per_event_min"] = float(min(counts))
        out["fp8state/commits_per_event_max"] = float(max(counts))
        out["fp8state/commits_per_event_mean"] = sum(counts) / len(counts)
    out["fp8state/ledger_violations"] = float(len(ledger.violations))
    out.update(fallback_health(protocol))
    auditors = [a for a in protocol.auditors if isinstance(a, RecomputeAuditor)]
    if auditors:
        reports = [a.report() for a in auditors]
        out["fp8state/recompute_mismatches"] = float(sum(len(r.mismatches) for r in reports))
        out["fp8state/recomputed_calls"] = float(sum(r.recomputed for r in reports))
    return out, last
