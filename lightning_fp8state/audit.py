"""RecomputeAuditor: proves (or disproves) that recompute reproduces the true forward.

Attach it to an ``Fp8State``; every converted module's output (an ``Fp8Linear``'s output,
an ``Fp4AttentionQuantizer``'s dequantized operands) is digested in the true forward and
again in its recompute (bytes hash, max abs/rel difference, finite-mask equality, the
descales and centers consumed), and the report pairs them per layer, call site and event,
together with the ledger's violations. Diagnostic only: it copies outputs to the host.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from .recompute import CallRecord, Phase

__all__ = ["AuditReport", "AuditRow", "DeviceRecomputeAuditor", "RecomputeAuditor"]


@dataclass
class _Digest:
    sha256: str
    outputs: list[torch.Tensor]  # host copies, dropped once their event is over
    descales: dict[str, float]
    centers: dict[str, str]  # role -> sha256 of the consumed center (centered FP4 only)
    stamps: dict[str, tuple]


@dataclass
class AuditRow:
    """One true-forward call and (if it was recomputed) its recompute."""

    event: tuple
    layer: str
    site: int
    forward_sha256: str
    recompute_sha256: str | None = None
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    finite_mask_equal: bool = True
    descales_equal: bool = True
    centers_equal: bool = True
    stamps_equal: bool = True
    recomputes: int = 0

    @property
    def recomputed(self) -> bool:
        return self.recompute_sha256 is not None

    @property
    def bit_identical(self) -> bool:
        return not self.recomputed or self.recompute_sha256 == self.forward_sha256

    @property
    def ok(self) -> bool:
        return (
            self.bit_identical
            and self.finite_mask_equal
            and self.descales_equal
            and self.centers_equal
            and self.stamps_equal
        )


@dataclass
class AuditReport:
    """Per (event, layer, site) rows plus the ledger's violations."""

    rows: list[AuditRow] = field(default_factory=list)
    violations: list = field(default_factory=list)

    @property
    def mismatches(self) -> list[AuditRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def recomputed(self) -> int:
        return sum(r.recomputed for r in self.rows)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.violations

    def per_layer(self) -> dict[str, dict]:
        """Summary per layer: calls, recomputed calls, mismatches, worst differences."""
        out: dict[str, dict] = {}
        for r in self.rows:
            s = out.setdefault(
                r.layer, {"calls": 0, "recomputed": 0, "mismatches": 0, "max_abs_diff": 0.0, "max_rel_diff": 0.0}
            )
            s["calls"] += 1
            s["recomputed"] += r.recomputed
            s["mismatches"] += not r.ok
            s["max_abs_diff"] = max(s["max_abs_diff"], r.max_abs_diff)
            s["max_rel_diff"] = max(s["max_rel_diff"], r.max_rel_diff)
        for v in self.violations:
            s = out.setdefault(
                v.owner.layer, {"calls": 0, "recomputed": 0, "mismatches": 0, "max_abs_diff": 0.0, "max_rel_diff": 0.0}
            )
            s["violations"] = s.get("violations", 0) + 1
        return out

    def format_table(self) -> str:
        """A plain-text table, one line per layer."""
        head = f"{'layer':<32} {'calls':>6} {'recomp':>6} {'mismatch':>8} {'viol':>5} {'max|diff|':>11} {'max rel':>10}"
        lines = [head, "-" * len(head)]
        for layer, s in sorted(self.per_layer().items()):
            lines.append(
                f"{layer:<32} {s['calls']:>6} {s['recomputed']:>6} {s['mismatches']:>8} "
                f"{s.get('violations', 0):>5} {s['max_abs_diff']:>11.4g} {s['max_rel_diff']:>10.4g}"
            )
        verdict = (
            "OK: forward and recompute bit-identical"
            if self.ok
            else (f"FAIL: {len(self.mismatches)} mismatching call(s), {len(self.violations)} ledger violation(s)")
        )
        lines.append(verdict)
        return "\n".join(lines)


def _bytes(t: torch.Tensor) -> bytes:
    raw = t.view(torch.uint8) if t.element_size() > 0 and t.numel() else t
    return raw.numpy().tobytes()


def _digest(output, snaps: dict) -> _Digest:
    tensors = [output] if isinstance(output, torch.Tensor) else list(output)
    hosts = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
    sha = hashlib.sha256()
    for host in hosts:
        sha.update(f"{host.dtype}{tuple(host.shape)}".encode())
        sha.update(_bytes(host))
    descales = {role: float(s.descale) for role, s in snaps.items()}
    centers = {
        role: hashlib.sha256(_bytes(s.center.detach().cpu().contiguous())).hexdigest()
        for role, s in snaps.items()
        if s.center is not None
    }
    stamps = {role: (str(s.owner), s.event, s.region, s.ordinal) for role, s in snaps.items()}
    return _Digest(sha.hexdigest(), hosts, descales, centers, stamps)


def _compare(row: AuditRow, fwd: _Digest, rec: _Digest) -> None:
    row.recomputes += 1
    row.recompute_sha256 = rec.sha256
    if len(fwd.outputs) != len(rec.outputs):
        row.finite_mask_equal = False
    for out_f, out_r in zip(fwd.outputs, rec.outputs, strict=False):
        if out_f.shape != out_r.shape:
            row.finite_mask_equal = False
            continue
        a, b = out_f.to(torch.float64), out_r.to(torch.float64)
        fa, fb = torch.isfinite(a), torch.isfinite(b)
        row.finite_mask_equal = row.finite_mask_equal and bool(torch.equal(fa, fb))
        both = fa & fb
        if both.any():
            diff = (a - b).abs()[both]
            row.max_abs_diff = max(row.max_abs_diff, float(diff.max()))
            rel = diff / a.abs()[both].clamp_min(torch.finfo(torch.float32).tiny)
            row.max_rel_diff = max(row.max_rel_diff, float(rel.max()))
    row.descales_equal = row.descales_equal and fwd.descales == rec.descales
    row.centers_equal = row.centers_equal and fwd.centers == rec.centers
    row.stamps_equal = row.stamps_equal and fwd.stamps == rec.stamps


class RecomputeAuditor:
    """Context manager that records forward/recompute digests of every converted module.

    Example::

        with RecomputeAuditor(state) as auditor:
            for step in range(10):
                with state.step(step):
                    loss = model(x).float().pow(2).mean()
                    loss.backward()
        assert auditor.report().ok
    """

    def __init__(self, state) -> None:
        self.protocol = getattr(state, "protocol", state)
        self._forward: dict[tuple, _Digest] = {}
        self._rows: dict[tuple, AuditRow] = {}
        self._event = None
        self._lock = threading.Lock()

    def __enter__(self) -> RecomputeAuditor:
        self.protocol.auditors.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.protocol.auditors.remove(self)

    def observe(self, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
        """Digest one call's output: a tensor, or a tuple of tensors (attention operands)."""
        if phase is Phase.INFERENCE:
            return
        if not isinstance(output, torch.Tensor) and not (
            isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in output)
        ):
            return
        key = (record.event, record.layer, record.site)
        digest = _digest(output, snaps)
        with self._lock:
            if phase is Phase.FORWARD:
                if record.event != self._event:  # recompute never crosses events: free old copies
                    self._forward = {}
                    self._event = record.event
                self._forward[key] = digest
                self._rows[key] = AuditRow(record.event, record.layer, record.site, digest.sha256)
            elif key in self._forward:
                _compare(self._rows[key], self._forward[key], digest)

    def report(self) -> AuditReport:
        """Rows in event order, plus the ledger's violations so far."""
        with self._lock:
            rows = [self._rows[k] for k in sorted(self._rows, key=lambda k: (k[0], k[1], k[2]))]
        return AuditReport(rows, list(self.protocol.ledger.violations))


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.element_size() else flat


@dataclass
class _Call:
    outputs: list[torch.Tensor]
    descales: dict[str, torch.Tensor]
    centers: dict[str, torch.Tensor]
    stamps: dict[str, tuple]


class DeviceRecomputeAuditor:
    """The :class:`RecomputeAuditor`'s verdict kept on the device: no host copy, no sync.

    For long or large GPU runs, where copying every output to the host would dominate.

    A true-forward call clones its outputs (and the descales/centers it consumed); its
    recompute is compared bit for bit on the device. A call counts as mismatching when any
    recompute differs in output bits (hence also in the finite mask), descale, center or
    stamps: the same verdict as ``AuditRow.ok``. Per step: a device count of mismatching
    calls and a host count of recomputed calls. Memory: one copy of the open event's outputs.
    """

    def __init__(self, state) -> None:
        self.protocol = getattr(state, "protocol", state)
        self._forward: dict[tuple, _Call] = {}
        self._bad: dict[tuple, torch.Tensor] = {}
        self._event = None
        self.mismatching: dict[int, torch.Tensor] = {}  # step -> device count of mismatching calls
        self.recomputed: Counter = Counter()  # step -> recomputed calls (host)

    def __enter__(self) -> DeviceRecomputeAuditor:
        self.protocol.auditors.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.protocol.auditors.remove(self)
        self._flush()

    def _flush(self) -> None:
        if self._event is not None and self._bad:
            self.mismatching[self._event[0]] = torch.stack(list(self._bad.values())).sum()
        self._forward, self._bad = {}, {}

    def observe(self, record: CallRecord, phase: Phase, output, snaps: dict) -> None:
        if phase is Phase.INFERENCE:
            return
        tensors = [output] if isinstance(output, torch.Tensor) else list(output)
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return
        key = (record.event, record.layer, record.site)
        call = _Call(
            [t.detach().clone() for t in tensors],
            {role: s.descale.detach().clone() for role, s in snaps.items()},
            {role: s.center.detach().clone() for role, s in snaps.items() if s.center is not None},
            {role: (str(s.owner), s.event, s.region, s.ordinal) for role, s in snaps.items()},
        )
        if phase is Phase.FORWARD:
            if record.event != self._event:
                self._flush()
                self._event = record.event
            self._forward[key] = call
            return
        fwd = self._forward.get(key)
        if fwd is None:
            return
        self.recomputed[record.event[0]] += key not in self._bad
        device = call.outputs[0].device if call.outputs else torch.device("cpu")
        bad = self._bad.get(key, torch.zeros((), dtype=torch.bool, device=device))
        structural = (
            len(fwd.outputs) != len(call.outputs)
            or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(fwd.outputs, call.outputs, strict=False))
            or fwd.descales.keys() != call.descales.keys()
            or fwd.centers.keys() != call.centers.keys()
            or any(fwd.centers[r].shape != call.centers[r].shape for r in fwd.centers)
            or fwd.stamps != call.stamps
        )
        if structural:
            bad = torch.ones((), dtype=torch.bool, device=device)
        else:
            for a, b in zip(fwd.outputs, call.outputs, strict=True):
                bad = bad | (_bits(a) != _bits(b)).any()
            for role, d in fwd.descales.items():  # float compare: a NaN descale differs, as on the host
                bad = bad | (d != call.descales[role]).any().to(device)
            for role, c in fwd.centers.items():
                bad = bad | (_bits(c) != _bits(call.centers[role])).any().to(device)
        self._bad[key] = bad

    def series(self, steps: int) -> tuple[list[int], list[int]]:
        """Per step: mismatching calls and recomputed calls (one host read)."""
        counts = [0] * steps
        if self.mismatching:
            order = sorted(s for s in self.mismatching if s < steps)
            values = torch.stack([self.mismatching[s] for s in order]).cpu().tolist()
            for s, v in zip(order, values, strict=True):
                counts[s] = int(v)
        return counts, [self.recomputed[s] for s in range(steps)]
