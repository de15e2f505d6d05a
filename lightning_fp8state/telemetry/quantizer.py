"""Quantizer health: scales, amaxes, saturation, commits per event, violations, mismatches.

:func:`quantizer_health` reads an :class:`~lightning_fp8state.Fp8State` (any
``QuantProtocol``) on a log step and returns ``dict[str, float]``. :class:`SaturationWindow`
turns the bank's saturation counters (added by the quantize kernels) into each owner's
saturated fraction over the logging window.
"""

from __future__ import annotations

import torch
from torch import nn

from ..audit import RecomputeAuditor
from ..nn import Fp8Experts, Fp8Linear
from ..state import OwnerKey

__all__ = ["SaturationWindow", "fallback_health", "find_protocol", "owner_label", "quantizer_health"]


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


class SaturationWindow:
    """Per-owner saturated fractions over a logging window, from the bank's device counters.

    The recording quantize kernels add, per owner, the elements they clip (``|x * scale| >
    fmax``) and the elements they encode to ``StateBank.saturation`` (int64 ``[2, n]``), on the
    device, in eager calls and CUDA graph replays alike; a recompute adds to a scratch counter,
    so nothing is counted twice. The counters only grow (the fallback reads the same ones per
    event). This keeps their host values at the previous log step: a window's fraction is the
    difference's ratio, read in the log step's one transfer (:func:`quantizer_health`).
    """

    def __init__(self) -> None:
        self._seen: list[list[int]] = [[], []]  # [clipped, elements] per bank index, at the last read

    def take(self, host: list[list[float]]) -> dict[int, tuple[int, int]]:
        """``(clipped, elements)`` per bank index quantized in this window, from ``host`` (the
        bank's counters read as floats, exact below 2**53); remembers them for the next window.
        An owner whose counters went back (a bank built afresh: a load, a reset) counts from zero."""
        now = [[int(v) for v in row] for row in host]
        seen = self._seen
        out = {}
        for i, (clipped, elements) in enumerate(zip(*now, strict=True)):
            if i < len(seen[0]) and seen[0][i] <= clipped and seen[1][i] <= elements:
                clipped, elements = clipped - seen[0][i], elements - seen[1][i]
            if elements > 0:
                out[i] = (clipped, elements)
        self._seen = now
        return out


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


def _stateless_health(protocol, snaps: dict, per_owner: bool) -> dict[str, float]:
    """The fields the recipe defines for its stateless owners (``Recipe.telemetry``), from each
    owner's latest true-forward snapshot (``snaps``; one transfer): ``fp8state/<field>/<owner>``,
    and the min/max of every ``scale*`` and the max of every ``amax*`` field across owners."""
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
    saturation: SaturationWindow | None = None,
    after_event=None,
    per_owner: bool = True,
) -> tuple[dict[str, float], object]:
    """Quantizer health on a log step (reads device memory: one transfer).

    Args:
        protocol: an ``Fp8State`` (or ``QuantProtocol``).
        saturation: the window whose saturated fractions to report (``fp8state/saturated_frac``,
            ``..._max`` and per owner), read from the bank's counters in the same transfer.
        after_event: count commits only in events after this one (the previous log step's).
        per_owner: also return per-owner keys (``fp8state/scale/<owner>``, ...).

    Returns:
        The metrics and the last closed event counted (pass it back as ``after_event``).
    """
    protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
    bank, ledger = protocol.bank, protocol.ledger
    # owners: the bank's (delayed state) and the stateless ones that have quantized (per call)
    snaps = protocol.dynamic_snapshots() if hasattr(protocol, "dynamic_snapshots") else {}
    out: dict[str, float] = {"fp8state/owners": float(len(bank) + len(snaps))}
    n = len(bank)
    if n:
        rows = [bank.scale, bank.amax_history[0], bank.nonfinite_count.to(torch.float32)]
        if saturation is not None:  # float64: the counts exact up to 2**53
            rows.extend(bank.saturation.to(bank.scale.device))
        host = torch.stack([r.to(torch.float64) for r in rows]).cpu().tolist()
        scale, amax, nonfinite = host[0], host[1], host[2]
        window = saturation.take(host[3:5]) if saturation is not None else {}
        out["fp8state/scale_min"] = min(scale)
        out["fp8state/scale_max"] = max(scale)
        out["fp8state/amax_max"] = max(amax)
        out["fp8state/nonfinite_amax_events"] = float(sum(nonfinite))
        fractions = {i: clipped / elements for i, (clipped, elements) in window.items()}
        if fractions:
            total = sum(e for _, e in window.values())
            out["fp8state/saturated_frac"] = sum(c for c, _ in window.values()) / total
            out["fp8state/saturated_frac_max"] = max(fractions.values())
        if per_owner:
            for i, owner in enumerate(bank.owners):
                label = owner_label(owner)
                out[f"fp8state/scale/{label}"] = scale[i]
                out[f"fp8state/amax/{label}"] = amax[i]
                if i in fractions:
                    out[f"fp8state/saturated_frac/{label}"] = fractions[i]
    for key, value in _stateless_health(protocol, snaps, per_owner).items():  # merged with the bank's owners
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
