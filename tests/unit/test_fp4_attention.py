"""Packed-FP4 attention operands on the protocol: an 8-layer checkpointed stack, ownership
(per_layer vs per_model, with and without a snapshot on top), the centered variant, commits,
saved memory, the bf16 control, state save/load.

Every defect test asserts both sides: the defect (naive / per_model) fails and the fix
(safe / per_layer) passes, on the same model and data.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state import ops
from tests.conftest import bitwise_equal, run_events

N_LAYERS = 8
N_EVENTS = 10
D, HEADS = 64, 2  # head_dim 32: a whole number of blocks in both layouts
LAYOUTS = ["nvfp4", "mxfp4"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors here are tiny: intra-op threads only add synchronisation (and stall badly on
    a busy 2-core runner)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    run_stack.cache_clear()  # the cached runs hold every event's gradients


class AttnBlock(nn.Module):
    """x + proj(attention(q, k, v)), its operands quantized by an Fp4AttentionQuantizer.

    ``gain`` scales k up and q down (the logits keep their size, the operands' magnitudes
    differ per layer by ``gain``); ``offset`` adds a per-channel offset to k (what the
    centered variant is for).
    """

    def __init__(self, gain: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.quant = f8s.Fp4AttentionQuantizer()
        self.gain = gain
        self.register_buffer("offset", offset * torch.linspace(-1.0, 1.0, D // HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = self.quant.attention(q / self.gain, k * self.gain + self.offset * self.gain, v, is_causal=True)
        return x + self.proj(att.transpose(1, 2).reshape(b, t, d))


class AttnStack(nn.Module):
    """Blocks run ascending; checkpointed blocks are recomputed descending in backward."""

    def __init__(self, ckpt=None, n: int = N_LAYERS, offset: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttnBlock(gain=2.0**i, offset=offset) for i in range(n))
        self.ckpt = ckpt  # None | (engine, use_reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                engine, reentrant = self.ckpt
                kw = {} if engine == "deepspeed" else {"use_reentrant": reentrant}
                x = f8s.checkpoint(block, x, engine=engine, **kw)
        return x


def stack_inputs(n_events: int = N_EVENTS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, D, generator=g) * 1.2**i for i in range(n_events)]


class _Order:
    """Records (phase, layer index) of every attention call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[f8s.Phase, int]] = []

    def observe(self, record, phase, output, snaps):
        self.calls.append((phase, int(record.layer.split(".")[1])))


@functools.cache
def run_stack(mode="safe", ownership="per_layer", layout="nvfp4", centered=False, ckpt=("torch", False), **cfg):
    """One 10-event training run of the 8-layer stack (cached: tests only read results)."""
    cfg = {"strict": False} | cfg
    offset = cfg.pop("offset", 3.0 if centered else 0.0)
    state = f8s.Fp8State(
        f8s.QuantConfig(
            mode=mode,
            ownership=ownership,
            include=(),  # the Linears stay plain: only attention operands are quantized here
            attn_format=layout,
            attn_centered=centered,
            **cfg,
        )
    )
    torch.manual_seed(0)
    model = state.convert(AttnStack(ckpt=ckpt, offset=offset))
    order = _Order()
    state.protocol.auditors.append(order)
    with f8s.RecomputeAuditor(state) as auditor:
        outs, grads = run_events(state, model, stack_inputs())
    return state, auditor.report(), outs, grads, order.calls


def grads_equal(a, b) -> bool:
    return all(bitwise_equal(ga[n], gb[n]) for ga, gb in zip(a, b, strict=True) for n in ga)


def mismatching_layers(report) -> set[int]:
    return {int(r.layer.split(".")[1]) for r in report.mismatches}


