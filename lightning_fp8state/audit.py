"""RecomputeAuditor: proves (or disproves) that recompute reproduces the true forward.

Attach it to an ``Fp8State``; every converted module's output (an ``Fp8Linear``'s output,
an ``Fp4AttentionQuantizer``'s dequantized operands) is digested in the true forward and
again in its recompute (bytes hash, max abs/rel difference, finite-mask equality, the
descales and centers consumed), and the report pairs them per layer, call site and event,
together with the ledger's violations.

Every quantized operand (FP8 codes of input and weight, FP4 packed codes) is also compared
at the quantize itself: torch's non-reentrant checkpoint stops a recompute as soon as the
last saved tensor is rebuilt (early stop), which is inside the last layer's forward, before
its output exists; its operands are compared all the same.

Given the model (``RecomputeAuditor(state, model=model)``), it also reports any module
state a recompute changes: a buffer (BatchNorm's running statistics updated a second time)
or a plain attribute written in ``forward``, naming the module and the buffer or attribute.
Diagnostic only: it copies outputs to the host.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .encoders import norm_kind
from .recompute import CallRecord, Phase, buffers_restored, in_backward
from .sac import outside_selective_checkpoint
from .state import role_phase

__all__ = ["AuditReport", "AuditRow", "DeviceRecomputeAuditor", "RecomputeAuditor", "StateChange"]


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
    recomputes: int = 0  # recomputes whose output was compared
    operands_compared: int = 0  # quantized operands compared at the quantize, over all recomputes
    operands_equal: bool = True
    operand_mismatches: list = field(default_factory=list)  # roles whose recomputed codes differed

    @property
    def recomputed(self) -> bool:
        """The recompute was compared: its output, or (early stop) at least its operands."""
        return self.recompute_sha256 is not None or self.operands_compared > 0

    @property
    def output_recomputed(self) -> bool:
        """The recompute produced this call's output (False for an early-stopped last layer)."""
        return self.recompute_sha256 is not None

    @property
    def bit_identical(self) -> bool:
        outputs = self.recompute_sha256 is None or self.recompute_sha256 == self.forward_sha256
        return outputs and self.operands_equal

    @property
    def ok(self) -> bool:
        return (
            self.bit_identical
            and self.finite_mask_equal
            and self.descales_equal
            and self.centers_equal
            and self.stamps_equal
        )


@dataclass(frozen=True)
class StateChange:
    """Module state that a recompute changed: the forward re-ran a state update."""

    event: tuple | None
    module: str  # module path in the audited model ("" for the root)
    name: str  # buffer or attribute name
    kind: str  # "buffer" | "attribute"
    detail: str  # what changed (values or max |difference|)

    def __str__(self) -> str:
        where = f"{self.module}.{self.name}" if self.module else self.name
        return f"event {self.event}: recompute changed {self.kind} {where} ({self.detail})"


@dataclass
class AuditReport:
    """Per (event, layer, site) rows plus the ledger's violations and the module state that
    recomputes changed."""

    rows: list[AuditRow] = field(default_factory=list)
    violations: list = field(default_factory=list)
    state_changes: list[StateChange] = field(default_factory=list)

    @property
    def mismatches(self) -> list[AuditRow]:
        return [r for r in self.rows if not r.ok]

    @property
    def recomputed(self) -> int:
        return sum(r.recomputed for r in self.rows)

    @property
    def early_stopped(self) -> int:
        """Recomputed calls compared at their operands only (their output was never rebuilt)."""
        return sum(r.recomputed and not r.output_recomputed for r in self.rows)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.violations and not self.state_changes

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
        head = (
            f"{'layer':<32} {'calls':>6} {'recomp':>6} {'early':>5} {'mismatch':>8} {'viol':>5} "
            f"{'max|diff|':>11} {'max rel':>10}"
        )
        lines = [head, "-" * len(head)]
        early = Counter(r.layer for r in self.rows if r.recomputed and not r.output_recomputed)
        for layer, s in sorted(self.per_layer().items()):
            lines.append(
                f"{layer:<32} {s['calls']:>6} {s['recomputed']:>6} {early[layer]:>5} {s['mismatches']:>8} "
                f"{s.get('violations', 0):>5} {s['max_abs_diff']:>11.4g} {s['max_rel_diff']:>10.4g}"
            )
        lines += [f"state: {c}" for c in self.state_changes]
        verdict = (
            "OK: forward and recompute bit-identical"
            if self.ok
            else (
                f"FAIL: {len(self.mismatches)} mismatching call(s), {len(self.violations)} ledger violation(s), "
                f"{len(self.state_changes)} module state change(s) in recompute"
            )
        )
        lines.append(verdict)
        lines.append("(early: recomputes stopped before the layer's output; compared at its quantized operands)")
        return "\n".join(lines)


