"""The MoE experts' grouped GEMMs on the GPU (issue 44): the grouped path is taken (the calls of
torch._scaled_grouped_mm / torch._grouped_mm counted), each product equals the per-expert
torch._scaled_mm loop up to accumulation order on fresh random data (a zero-row group included),
the module equals the loop with an idle expert in the middle under fp8_delayed and fp8_current,
a checkpointed recompute is bitwise its true forward and the gradients bitwise an
uncheckpointed run, and the grouped GEMMs make no host sync (only the routing's one copy)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.models.moe import MoEFeedForward
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.nn import grouped_gemm as gg
from lightning_fp8state.nn.experts import expert_gemms, route
from lightning_fp8state.quant_recipes.registry import recipe_for
from tests.conftest import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_the_grouped_path_is_the_default():
    from lightning_fp8state.nn.experts import Fp8Experts

    assert Fp8Experts.grouped_gemm is True


E, D, FF, K, T = 8, 256, 512, 2, 1000
IDLE = 3  # an expert in the middle that receives no token
E4M3 = torch.float8_e4m3fn
CUDA = torch.device("cuda")


@pytest.fixture
def sm90():
    """The grouped kernels run on a capability 9.0 device (the H200); elsewhere the loop runs
    and these tests have nothing to check."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the grouped GEMMs run on sm90 only, this is {torch.cuda.get_device_capability()}")
    assert hasattr(torch, "_scaled_grouped_mm") and hasattr(torch, "_grouped_mm"), torch.__version__
    assert gg.grouped_device(CUDA) and gg.grouped_device(CUDA, "_grouped_mm")


@pytest.fixture
def counted(monkeypatch, sm90):
    """Counts the calls of ``torch._scaled_grouped_mm`` (``"fp8"``) and ``torch._grouped_mm``
    (``"bf16"``), each still the real op."""
    calls = {"fp8": 0, "bf16": 0}
    originals = {"fp8": torch._scaled_grouped_mm, "bf16": torch._grouped_mm}

    def counting(kind):
        def op(*args, **kw):
            calls[kind] += 1
            return originals[kind](*args, **kw)

        return op

    monkeypatch.setattr(torch, "_scaled_grouped_mm", counting("fp8"))
    monkeypatch.setattr(torch, "_grouped_mm", counting("bf16"))
    return calls


def close(got, want, atol_share=2**-7):
    """Equal up to accumulation order: within one bfloat16 rounding, relative to each element,
    plus a small share of the tensor's largest magnitude for sums that cancel. Through a layer's
    later FP8 encode an intermediate one bfloat16 rounding apart can take the neighbouring FP8
    code (a step of 1/8 in E4M3): a few elements (at most 1 in 10,000; 4 of 256,000 on the H200)
    may then sit past that bound, never past 4 times it, and the whole stays within 2^-8 normwise."""
    g, w = got.float(), want.float()
    err, bound = (g - w).abs(), atol_share * float(w.abs().max()) + 2**-7 * w.abs()
    past = err > bound
    assert float(past.float().mean()) <= 1e-4, f"{int(past.sum())} of {w.numel()} past the bound"
    assert bool((err <= 4 * bound).all()), (
        f"largest excess {float((err / bound.clamp_min(1e-30)).max()):.2f}x the bound"
    )
    assert float((g - w).norm()) <= 2**-8 * float(w.norm())


# --- each product, on fresh random operands -------------------------------------------------------


class _Snap:
    def __init__(self, descale):
        self.descale = descale


def _codes(*shape, g):
    return (torch.randn(*shape, device="cuda", generator=g) * 3).clamp(-448, 448).to(E4M3)


def _snaps(n, g):
    return [_Snap(torch.rand((), device="cuda", generator=g) + 0.5) for _ in range(n)]


SEEDS = {"forward": 10, "grad_input": 20, "grad_weight": 30}
ROWS = (37, 0, 129, 5, 300, 17)  # a zero-row group (an expert active on another rank only) among them