# --------------------------------------------------------------------------------------
# The 8-layer stack: per_layer is exact, per_model is not, a snapshot does not repair it
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centered"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_layer_recompute_is_bit_identical_and_checkpointed_grads_equal_uncheckpointed(layout, centered):
    state, report, outs, grads, order = run_stack(layout=layout, centered=centered)
    first = order[: 2 * N_LAYERS]
    assert [i for p, i in first if p is f8s.Phase.FORWARD] == list(range(N_LAYERS))
    assert [i for p, i in first if p is f8s.Phase.RECOMPUTE] == list(reversed(range(N_LAYERS)))
    assert report.recomputed == N_LAYERS * N_EVENTS
    assert {r.event for r in report.rows if r.recomputed} == {(i, 0) for i in range(N_EVENTS)}
    assert report.ok, report.format_table()
    assert state.ledger.ok
    summary = report.per_layer()  # the audit covers every attention owner's layer
    assert set(summary) == {f"blocks.{i}.quant" for i in range(N_LAYERS)}
    assert all(v["calls"] == v["recomputed"] == N_EVENTS and v["mismatches"] == 0 for v in summary.values())
    _, _, outs_ref, grads_ref, _ = run_stack(layout=layout, centered=centered, ckpt=None)
    assert all(bitwise_equal(a, b) for a, b in zip(outs, outs_ref, strict=True))
    assert grads_equal(grads, grads_ref)
    # The defect on the same model and data: naive timing breaks exactly this.
    _, naive, _, naive_grads, _ = run_stack("naive", layout=layout, centered=centered)
    _, _, _, naive_ref, _ = run_stack("naive", layout=layout, centered=centered, ckpt=None)
    assert not naive.ok and len(naive.mismatches) >= N_EVENTS
    assert sum(v["mismatches"] for v in naive.per_layer().values()) == len(naive.mismatches)
    assert {v.owner.role for v in naive.violations} == {"attn_q", "attn_k"}
    assert not grads_equal(naive_grads, naive_ref)


@pytest.mark.parametrize("ckpt", [("torch", True), ("deepspeed", None)], ids=["torch-reentrant", "deepspeed"])
def test_per_layer_is_exact_under_the_reentrant_engines_too(ckpt):
    _, report, outs, grads, _ = run_stack(ckpt=ckpt, centered=True)
    assert report.recomputed == N_LAYERS * N_EVENTS and report.ok, report.format_table()
    _, _, outs_ref, grads_ref, _ = run_stack(centered=True, ckpt=None)
    assert grads_equal(grads, grads_ref)
    _, naive, _, _, _ = run_stack("naive", "per_model", ckpt=ckpt, centered=True)
    assert not naive.ok


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_model_differs_and_a_snapshot_on_top_does_not_repair_it(layout):
    """The seed's bug class two. One state set for the whole model: reverse-order recompute
    reads state another layer left behind. Adding the seed's first fix on top — one snapshot
    per owner, taken before the advance and replayed in recompute — preserves the wrong
    owner's value: every layer but the last recomputes with the last layer's snapshot. The
    same snapshot with per-layer owners is exact; the full protocol with per-layer owners is
    exact."""
    # The fix.
    _, own, _, own_grads, _ = run_stack(layout=layout)
    _, _, _, own_ref, _ = run_stack(layout=layout, ckpt=None)
    assert own.ok and grads_equal(own_grads, own_ref)
    # per_model: recompute differs from the forward, checkpointed grads from uncheckpointed.
    _, shared, _, shared_grads, _ = run_stack("naive", "per_model", layout)
    _, _, _, shared_ref, _ = run_stack("naive", "per_model", layout, ckpt=None)
    assert not shared.ok
    assert len(mismatching_layers(shared)) >= N_LAYERS // 2
    assert not grads_equal(shared_grads, shared_ref)
    # per_model + a snapshot per owner: still differs.
    _, snap, _, snap_grads, _ = run_stack("naive_snapshot", "per_model", layout)
    _, _, _, snap_ref, _ = run_stack("naive_snapshot", "per_model", layout, ckpt=None)
    assert mismatching_layers(snap) == set(range(N_LAYERS - 1))  # all but the last layer
    wrong = [r for r in snap.mismatches if r.recomputed]
    assert len(wrong) == (N_LAYERS - 1) * N_EVENTS
    assert all(not r.stamps_equal for r in wrong)  # recompute read another call's snapshot
    assert not grads_equal(snap_grads, snap_ref)
    # The very same snapshot scheme with per-layer owners repairs the timing defect.
    _, snap_own, _, snap_own_grads, _ = run_stack("naive_snapshot", "per_layer", layout)
    _, _, _, snap_own_ref, _ = run_stack("naive_snapshot", "per_layer", layout, ckpt=None)
    assert snap_own.ok, snap_own.format_table()
    assert grads_equal(snap_own_grads, snap_own_ref)