def _bytes(t: torch.Tensor) -> bytes:
    raw = t.view(torch.uint8) if t.element_size() > 0 and t.numel() else t
    return raw.numpy().tobytes()


def _descale_key(descale: torch.Tensor):
    """A one-element descale (per tensor) as its float; one of any other layout as the sha256 of its bytes."""
    if descale.numel() == 1:
        return float(descale)
    return hashlib.sha256(_bytes(descale.detach().to("cpu", copy=True).contiguous())).hexdigest()


def _digest(output, snaps: dict) -> _Digest:
    tensors = [output] if isinstance(output, torch.Tensor) else list(output)
    hosts = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
    sha = hashlib.sha256()
    for host in hosts:
        sha.update(f"{host.dtype}{tuple(host.shape)}".encode())
        sha.update(_bytes(host))
    descales = {role: _descale_key(s.descale) for role, s in snaps.items()}
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


def _operand_tensors(data) -> list[torch.Tensor]:
    return [data] if isinstance(data, torch.Tensor) else [t for t in data if isinstance(t, torch.Tensor)]


@dataclass
class _Operand:
    sha256: str
    values: torch.Tensor | None  # FP8 codes decoded with the paired descale (float32, host); None for FP4


def _operand_digest(data, snap, layout) -> _Operand:
    """The operand's bytes, stamps and descale as one sha256, and its FP8 codes decoded with
    the descale laid out as ``layout`` (the recipe's :class:`~lightning_fp8state.formats.ScaleLayout`
    of the role) for the report's differences."""
    hosts = [t.detach().to("cpu", copy=True).contiguous() for t in _operand_tensors(data)]
    sha = hashlib.sha256()
    for host in hosts:
        sha.update(f"{host.dtype}{tuple(host.shape)}".encode())
        sha.update(_bytes(host))
    sha.update(f"{_descale_key(snap.descale)}{snap.owner}{snap.event}{snap.region}{snap.ordinal}".encode())
    values = None
    first = hosts[0] if hosts else None
    # FP8 codes decoded (a stateless role hands in its input after them, which the sha covers)
    if first is not None and first.dtype.is_floating_point and (len(hosts) == 1 or first.element_size() == 1):
        descale = layout.expand(snap.descale.detach().to("cpu", torch.float32), first.shape)
        values = first.to(torch.float32) * descale
    return _Operand(sha.hexdigest(), values)


# nn.Module's own bookkeeping attributes: not model state
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_is_hf_initialized"}
# Attributes an engine keeps on the modules it drives, counted per forward call by design (a
# recompute is a forward call to it): DeepSpeed ZeRO-3's partitioning hooks (``ds_id``,
# ``ds_grads_remaining``, ...). Not the model's state, so not reported.
_ENGINE_PREFIXES = ("ds_",)


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device))


def _module_state(module: nn.Module) -> dict:
    """``module``'s own state (not its children's): buffers (bits) and plain attributes."""
    out = {}
    for name, buf in module._buffers.items():
        if buf is not None:
            out[("buffer", name)] = buf.detach().clone()
    for name, value in module.__dict__.items():
        if name in _MODULE_INTERNALS or name.startswith(_ENGINE_PREFIXES):
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            out[("attribute", name)] = value.detach().clone()
        elif _plain(value) or (isinstance(value, tuple) and all(_plain(v) for v in value)):
            out[("attribute", name)] = value
    return out