def _operands(kind: str, layout: str, g):
    """``(left, right)`` as Fp8Experts hands them to expert_gemms, for fp8_delayed's cast-transpose
    weight (``"delayed"``: codes and transposed codes) or fp8_current's plain codes."""
    n_out, n_in = 2 * FF, D
    if kind == "forward":
        left = [_codes(m, n_in, g=g) for m in ROWS]
        codes = [_codes(n_out, n_in, g=g) for _ in ROWS]
        right = [(c, c.t().contiguous(), None) for c in codes] if layout == "delayed" else codes
    elif kind == "grad_input":
        left = [_codes(m, n_out, g=g) for m in ROWS]
        codes = [_codes(n_out, n_in, g=g) for _ in ROWS]
        right = [c.t().contiguous().t() for c in codes] if layout == "delayed" else codes
    else:
        left = [_codes(m, n_out, g=g).t().contiguous() for m in ROWS]  # the cast-transpose's [out, rows]
        right = [_codes(m, n_in, g=g) for m in ROWS]
    return left, right


@pytest.mark.parametrize("layout", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["forward", "grad_input", "grad_weight"])
def test_each_grouped_product_is_the_scaled_mm_loop_up_to_accumulation_order(counted, kind, layout):
    recipe = recipe_for(f8s.QuantConfig(recipe=f"fp8_{layout}", backward_format="e4m3"))
    g = torch.Generator(device="cuda").manual_seed(SEEDS[kind] + (layout == "current"))
    left, right = _operands(kind, layout, g)
    ls, rs = _snaps(len(ROWS), g), _snaps(len(ROWS), g)
    assert gg.grouped_expert_problem(kind, recipe, left, right, torch.bfloat16, "auto") is None
    got = expert_gemms(kind, recipe, left, right, ls, rs, torch.bfloat16, "auto")
    assert counted["fp8"] == 1
    # the loop on the groups with rows (torch._scaled_mm is not asked for an empty product)
    full = [i for i, m in enumerate(ROWS) if m]
    pick = [[seq[i] for i in full] for seq in (left, right, ls, rs)]
    want = expert_gemms(kind, recipe, *pick, torch.bfloat16, "auto", grouped=False)
    assert counted["fp8"] == 1
    if kind == "grad_weight":
        assert got.shape == (len(ROWS), 2 * FF, D)
        assert not got[ROWS.index(0)].any()  # the zero-row group: an exact zero
        got, want = got[full], torch.stack(want)
    close(got, want, atol_share=2**-10)


def test_e5m2_operands_keep_the_loop(counted):
    recipe = recipe_for(f8s.QuantConfig(recipe="fp8_delayed"))
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = (37, 129, 5)
    left = [(torch.randn(m, 2 * FF, device="cuda", generator=g) * 3).to(torch.float8_e5m2) for m in rows]
    right = [_codes(2 * FF, D, g=g).t().contiguous().t() for _ in rows]
    problem = gg.grouped_expert_problem("grad_input", recipe, left, right, torch.bfloat16, "auto")
    assert problem is not None and "float8_e5m2" in problem
    out = expert_gemms("grad_input", recipe, left, right, _snaps(3, g), _snaps(3, g), torch.bfloat16, "auto")
    assert counted["fp8"] == 0 and out.shape == (sum(rows), D)


# --- the module -------------------------------------------------------------------------------------


def experts(recipe: str, grouped: bool = True, **cfg):
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = GroupedExperts(E, D, FF)
    with torch.no_grad():
        for name in model.experts.projections:
            getattr(model.experts, name).normal_(0, 0.05)
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, **cfg))
    state.convert(model)
    model = model.cuda().bfloat16()
    model.experts.grouped_gemm = grouped
    return state, model.experts


def routing(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, D, device="cuda", generator=g) * 1.5**seed).bfloat16()
    logits = torch.randn(T, E, device="cuda", generator=g)
    logits[:, IDLE] = -torch.inf
    weights, index = logits.softmax(-1).topk(K, dim=-1)
    return x, index, weights


def step(state, module, event, n: int):
    x, index, weights = event
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    probe = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(99 + n))
    with state.step(n):
        y = module(x, index, weights)
        state.commit_forward()
        (y.float() * probe).sum().backward()  # a gradient that does not depend on the path taken
    return [y.detach(), x.grad, *(getattr(module, p).grad for p in module.projections)]