def test_per_model_with_the_full_protocol_is_still_the_wrong_owner():
    """Our per-event frozen copy and per-call stash make per_model recompute consistent —
    and the state is still wrong: the ledger flags one owner entered by 8 layers (strict
    mode refuses it), and the quiet layers are quantized with the loud layer's scale."""
    shared_state, shared, _, _, _ = run_stack("safe", "per_model")
    own_state, own, _, _, _ = run_stack("safe", "per_layer")
    assert all(r.bit_identical for r in shared.rows)  # the snapshots did their job...
    assert not shared.ok and {v.kind for v in shared.violations} == {"shared_owner"}  # ...the owner is wrong
    assert {v.owner.role for v in shared.violations} == {"attn_q", "attn_k"}
    assert own.ok
    with pytest.raises(f8s.StateTransitionError, match="wrong owner"):
        run_stack("safe", "per_model", strict=True)

    # One history for all layers holds the loudest layer's amax. q of layer 0 (gain 1) is
    # the loudest q, with the same data in both runs (nothing quantized precedes it): every
    # layer's q is quantized with exactly layer 0's scale, though layer 7's q is 2**7 times
    # quieter. Likewise every k gets (about) layer 7's scale, 2**7 too small for layer 0.
    def own(layer, role):
        return own_state.scale_of(f8s.OwnerKey(f"blocks.{layer}.quant", role))

    shared_q = shared_state.scale_of(f8s.OwnerKey("*", "attn_q"))
    shared_k = shared_state.scale_of(f8s.OwnerKey("*", "attn_k"))
    assert torch.equal(shared_q, own(0, "attn_q"))
    assert own(N_LAYERS - 1, "attn_q") / shared_q > 2.0 ** (N_LAYERS - 1) / 4
    assert own(0, "attn_k") / shared_k > 2.0 ** (N_LAYERS - 1) / 4
    assert shared_k <= 1.25 * own(N_LAYERS - 1, "attn_k")


# --------------------------------------------------------------------------------------
# The centered variant
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_naive_centered_recompute_shows_the_stale_center(layout):
    """Safe: the recompute reads the frozen center, bit-identical. Naive: the live center
    has moved by recompute time, and the audit sees it."""
    _, safe, _, _, _ = run_stack(layout=layout, centered=True)
    assert safe.ok and all(r.centers_equal for r in safe.rows)
    _, naive, _, _, _ = run_stack("naive", layout=layout, centered=True)
    stale = [r for r in naive.rows if r.recomputed and not r.centers_equal]
    assert len(stale) >= (N_LAYERS - 1) * N_EVENTS
    assert not naive.ok


def _owner_state(state, owner):
    i = state.bank.index[owner]
    w = state.bank.center_width[i]
    return state.bank.scale[i].clone(), state.bank.descale[i].clone(), state.bank.center[i, :w].clone()


