"""The experts' grouped GEMMs (issue 44), on the CPU: the offsets and padding, the eligibility
(a pure function naming each refusal), and the whole grouped path of Fp8Experts run against a
reference of ``torch._scaled_grouped_mm``'s documented semantics and constraints (it has no CPU
kernel): equal to the per-expert loop up to accumulation order, an idle expert in the middle,
the recompute bitwise the true forward; the bf16 path through torch's own ``_grouped_mm``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.nn import grouped_gemm as gg
from lightning_fp8state.quant_recipes.registry import recipe_for, recipe_names
from tests.conftest import bitwise_equal

E, D, FF, K, T = 4, 32, 48, 2, 40
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_padded_rows_and_group_ends():
    assert gg.padded_rows((0, 5, 16, 17, 33)) == (16, 16, 16, 32, 48)
    assert gg.padded_rows((3, 8), align=8) == (8, 8)
    assert gg.group_ends((3, 0, 4, 9)) == (3, 3, 7, 16)
    assert gg.group_ends(()) == ()


def test_no_grouped_gemm_on_the_cpu():
    cpu = torch.device("cpu")
    assert not gg.grouped_device(cpu) and not gg.grouped_device(cpu, "_grouped_mm")
    problem = gg.fp8_grouped_problem(E4M3, E4M3, torch.bfloat16, (64, 64), 4, 100, cpu, "auto")
    assert problem is not None and "capability" in problem


OK = dict(left=E4M3, right=E4M3, out=torch.bfloat16, dims=(64, 32), groups=4, rows=100, backend="auto")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(backend="emulated"), r"gemm='emulated'"),
        (dict(backend="scaled_mm"), r"gemm='scaled_mm'"),
        (dict(left=E5M2), r"float8_e5m2 x torch.float8_e4m3fn: the grouped GEMM takes"),
        (dict(right=E5M2), r"float8_e4m3fn x torch.float8_e5m2"),
        (dict(out=torch.float32), r"output torch.float32"),
        (dict(dims=(64, 24)), r"weight \(64, 24\)"),
        (dict(dims=(40, 32)), r"weight \(40, 32\)"),
        (dict(groups=0), r"0 experts"),
        (dict(groups=1024), r"1024 experts"),
        (dict(rows=0), r"no rows"),
    ],
)
def test_fp8_grouped_problem_names_each_refusal(monkeypatch, change, match):
    monkeypatch.setattr(gg, "grouped_device", lambda device, op="_scaled_grouped_mm": True)

    def problem(a):
        return gg.fp8_grouped_problem(
            a["left"], a["right"], a["out"], a["dims"], a["groups"], a["rows"], torch.device("cpu"), a["backend"]
        )

    assert problem(OK) is None
    found = problem(OK | change)
    assert found is not None and re.search(match, found), found


@pytest.mark.parametrize("name", recipe_names())
def test_only_the_per_tensor_recipes_have_the_grouped_products(name):
    expected = {"fp8_delayed": True, "fp8_current": True, "bf16": False}
    per_tensor = gg.per_tensor_gemms(recipe_for(_config(name)))
    if name in expected:
        assert per_tensor is expected[name]
    elif name.startswith(("fp8_rowwise", "fp8_blockwise")):  # scales per row or per tile: GEMMs of their own
        assert per_tensor is False


def _config(recipe: str, **kw) -> f8s.QuantConfig:
    if recipe.startswith("fp8_rowwise"):
        kw.setdefault("backward_format", "e4m3")
    return f8s.QuantConfig(recipe=recipe, **kw)


# --- the whole path against a reference of the device op ----------------------------------------


def reference_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
    """``torch._scaled_grouped_mm`` (torch 2.11, rowwise float32 scales) as its CUDA kernel
    computes it, with the checks its CUDA path makes (aten GroupedBlas.cpp, GroupMMCommon.cuh):
    E4M3 operands, A row-major and B column-major, 16-element dimensions, int32 offsets, rowwise
    scales, a bf16 output, and in the 2-D x 2-D case every group but the last 16-byte aligned.
    Each product accumulates in float32, then ``* scale_a`` and ``* scale_b`` (the epilogue)."""
    assert mat_a.dtype == E4M3 and mat_b.dtype == E4M3, (mat_a.dtype, mat_b.dtype)
    assert mat_a.stride(-1) == 1 and mat_a.stride(-2) > 1, ("A row-major", mat_a.stride())
    assert mat_b.stride(-2) == 1 and mat_b.stride(-1) > 1, ("B column-major", mat_b.stride())
    assert mat_a.shape[-1] % 16 == 0 and mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0
    assert out_dtype in (None, torch.bfloat16) and not kw.get("use_fast_accum", False)
    assert offs is not None and offs.dtype == torch.int32 and offs.dim() == 1
    assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.is_contiguous()
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    a, b = mat_a.float(), mat_b.float()
    if mat_b.dim() == 3:  # 2-D x 3-D: groups of rows
        assert len(ends) == mat_b.shape[0] and ends[-1] <= mat_a.shape[0]
        assert scale_a.shape == (mat_a.shape[0],) and scale_b.shape == (mat_b.shape[0], mat_b.shape[2])
        assert scale_b.stride(1) == 1
        out = torch.zeros(mat_a.shape[0], mat_b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = (a[s:e] @ b[g]) * scale_a[s:e, None] * scale_b[g][None, :]
        return out.to(torch.bfloat16)
    groups, m, n = len(ends), mat_a.shape[0], mat_b.shape[1]  # 2-D x 2-D: groups of the contraction
    assert all((e - s) % 16 == 0 for s, e in zip(starts[:-1], ends[:-1], strict=True)), ends
    assert scale_a.shape == (m * groups,) and scale_b.shape == (n * groups,)
    out = torch.zeros(groups, m, n)
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        out[g] = (a[:, s:e] @ b[s:e]) * scale_a[g * m : (g + 1) * m, None] * scale_b[g * n : (g + 1) * n][None, :]
    return out.to(torch.bfloat16)


@pytest.fixture
def device_op(monkeypatch):
    """The CPU taken for a device with the grouped kernels, ``torch._scaled_grouped_mm`` the
    reference; counts its calls (``calls["fp8"]``) and ``torch._grouped_mm``'s (``calls["bf16"]``)."""
    calls = {"fp8": 0, "bf16": 0}
    grouped_mm = torch._grouped_mm

    def fp8(*args, **kw):
        calls["fp8"] += 1
        return reference_scaled_grouped_mm(*args, **kw)

    def bf16(*args, **kw):
        calls["bf16"] += 1
        return grouped_mm(*args, **kw)

    monkeypatch.setattr(gg, "grouped_device", lambda device, op="_scaled_grouped_mm": True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", fp8, raising=False)
    monkeypatch.setattr(torch, "_grouped_mm", bf16)
    return calls


def experts(recipe: str, grouped: bool, **cfg):
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = GroupedExperts(E, D, FF)
    with torch.no_grad():
        for name in model.experts.projections:
            getattr(model.experts, name).normal_(0, 0.2)
    model = model.to(torch.bfloat16)
    state = f8s.Fp8State(_config(recipe, **cfg))
    state.convert(model)
    model.experts.grouped_gemm = grouped
    return state, model.experts


def routing(seed: int, idle: tuple[int, ...] = (1,)):
    """Inputs and a top-2 routing that leaves ``idle`` without a token (expert 1: in the middle)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 2.0).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(idle)] = -torch.inf
    weights, index = logits.softmax(-1).topk(K, dim=-1)
    return x, index, weights


def step(state, module, event, n: int):
    x, index, weights = event
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(99 + n))
    with state.step(n):
        y = module(x, index, weights)
        state.commit_forward()
        (y.float() * probe).sum().backward()  # a gradient that does not depend on the path taken
    return [y.detach(), x.grad, *(getattr(module, p).grad for p in module.projections)]


def close(got, want):
    """Equal up to the accumulation order: one bfloat16 rounding apart, relative to the tensor."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * float(want.abs().max()))


@pytest.mark.parametrize(
    "recipe, backward_format, calls_per_step",
    [
        ("fp8_delayed", "e4m3", 6),  # 2 projections x (forward, input and weight gradients)
        ("fp8_current", "e4m3", 6),
        ("fp8_delayed", "e5m2", 2),  # E5M2 gradients: the backward keeps the loop
    ],
)
def test_the_grouped_path_is_the_loop_up_to_accumulation_order(device_op, recipe, backward_format, calls_per_step):
    state, module = experts(recipe, grouped=True, backward_format=backward_format)
    ref_state, ref = experts(recipe, grouped=False, backward_format=backward_format)
    for n in range(3):
        ref_state.load_state_dict(state.state_dict())  # the same scales: only the GEMMs differ
        before = device_op["fp8"]
        got = step(state, module, routing(n), n)
        assert device_op["fp8"] - before == calls_per_step
        want = step(ref_state, ref, routing(n), n)
        assert device_op["fp8"] - before == calls_per_step  # the loop calls none
        for g, w in zip(got, want, strict=True):
            close(g, w)
        for p in module.projections:  # the idle expert in the middle: no gradient
            assert not getattr(module, p).grad[1].any()


def test_an_active_expert_without_local_rows_gets_a_zero_gradient(device_op):
    """Under amax reduction an expert active on another rank runs here on zero rows: its group of
    the weight gradient is 16 zero rows, an exact zero."""
    left = [torch.randn(64, n).to(E4M3) for n in (5, 0, 37)]
    right = [torch.randn(n, 32).to(E4M3) for n in (5, 0, 37)]
    snaps = [_Snap(torch.tensor(0.5 + i)) for i in range(3)]
    out = gg.grouped_expert_gemms("grad_weight", _recipe(), left, right, snaps, snaps, torch.bfloat16, "auto")
    assert out.shape == (3, 64, 32) and device_op["fp8"] == 1
    assert not out[1].any()
    for e in (0, 2):
        want = (left[e].float() @ right[e].float()) * snaps[e].descale * snaps[e].descale
        close(out[e], want.to(torch.bfloat16))


class _Snap:
    def __init__(self, descale):
        self.descale = descale


def _recipe():
    return recipe_for(_config("fp8_delayed", backward_format="e4m3"))


def test_the_choice_is_the_same_in_forward_and_recompute_and_the_recompute_is_bitwise(device_op):
    """A checkpointed call under the grouped path: its recompute takes the grouped GEMM again and
    is bitwise its true forward (the audit compares them), its gradients bitwise the plain run's."""

    def run(checkpointed: bool):
        state, module = experts("fp8_delayed", grouped=True, backward_format="e4m3")
        x, index, weights = routing(7)
        x = x.clone().requires_grad_(True)
        with f8s.RecomputeAuditor(state) as auditor, state.step(0):
            if checkpointed:
                y = f8s.checkpoint(module, x, index, weights, use_reentrant=False)
            else:
                y = module(x, index, weights)
            state.commit_forward()
            y.float().pow(2).mean().backward()
        return auditor.report(), [y.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.grad]

    report, got = run(True)
    calls = device_op["fp8"]
    _, want = run(False)
    assert calls == 6 + 2 and device_op["fp8"] - calls == 6  # the recompute ran both forwards grouped
    assert report.ok and sum(r.recomputed for r in report.rows) > 0, report.format_table()
    for g, w in zip(got, want, strict=True):
        assert bitwise_equal(g, w)


def test_the_bf16_recipe_runs_one_grouped_mm_per_product(device_op):
    state, module = experts("bf16", grouped=True)
    ref_state, ref = experts("bf16", grouped=False)
    got = step(state, module, routing(3), 0)
    assert device_op["bf16"] == 2 * 3  # 2 projections x (forward, input and weight gradients)
    want = step(ref_state, ref, routing(3), 0)
    assert device_op["bf16"] == 6 and device_op["fp8"] == 0
    for g, w in zip(got, want, strict=True):
        close(g, w)
    for p in module.projections:
        assert not getattr(module, p).grad[1].any()


def test_grouped_gemm_false_keeps_the_loop(device_op):
    state, module = experts("fp8_current", grouped=False, backward_format="e4m3")
    step(state, module, routing(0), 0)
    assert device_op == {"fp8": 0, "bf16": 0}


# --- each expert's rows padded to a multiple of 16 on the device ---------------------------------


def test_pad_groups_pads_each_group_with_zero_rows_and_unpad_inverts_it_with_gradients():
    counts = (5, 0, 16, 17)
    rows = gg.aligned_rows(counts)
    assert rows == (16, 0, 16, 32)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    padded = gg.pad_groups(x, counts, rows)
    assert padded.shape == (sum(rows), 8)
    starts, src = 0, 0
    for n, r in zip(counts, rows, strict=True):
        assert torch.equal(padded[starts : starts + n], x[src : src + n])
        assert not padded[starts + n : starts + r].any()  # the padding: zero rows
        starts, src = starts + r, src + n
    back = gg.unpad_groups(padded * 3.0, counts, rows)
    assert torch.equal(back, x * 3.0)
    grad = torch.randn(back.shape)
    back.backward(grad)
    assert torch.equal(x.grad, grad * 3.0)  # the padding rows' gradients are dropped, the rest kept
    aligned = torch.randn(32, 8)
    assert gg.pad_groups(aligned, (16, 16), (16, 16)) is aligned  # nothing to pad: no copy


def test_the_experts_operands_are_padded_to_16_rows_on_the_device(device_op, monkeypatch):
    """Every group of every grouped GEMM has a multiple of 16 rows (the token counts routing gives
    are not), and the padded module is the unpadded loop up to accumulation order."""
    groups = []
    reference = torch._scaled_grouped_mm

    def recording(mat_a, mat_b, scale_a, scale_b, offs=None, **kw):
        ends = offs.tolist()
        groups.extend(e - s for s, e in zip([0, *ends[:-1]], ends, strict=True))
        return reference(mat_a, mat_b, scale_a, scale_b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", recording)
    state, module = experts("fp8_delayed", grouped=True, backward_format="e4m3")
    ref_state, ref = experts("fp8_delayed", grouped=False, backward_format="e4m3")
    event = routing(5)
    counts = f8s.nn.experts.route(event[1], E).counts
    assert any(n % 16 for n in counts)  # the case padding is for
    got = step(state, module, event, 0)
    want = step(ref_state, ref, event, 0)
    assert groups and all(g % 16 == 0 for g in groups), groups
    for g, w in zip(got, want, strict=True):
        close(g, w)


def test_scaled_matmul_writes_out_in_place_and_names_a_wrong_out():
    from lightning_fp8state.errors import ConfigError
    from lightning_fp8state.quant_recipes.gemm import scaled_matmul

    a = torch.randn(24, 32).to(E5M2)
    b = torch.randn(32, 40).to(E4M3)
    da, db = torch.tensor(0.5), torch.tensor(0.25)
    fresh = scaled_matmul(a, b, da, db, torch.bfloat16)
    whole = torch.full((2, 24, 40), 7.0, dtype=torch.bfloat16)
    assert scaled_matmul(a, b, da, db, torch.bfloat16, out=whole[1]).data_ptr() == whole[1].data_ptr()
    assert bitwise_equal(whole[1], fresh) and (whole[0] == 7.0).all()
    for wrong in (
        torch.empty(24, 41, dtype=torch.bfloat16),
        torch.empty(24, 40),
        torch.empty(40, 24, dtype=torch.bfloat16).t(),
    ):
        with pytest.raises(ConfigError, match="out"):
            scaled_matmul(a, b, da, db, torch.bfloat16, out=wrong)