@pytest.mark.parametrize(
    "recipe, backward_format, per_step",
    [
        ("fp8_delayed", "e4m3", 6),  # 2 projections x (forward, input and weight gradients)
        ("fp8_current", "e4m3", 6),
        ("fp8_delayed", "e5m2", 2),  # E5M2 gradients: only the forwards are grouped
        ("fp8_current", "e5m2", 2),
    ],
)
def test_the_grouped_experts_are_the_loop_up_to_accumulation_order(counted, recipe, backward_format, per_step):
    state, module = experts(recipe, backward_format=backward_format)
    ref_state, ref = experts(recipe, grouped=False, backward_format=backward_format)
    for n in range(3):
        ref_state.load_state_dict(state.state_dict())  # the same scales: only the GEMMs differ
        before = counted["fp8"]
        got = step(state, module, routing(n), n)
        assert counted["fp8"] - before == per_step, n
        want = step(ref_state, ref, routing(n), n)
        assert counted["fp8"] - before == per_step  # the loop calls none
        for name, a, b in zip(("y", "x.grad", *module.projections), got, want, strict=True):
            assert torch.isfinite(a.float()).all(), name
            close(a, b)
        for p in module.projections:
            assert not getattr(module, p).grad[IDLE].any()  # the idle expert in the middle


def test_the_bf16_recipe_is_one_grouped_mm_per_product(counted):
    state, module = experts("bf16")
    ref_state, ref = experts("bf16", grouped=False)
    got = step(state, module, routing(1), 0)
    assert counted["bf16"] == 6
    want = step(ref_state, ref, routing(1), 0)
    assert counted["bf16"] == 6 and counted["fp8"] == 0
    for a, b in zip(got, want, strict=True):
        close(a, b)


# --- recompute ----------------------------------------------------------------------------------------


class MoEStack(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norms = nn.ModuleList(nn.RMSNorm(D) for _ in range(2))
        self.mlps = nn.ModuleList(MoEFeedForward(D, FF, E, K, 0.0) for _ in range(2))
        for mlp in self.mlps:
            with torch.no_grad():
                mlp.experts.gate_up_proj.normal_(0, 0.05)
                mlp.experts.down_proj.normal_(0, 0.05)
        self.checkpointed = checkpointed

    def block(self, i, x):
        return x + self.mlps[i](x, self.norms[i])

    def forward(self, x):
        for i in range(2):
            x = f8s.checkpoint(self.block, i, x, use_reentrant=False) if self.checkpointed else self.block(i, x)
        return x


def stack_run(checkpointed: bool, recipe: str, counted):
    model = MoEStack(checkpointed)
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, backward_format="e4m3"))
    state.convert(model)
    model = model.cuda().bfloat16()
    losses, grads, calls = [], [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for n in range(3):
            g = torch.Generator(device="cuda").manual_seed(n)
            x = (torch.randn(4, 250, D, device="cuda", generator=g) * 2.0**n).bfloat16().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            before = counted["fp8"]
            with state.step(n):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            calls.append(counted["fp8"] - before)
            losses.append(loss.detach())
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()} | {"x": x.grad})
    return auditor.report(), losses, grads, calls


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
def test_checkpointed_recompute_is_bitwise_under_the_grouped_path(counted, recipe):
    report, losses, grads, calls = stack_run(True, recipe, counted)
    _, losses_p, grads_p, calls_p = stack_run(False, recipe, counted)
    assert calls_p == [2 * 6] * 3  # 2 blocks x 6 grouped GEMMs
    assert calls == [2 * (6 + 2)] * 3  # and each recompute's two forwards grouped again
    assert report.ok, report.format_table()
    assert sum(r.recomputed for r in report.rows if ".experts." in r.layer) > 0
    for n in range(3):
        assert bitwise_equal(losses[n], losses_p[n]), n
        for name, grad in grads_p[n].items():
            assert bitwise_equal(grads[n][name], grad), (n, name)


# --- no host sync ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current", "bf16"])
def test_the_grouped_gemms_make_no_host_sync(counted, recipe):
    """Past the routing (its one device-to-host copy of the counts), the experts' forward and
    backward run with CUDA's sync debug mode raising on any synchronization."""
    state, module = experts(recipe, backward_format="e4m3")
    for n in range(3):  # the last event under the sync check, after warm-up ones
        x, index, _ = routing(n)
        r = route(index, E)
        x_sorted = x[r.tokens].requires_grad_(True)
        grad = torch.randn(x_sorted.shape, device="cuda", dtype=torch.bfloat16)
        module.zero_grad(set_to_none=True)
        before = dict(counted)
        with state.step(n):
            torch.cuda.synchronize()
            if n == 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                module.grouped(x_sorted, r.counts).backward(grad)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        ran = counted["bf16" if recipe == "bf16" else "fp8"] - before["bf16" if recipe == "bf16" else "fp8"]
        assert ran == 6, (n, ran)
        assert torch.isfinite(x_sorted.grad.float()).all()