def _offset_stream(n_events: int, seed: int = 0):
    """Keys with a large per-channel offset (8x their spread) that drifts 3% per event."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randn(32, generator=g) * 8
    for t in range(n_events):
        k = pattern * (1 + 0.03 * t) + torch.randn(2, 2, 16, 32, generator=g)
        yield t, torch.randn(2, 2, 16, 32, generator=g), k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stale_center_error_exceeds_stale_scale_error(layout):
    """Naive mode hands the consumer the descale and center already advanced for the next
    call. On the same data, the part of that error due to the stale center (an additive
    shift) is larger than the part due to the stale scale (a ratio), although the scale
    moves every event here (amax_algo=most_recent). Safe mode decodes exactly with the
    values the data was encoded with."""
    owner = f8s.OwnerKey("attn", "attn_k")
    results = {}
    for mode in ("naive", "safe"):
        state = f8s.Fp8State(
            f8s.QuantConfig(mode=mode, attn_format=layout, attn_centered=True, amax_algo="most_recent")
        )
        quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
        rows = []
        for t, q, k in _offset_stream(12):
            before = _owner_state(state, owner) if owner in state.bank.index else None
            with state.step(t):
                _, kh = quant(q.requires_grad_(), k.requires_grad_())
                kh.sum().backward()
            after = _owner_state(state, owner)
            if t >= 4:  # past the warm-up: the center tracks the offset
                rows.append((k, kh.detach(), before, after))
        results[mode] = rows
    stale_scale_err, stale_center_err = [], []
    for k, kh, (s0, d0, c0), (s1, d1, c1) in results["naive"]:
        packed, scales = ops.quantize_fp4(k, s0.reshape(1), layout, c0)

        def decode(d, c, packed=packed, scales=scales):
            return ops.dequantize_fp4(packed, scales, d.reshape(1), layout, torch.float32, c)

        paired = decode(d0, c0)
        assert bitwise_equal(kh, decode(d1, c1))  # the defect: both advanced
        assert not bitwise_equal(kh, paired)
        assert not torch.equal(s0, s1) and not torch.equal(c0, c1)  # both really moved
        stale_scale_err.append((decode(d1, c0) - paired).abs())
        stale_center_err.append((decode(d0, c1) - paired).abs())
    for es, ec in zip(stale_scale_err, stale_center_err, strict=True):
        assert ec.mean() > 2 * es.mean(), (ec.mean(), es.mean())
        assert ec.max() > es.max(), (ec.max(), es.max())
    for k, kh, (s0, d0, c0), _ in results["safe"]:  # the fix pairs data and metadata
        packed, scales = ops.quantize_fp4(k, s0.reshape(1), layout, c0)
        assert bitwise_equal(kh, ops.dequantize_fp4(packed, scales, d0.reshape(1), layout, torch.float32, c0))


def test_running_center_is_committed_once_per_event_from_the_true_forward():
    """center <- center + m * (midrange of the event's k - center), once per event, however
    often the layer is recomputed; pending statistics are cleared at the commit."""
    state = f8s.Fp8State(f8s.QuantConfig(attn_centered=True, attn_center_momentum=0.5))
    quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
    owner = f8s.OwnerKey("attn", "attn_k")
    center = torch.zeros(32)
    for t, q, k in _offset_stream(4):
        q.requires_grad_()
        with state.step(t):
            out = f8s.checkpoint(lambda a, b: quant.attention(a, b, b), q, k)
            out.sum().backward()
        rows = k.reshape(-1, 32)
        mu = 0.5 * rows.amax(0) + 0.5 * rows.amin(0)
        center = center + torch.tensor(0.5) * (mu - center)
        assert torch.equal(_owner_state(state, owner)[2], center)
        assert state.ledger.commits(owner, (t, 0)) == 1
        assert state.ledger.event((t, 0))[owner].recompute_reads == 1
    i = state.bank.index[owner]
    assert bool((state.bank.center_max[i] == float("-inf")).all())


# --------------------------------------------------------------------------------------
# Commits, memory, control, modes
# --------------------------------------------------------------------------------------


def test_one_commit_per_owner_per_event_by_the_ledger():
    state, report, _, _, _ = run_stack(centered=True, attn_quantize_v=True)
    assert report.ok, report.format_table()
    owners = state.bank.owners
    assert len(owners) == N_LAYERS * 3
    assert {o.role for o in owners} == {"attn_q", "attn_k", "attn_v"}
    assert {o.layer for o in owners} == {f"blocks.{i}.quant" for i in range(N_LAYERS)}
    for event in [(i, 0) for i in range(N_EVENTS)]:
        per_event = state.ledger.event(event)
        assert set(per_event) == set(owners)
        for owner, rec in per_event.items():
            assert (rec.commits, rec.observations, rec.recompute_records, rec.recompute_reads) == (1, 1, 0, 1), owner
    assert all(state.ledger.commits(o) == N_EVENTS for o in owners)
    # naive: every recompute records and commits again
    naive_state, _, _, _, _ = run_stack("naive", centered=True, attn_quantize_v=True)
    owner = f8s.OwnerKey("blocks.3.quant", "attn_k")
    assert naive_state.ledger.commits(owner, (4, 0)) == 2
    assert {v.kind for v in naive_state.ledger.violations} >= {"record_in_recompute", "second_commit"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_operands_are_what_is_saved_for_backward(layout):
    """attention(): what autograd keeps for the operands is uint8 codes and block scales
    (~9/32 or ~17/64 of a bf16 copy); the fake-quant path hands SDPA full-size tensors."""
    state = f8s.Fp8State(f8s.QuantConfig(attn_format=layout, attn_quantize_v=True))
    quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))

    def saved_by(fn):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with state.step(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        out.float().sum().backward()
        return saved

    packed_path = saved_by(lambda: quant.attention(q, k, v))
    dtypes = {t.dtype for t in packed_path}
    assert dtypes == {torch.uint8, {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}[layout]}
    packed_bytes = sum(t.numel() * t.element_size() for t in packed_path)
    operand_bytes = 3 * q.numel() * q.element_size()
    assert packed_bytes <= operand_bytes * (0.25 + 1 / 16 / 2 + 1e-9)
    fake_path = saved_by(lambda: torch.nn.functional.scaled_dot_product_attention(*quant(q, k, v)))
    fake_bytes = sum(t.numel() * t.element_size() for t in fake_path if t.dtype == torch.bfloat16)
    assert fake_bytes >= operand_bytes
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_attention_path_equals_fake_quant_path_and_gradients_pass_straight_through():
    """attention(q, k, v) == SDPA(*quant(q, k, v)) bitwise, forward and gradients; the
    quantizer's backward is the identity (straight-through)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 2, 8, 32, generator=g) for _ in range(3)]
    results = []
    for path in ("attention", "fake"):
        state = f8s.Fp8State(f8s.QuantConfig(attn_centered=True, attn_quantize_v=True))
        quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
        q, k, v = (t.clone().requires_grad_() for t in base)
        with state.step(0):
            if path == "attention":
                out = quant.attention(q, k, v, is_causal=True)
            else:
                qh, kh, vh = quant(q, k, v)
                for t in (qh, kh, vh):
                    t.retain_grad()
                out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            out.pow(2).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
        if path == "fake":
            assert bitwise_equal(q.grad, qh.grad) and bitwise_equal(k.grad, kh.grad)
    for a, b in zip(*results, strict=True):
        assert bitwise_equal(a, b)


def test_bf16_control_passes_operands_through_and_still_audits():
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    torch.manual_seed(0)
    model = state.convert(AttnStack(ckpt=("torch", False)))
    with f8s.RecomputeAuditor(state) as auditor:
        outs, _ = run_events(state, model, stack_inputs(3))
    assert len(state.bank) == 0
    report = auditor.report()
    assert sum(r.recomputed for r in report.rows if r.layer.endswith("quant")) == N_LAYERS * 3
    assert report.ok
    torch.manual_seed(0)
    plain = AttnStack(ckpt=None)
    for block in plain.blocks:
        block.quant = _Identity()
    assert bitwise_equal(plain(stack_inputs(3)[2]), outs[2])


class _Identity(nn.Module):
    def attention(self, q, k, v, **kw):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def test_inference_outside_events_uses_live_state_and_records_nothing():
    state, _, _, _, _ = run_stack(layout="mxfp4", centered=True, ckpt=None)
    torch.manual_seed(0)
    model = state.convert(AttnStack())
    before = {k: v.clone() for k, v in state.bank._tensors().items()}
    commits = state.ledger.commits(f8s.OwnerKey("blocks.0.quant", "attn_q"))
    with torch.no_grad():
        y = model(stack_inputs(1)[0])
    assert torch.isfinite(y).all()
    assert all(torch.equal(before[k], v) for k, v in state.bank._tensors().items())
    assert state.ledger.commits(f8s.OwnerKey("blocks.0.quant", "attn_q")) == commits
    with pytest.raises(f8s.StateTransitionError, match="outside a logical event"):
        model(stack_inputs(1)[0].requires_grad_())


def test_misuse_fails_closed_with_clear_errors():
    with pytest.raises(RuntimeError, match="not bound"):
        f8s.Fp4AttentionQuantizer()(torch.randn(1, 32), torch.randn(1, 32))
    state = f8s.Fp8State(f8s.QuantConfig(attn_centered=True, attn_format="mxfp4"))
    quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
    with pytest.raises(ValueError, match="multiple of 32"), state.step(0):
        quant(torch.randn(2, 16), torch.randn(2, 16))
    with state.step(1):
        quant(torch.randn(2, 32), torch.randn(2, 32))
    with (
        pytest.raises(ValueError, match="the channels of its running center=64 is not allowed: expected 32"),
        state.step(2),
    ):
        quant(torch.randn(2, 64), torch.randn(2, 64))
    other = f8s.Fp8State(f8s.QuantConfig())
    model = nn.Sequential(nn.Linear(4, 4))
    model.attn = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="x")
    other.convert(model)
    assert "already bound to another state" in other.last_conversion.skipped["attn"]
    assert model.attn.protocol is state.protocol


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("attn_format", "fp4", r"attn_format='fp4'.*\['nvfp4', 'mxfp4'\]"),
        ("attn_centered", 1, "attn_centered=1.*true or false"),
        ("attn_center_momentum", 0.0, r"attn_center_momentum=0.0.*\(0, 1\]"),
        ("attn_center_momentum", 1.5, r"attn_center_momentum=1.5.*\(0, 1\]"),
        ("attn_quantize_v", "yes", "attn_quantize_v='yes'.*true or false"),
        ("mode", "snapshot", r"mode='snapshot'.*\['safe', 'naive', 'naive_snapshot'\]"),
    ],
)
def test_fp4_config_errors_name_the_key_and_the_allowed_values(key, value, match):
    with pytest.raises(f8s.ConfigError, match=match):
        f8s.QuantConfig(**{key: value})