def _state_diff(before: dict, after: dict) -> list[tuple[str, str, str]]:
    changes = []
    for key in before.keys() | after.keys():
        kind, name = key
        a, b = before.get(key, "<unset>"), after.get(key, "<unset>")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                changes.append((kind, name, f"{tuple(a.shape)} {a.dtype} -> {tuple(b.shape)} {b.dtype}"))
            elif not torch.equal(_bits(a), _bits(b)):
                if a.is_floating_point():
                    detail = (
                        f"max |difference| {float((a.double() - b.double()).abs().nan_to_num(float('inf')).max()):.4g}"
                    )
                else:
                    detail = f"{a.reshape(-1)[:4].tolist()} -> {b.reshape(-1)[:4].tolist()}"
                changes.append((kind, name, detail))
        elif type(a) is not type(b) or a != b:
            changes.append((kind, name, f"{a!r} -> {b!r}"))
    return sorted(changes)


class RecomputeAuditor:
    """Context manager that records forward/recompute digests of every converted module.

    Args:
        state: the :class:`~lightning_fp8state.Fp8State` (or protocol) to audit.
        model: optional; when given, every module of it is watched for state that a
            recompute changes (buffers and plain attributes, each module's own), reported as
            :class:`StateChange` rows (a report with any is not ``ok``). Buffers that
            :func:`~lightning_fp8state.checkpoint` writes back after the recompute
            (``restore_buffers``, on by default) are not reported: the change does not last.
            Under torch's or DeepSpeed's own checkpoint it does, and is reported.

    Example::

        with RecomputeAuditor(state, model=model) as auditor:
            for step in range(10):
                with state.step(step):
                    loss = model(x).float().pow(2).mean()
                    loss.backward()
        assert auditor.report().ok
    """

    def __init__(self, state, model: nn.Module | None = None) -> None:
        self.protocol = getattr(state, "protocol", state)
        self.model = model
        self._forward: dict[tuple, _Digest] = {}
        self._operands: dict[tuple, _Operand] = {}
        self._rows: dict[tuple, AuditRow] = {}
        self._event = None
        self._lock = threading.Lock()
        self._handles: list = []
        self._pending: dict[int, list] = {}  # id(module) -> stack of state snapshots (recompute calls)
        self.state_changes: list[StateChange] = []

    def __enter__(self) -> RecomputeAuditor:
        self.protocol.auditors.append(self)
        if self.model is not None:
            for name, module in self.model.named_modules():
                if norm_kind(module) is not None:
                    # a norm the next Fp8Linear may fold into its encode: that fused prologue reads
                    # the norm's weight without calling it, and refuses a norm with hooks (ZeRO-3's
                    # gather), so a hook here would audit the unfused computation, not the run's
                    continue
                self._handles.append(module.register_forward_pre_hook(self._before_call))
                self._handles.append(
                    module.register_forward_hook(functools.partial(self._after_call, name), always_call=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        self.protocol.auditors.remove(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- module state changed by recompute --------------------------------------------
    # (the hooks run eagerly around a compiled module's call too: traced into its graph they would
    # decide "is this a recompute" once, at trace time)
    @torch.compiler.disable
    def _before_call(self, module: nn.Module, args) -> None:
        if in_backward():  # a module called inside backward: a recompute (any engine)
            # the copies run outside torch SAC's modes: its true forward made none
            self._pending.setdefault(id(module), []).append(outside_selective_checkpoint(_module_state, module))

    @torch.compiler.disable
    def _after_call(self, name: str, module: nn.Module, args, output) -> None:
        stack = self._pending.get(id(module))
        if not stack or not in_backward():
            return
        before = stack.pop()
        event = self.protocol.event
        after = outside_selective_checkpoint(_module_state, module)
        restored = buffers_restored(module)  # lightning_fp8state.checkpoint writes them back at the region's end
        for kind, attr, detail in outside_selective_checkpoint(_state_diff, before, after):
            if kind == "buffer" and restored:
                continue
            change = StateChange(event, name, attr, kind, detail)
            with self._lock:
                self.state_changes.append(change)

    # -- outputs and operands ----------------------------------------------------------
    def _row(self, record: CallRecord, key: tuple) -> AuditRow:
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = AuditRow(record.event, record.layer, record.site, "")
        return row

    def _new_event(self, event) -> None:
        if event != self._event:  # recompute never crosses events: free old copies
            self._forward, self._operands = {}, {}
            self._event = event

    def observe_operand(self, record: CallRecord, role: str, phase: Phase, data, snap) -> None:
        """Digest one quantized operand of a forward role (the FP8 codes, or FP4 packed codes
        and block scales, with the snapshot's stamps and descale) and compare a recompute's
        with its true forward's: this sees early-stopped recomputes too."""
        if phase is Phase.INFERENCE or role_phase(role) != "forward":
            return
        key = (record.event, record.layer, record.site)
        digest = _operand_digest(data, snap, self.protocol.recipe.scale_layout(role))
        with self._lock:
            if phase is Phase.FORWARD:
                self._new_event(record.event)
                self._row(record, key)
                self._operands[(key, role)] = digest
                return
            fwd = self._operands.get((key, role))
            if fwd is None:
                return
            row = self._row(record, key)
            row.operands_compared += 1
            if fwd.sha256 != digest.sha256:
                row.operands_equal = False
                if role not in row.operand_mismatches:
                    row.operand_mismatches.append(role)
                if fwd.values is not None and digest.values is not None and fwd.values.shape == digest.values.shape:
                    a, b = fwd.values.double(), digest.values.double()
                    both = torch.isfinite(a) & torch.isfinite(b)
                    row.finite_mask_equal = row.finite_mask_equal and bool(
                        torch.equal(torch.isfinite(a), torch.isfinite(b))
                    )
                    if both.any():
                        diff = (a - b).abs()[both]
                        row.max_abs_diff = max(row.max_abs_diff, float(diff.max()))
                        rel = diff / a.abs()[both].clamp_min(torch.finfo(torch.float32).tiny)
                        row.max_rel_diff = max(row.max_rel_diff, float(rel.max()))

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
                self._new_event(record.event)
                self._forward[key] = digest
                self._row(record, key).forward_sha256 = digest.sha256
            elif key in self._forward:
                _compare(self._row(record, key), self._forward[key], digest)

    def report(self) -> AuditReport:
        """Rows in event order, the ledger's violations so far, and module state changes."""
        with self._lock:
            rows = [self._rows[k] for k in sorted(self._rows, key=lambda k: (k[0], k[1], k[2]))]
            changes = list(self.state_changes)
        return AuditReport(rows, list(self.protocol.ledger.violations), changes)


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
    stamps: the same verdict as ``AuditRow.ok``. The quantized operands are compared at the
    quantize too (an early-stopped recompute never produces the last layer's output). Per
    step: a device count of mismatching calls and a host count of recomputed calls. Memory:
    one copy of the open event's outputs and FP8 operands.
    """

    def __init__(self, state) -> None:
        self.protocol = getattr(state, "protocol", state)
        self._forward: dict[tuple, _Call] = {}
        self._operands: dict[tuple, tuple] = {}
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
        self._forward, self._operands, self._bad = {}, {}, {}

    def observe_operand(self, record: CallRecord, role: str, phase: Phase, data, snap) -> None:
        """Clone a forward role's quantized operand in the true forward; compare its recompute's
        bits, descale and stamps on the device (early-stopped recomputes included)."""
        if phase is Phase.INFERENCE or role_phase(role) != "forward":
            return
        key = (record.event, record.layer, record.site)
        tensors = [t.detach() for t in _operand_tensors(data)]
        stamps = (str(snap.owner), snap.event, snap.region, snap.ordinal)
        if phase is Phase.FORWARD:
            if record.event != self._event:
                self._flush()
                self._event = record.event
            self._operands[(key, role)] = ([t.clone() for t in tensors], snap.descale.detach().clone(), stamps)
            return
        fwd = self._operands.get((key, role))
        if fwd is None:
            return
        self.recomputed[record.event[0]] += key not in self._bad
        device = tensors[0].device if tensors else torch.device("cpu")
        bad = self._bad.get(key, torch.zeros((), dtype=torch.bool, device=device))
        codes, descale, fwd_stamps = fwd
        if (
            fwd_stamps != stamps
            or len(codes) != len(tensors)
            or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(codes, tensors, strict=False))
        ):
            bad = torch.ones((), dtype=torch.bool, device=device)
        else:
            for a, b in zip(codes, tensors, strict=True):
                bad = bad | (_bits(a) != _bits(b)).any()
            bad = bad | (descale != snap.descale).any().to(device)
        self._bad[key] = bad

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