# --------------------------------------------------------------------------------------
# State save / load
# --------------------------------------------------------------------------------------


class Mixed(nn.Module):
    """An FP8 Linear and a centered FP4 attention layer in one checkpointed block."""

    def __init__(self) -> None:
        super().__init__()
        self.block = AttnBlock(gain=2.0, offset=3.0)

    def forward(self, x):
        return f8s.checkpoint(self.block, x)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_fp4_state_dict_resumes_bit_identically():
    cfg = {"attn_centered": True, "attn_quantize_v": True, "attn_format": "nvfp4"}
    xs = stack_inputs(8)

    def fresh():
        torch.manual_seed(0)
        state = f8s.Fp8State(f8s.QuantConfig(**cfg))
        return state, state.convert(Mixed())

    state_a, model_a = fresh()
    outs_a, grads_a = run_events(state_a, model_a, xs)
    state_b, model_b = fresh()
    run_events(state_b, model_b, xs[:4])
    saved = _roundtrip(state_b.state_dict())
    assert saved["format_version"] == f8s.STATE_FORMAT_VERSION == 3
    assert set(saved["bank"]["dtypes"]) == {"e4m3", "e5m2", "nvfp4"}
    state_c, model_c = fresh()
    state_c.load_state_dict(saved)
    outs_c, grads_c = run_events(state_c, model_c, xs[4:], step0=4)
    for i in range(4):
        assert bitwise_equal(outs_c[i], outs_a[4 + i])
        assert all(bitwise_equal(grads_c[i][n], grads_a[4 + i][n]) for n in grads_a[0])
    assert bitwise_equal(state_c.bank.center, state_a.bank.center)
    # Without the saved center (reset to 0) the resumed run differs: the center is state.
    state_d, model_d = fresh()
    broken = _roundtrip(state_b.state_dict())
    broken["bank"]["center"].zero_()
    state_d.load_state_dict(broken)
    outs_d, _ = run_events(state_d, model_d, xs[4:5], step0=4)
    assert not bitwise_equal(outs_d[0], outs_a[4])


def test_fp4_state_of_another_layout_or_centering_is_refused():
    def saved_with(**cfg):
        torch.manual_seed(0)
        state = f8s.Fp8State(f8s.QuantConfig(**cfg))
        run_events(state, state.convert(Mixed()), stack_inputs(1))
        return state.state_dict()

    sd = saved_with(attn_centered=True)
    for other in ({"attn_format": "mxfp4", "attn_centered": True}, {"attn_centered": False}):
        state = f8s.Fp8State(f8s.QuantConfig(**other))
        with pytest.raises(f8s.StateLoadError, match="another configuration"):
            state.load_state_dict(sd)
    corrupt = _roundtrip(sd)
    corrupt["bank"]["center"][0, 0] = float("nan")
    with pytest.raises(f8s.StateLoadError, match="'center' holds non-finite"):
        f8s.Fp8State(f8s.QuantConfig(attn_centered=True)).load_state_dict(corrupt)
    corrupt = _roundtrip(sd)
    del corrupt["bank"]["center_width"]
    with pytest.raises(f8s.StateLoadError, match="format 2 bank without 'center_width'"):
        f8s.Fp8State(f8s.QuantConfig(attn_centered=True)).load_state_dict(corrupt)


def test_golden_state_v2_loads_with_the_values_its_maker_fed_it():
    """tests/golden/state_v2.pt was written by tests/golden/make_state_v2.py from constant
    operands q = 1, 3, 2 and k = 4, 8, 2. By the definitions (not this code's output): the
    recorded amax is |x - c| with the event's frozen center c; c <- c + 0.5 * (x - c) (the
    midrange of a constant is itself); scale = 2688 / max(history)."""
    saved = torch.load(Path(__file__).parent.parent / "golden" / "state_v2.pt", weights_only=True)
    assert saved["format_version"] == 2
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4, attn_centered=True, attn_center_momentum=0.5))
    state.load_state_dict(saved)
    expect = {  # role: (history newest first, center after 3 events)
        "attn_q": ([0.25, 2.5, 1.0, 0.0], 1.875),  # centers 0 -> 0.5 -> 1.75 -> 1.875
        "attn_k": ([3.0, 6.0, 4.0, 0.0], 3.5),  # centers 0 -> 2 -> 5 -> 3.5
    }
    for role, (history, center) in expect.items():
        owner = f8s.OwnerKey("attn", role)
        i = state.bank.index[owner]
        assert state.bank.formats[i] == "nvfp4" and state.bank.center_width[i] == 32
        assert state.bank.amax_history[:, i].tolist() == history
        assert state.scale_of(owner).item() == torch.tensor(2688.0 / max(history)).item()
        assert state.bank.center[i].tolist() == [center] * 32
        assert state.ledger.commits(owner) == 3
    assert state.clock.last == (2, 0)
