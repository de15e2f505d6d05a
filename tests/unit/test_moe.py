"""Mixture-of-experts in FP8 (issue 44): every expert's projection its own owner, bitwise a loop of
per-expert Fp8Linear calls; checkpointed runs (torch reentrant and not, SAC) bitwise the plain run
with identical routing, and a recompute that routes otherwise refused; the naive mode caught; an
idle expert commits nothing and keeps its scale; one commit per active expert per event; the
per-expert owners through state_dict and back; the Llama MoE feed-forward's config keys."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError, StateTransitionError
from lightning_fp8state.models import Llama, LlamaConfig
from lightning_fp8state.models.llama import LlamaMLP
from lightning_fp8state.models.moe import MoEFeedForward, load_balancing_loss
from lightning_fp8state.nn import Fp8Experts, Fp8Linear, GroupedExperts
from lightning_fp8state.nn.experts import route
from lightning_fp8state.quant_recipes.registry import recipe_names
from lightning_fp8state.recompute import Phase
from lightning_fp8state.sac import selective_checkpoint_context
from tests.conftest import bitwise_equal

E, D, FF, K = 4, 16, 24, 2
TINY_MOE = dict(
    vocab_size=61, seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, moe_experts=4
)


def experts_model(seed: int = 0, fused: bool = True) -> nn.Module:
    """A container whose child ``experts`` conversion turns into an Fp8Experts."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.experts = GroupedExperts(E, D, FF, fused_gate_up=fused)
    with torch.no_grad():
        for name in model.experts.projections:
            getattr(model.experts, name).normal_(0, 0.2)
    return model


def routed(event: int, tokens: int = 12, idle: tuple[int, ...] = ()):
    """Inputs growing per event (so scales move) and a top-2 routing that avoids ``idle``."""
    g = torch.Generator().manual_seed(100 + event)
    x = torch.randn(tokens, D, generator=g) * 1.5**event
    logits = torch.randn(tokens, E, generator=g)
    logits[:, list(idle)] = -torch.inf
    weights, index = logits.softmax(-1).topk(K, dim=-1)
    return x, index, weights / weights.sum(-1, keepdim=True)


def quant_config(**cfg) -> f8s.QuantConfig:
    if cfg.get("recipe", "").startswith("fp8_rowwise"):  # its GEMMs take E4M3 gradients
        cfg.setdefault("backward_format", "e4m3")
    return f8s.QuantConfig(**cfg)


def convert(model, **cfg):
    state = f8s.Fp8State(quant_config(**cfg))
    state.convert(model)
    return state


def run_experts(state, module, events):
    """One event per ``(x, index, weights)``: forward, commit_forward, backward. Outputs and grads."""
    out = []
    for step, (x, index, weights) in enumerate(events):
        x = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        with state.step(step):
            y = module(x, index, weights)
            state.commit_forward()
            y.float().pow(2).mean().backward()
        out.append((y.detach(), x.grad, *(getattr(module, p).grad.clone() for p in module.projections)))
    return out


# --- (a) bitwise a loop of per-expert Fp8Linear calls ------------------------------------------


class LinearLoop(nn.Module):
    """transformers' eager experts loop, each expert's projections an Fp8Linear of their own
    (layer names those Fp8Experts gives its experts)."""

    def __init__(self, experts: GroupedExperts, state) -> None:
        super().__init__()

        def linear(weight, layer):
            lin = Fp8Linear(weight.shape[1], weight.shape[0], bias=False, protocol=state, layer_name=layer)
            lin.weight = nn.Parameter(weight.detach().clone())
            return lin

        self.projections = experts.projections
        for p in self.projections:
            weights = getattr(experts, p)
            setattr(self, p, nn.ModuleList(linear(weights[e], f"experts.{p}.{e}") for e in range(E)))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(E):
            slot, token = torch.where(index.t() == e)
            if not len(token):
                continue
            x_e = x[token]
            if "gate_up_proj" in self.projections:
                gate, up = self.gate_up_proj[e](x_e).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj[e](x_e), self.up_proj[e](x_e)
            y = self.down_proj[e](F.silu(gate) * up) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


@pytest.mark.parametrize(
    "fused, recipe",
    [(True, "fp8_delayed"), (False, "fp8_delayed")] + [(True, r) for r in recipe_names() if r != "fp8_delayed"],
    ids=lambda v: {True: "gate_up_proj", False: "gate_proj-up_proj"}.get(v, v) if isinstance(v, bool) else v,
)
def test_fp8_experts_are_bitwise_a_loop_of_per_expert_fp8_linears(fused, recipe):
    model = experts_model(fused=fused)
    state = convert(model, recipe=recipe)
    assert isinstance(model.experts, Fp8Experts)
    ref_state = f8s.Fp8State(quant_config(recipe=recipe))
    loop = LinearLoop(model.experts, ref_state)
    events = [routed(i, idle=(3,) if i == 1 else ()) for i in range(3)]
    ours = run_experts(state, model.experts, events)
    for step, (x, index, weights) in enumerate(events):
        x = x.clone().requires_grad_(True)
        loop.zero_grad(set_to_none=True)
        with ref_state.step(step):
            y = loop(x, index, weights)
            ref_state.commit_forward()
            y.float().pow(2).mean().backward()
        got_y, got_gx, *got_gw = ours[step]
        assert bitwise_equal(got_y, y.detach()), step
        assert bitwise_equal(got_gx, x.grad), step
        for p, grad in zip(loop.projections, got_gw, strict=True):
            for e in range(E):
                assert bitwise_equal(grad[e], _grad_or_zero(getattr(loop, p)[e].weight)), (step, p, e)
    assert set(state.protocol.owners()) == set(ref_state.protocol.owners())
    if state.protocol.recipe.quantized:
        assert len(state.protocol.owners()) == len(loop.projections) * E * 3  # projection x expert x role
    for owner in ref_state.bank.owners:
        assert bitwise_equal(state.scale_of(owner), ref_state.scale_of(owner)), owner


def _grad_or_zero(p):
    return torch.zeros_like(p) if p.grad is None else p.grad


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
def test_no_expert_weight_codes_are_held_from_the_forward_to_the_backward(recipe):
    """A per-tensor recipe saves each expert's weight itself (a parameter, held anyway) and
    re-encodes its codes at the call's snapshot in the backward: the experts' weights are most of
    an MoE layer's bytes. Saved are the input codes and views of the parameters, no FP8 tensor of
    a weight's size (the gradients stay bitwise the Fp8Linear loop's: the test above)."""
    model = experts_model()
    state = convert(model, recipe=recipe)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel(), t.untyped_storage().data_ptr()))
        return t

    x, index, weights = routed(0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with state.step(0), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model.experts(x.requires_grad_(True), index, weights)
        state.commit_forward()
        y.float().pow(2).mean().backward()
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    weight_sizes = {2 * FF * D, FF * D}
    assert not [s for s in saved if s[0] in fp8 and s[1] in weight_sizes and s[2] not in params]
    assert any(s[2] in params for s in saved)  # the weights themselves
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# --- (b) checkpointing: bitwise the plain run, identical routing --------------------------------


class MoEBlock(nn.Module):
    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D)
        cfg = LlamaConfig(d_model=D, n_heads=2, ffn_hidden=FF)
        self.mlp = MoEFeedForward(D, FF, E, K, 0.05, LlamaMLP(cfg) if shared else None)

    def forward(self, x):
        return x + self.mlp(x, self.norm)


class MoEStack(nn.Module):
    def __init__(self, how: str | None, shared: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MoEBlock(shared) for _ in range(2))
        for block in self.blocks:
            with torch.no_grad():
                block.mlp.experts.gate_up_proj.normal_(0, 0.2)
                block.mlp.experts.down_proj.normal_(0, 0.2)
        self.how = how

    def forward(self, x):
        for block in self.blocks:
            if self.how is None:
                x = block(x)
            elif self.how == "sac":
                x = f8s.checkpoint(block, x, use_reentrant=False, context_fn=selective_checkpoint_context())
            else:
                x = f8s.checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


def record_routes(model, log: list) -> None:
    """Note every routing of every block (true forward and recompute) as ``(block, top_k_index)``."""
    for b, block in enumerate(model.blocks):
        original = block.mlp.route

        def noted(h, original=original, b=b):
            out = original(h)
            log.append((b, out[2].clone()))
            return out

        block.mlp.route = noted


def stack_run(how, mode="safe", steps=3, audit=False, recipe="fp8_delayed"):
    model = MoEStack(how)
    state = convert(model, mode=mode, strict=mode == "safe", recipe=recipe)
    losses, grads, routes = [], [], []
    record_routes(model, routes)
    auditor = f8s.RecomputeAuditor(state) if audit else None
    with auditor if audit else contextlib.nullcontext():
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = (torch.randn(2, 6, D, generator=g) * 2.0**step).requires_grad_(True)
            model.zero_grad(set_to_none=True)
            routes.append(("step", step))
            with state.step(step):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()} | {"x": x.grad})
    return state, losses, grads, routes, auditor.report() if audit else None


def routes_by_call(routes) -> dict:
    """``(step, block) -> [top_k_index of each call]`` from :func:`record_routes`' log."""
    out, step = {}, None
    for key, value in routes:
        if key == "step":
            step = value
        else:
            out.setdefault((step, key), []).append(value)
    return out


@pytest.mark.parametrize(
    "how, recipe",
    [
        ("nonreentrant", "fp8_delayed"),
        ("reentrant", "fp8_delayed"),
        ("sac", "fp8_delayed"),
        ("reentrant", "fp8_current"),
    ],
)
def test_checkpointed_moe_is_bitwise_the_plain_run_and_routes_identically(how, recipe):
    state, losses, grads, routes, report = stack_run(how, audit=True, recipe=recipe)
    plain, losses_p, grads_p, routes_p, _ = stack_run(None, recipe=recipe)
    assert report.ok, report.format_table()
    expert_rows = [r for r in report.rows if ".experts." in r.layer]
    assert expert_rows and sum(r.recomputed for r in expert_rows) > 0
    for step in range(3):
        assert bitwise_equal(losses[step], losses_p[step]), step
        for name, g in grads_p[step].items():
            assert bitwise_equal(grads[step][name], g), (step, name)
    assert state.bank.owners == plain.bank.owners
    assert bitwise_equal(state.bank.scale, plain.bank.scale)
    assert bitwise_equal(state.bank.amax_history, plain.bank.amax_history)
    # every call of a block (its true forward, its recompute) routed as the plain run's one call
    ours, theirs = routes_by_call(routes), routes_by_call(routes_p)
    assert ours.keys() == theirs.keys()
    for key, (expected,) in theirs.items():
        assert len(ours[key]) == 2, key  # true forward and recompute
        assert all(torch.equal(r, expected) for r in ours[key]), key


def test_a_recompute_that_routes_otherwise_fails_closed():
    model = MoEStack("nonreentrant")
    state = convert(model)
    calls = {"n": 0}
    original = model.blocks[1].mlp.route

    def drifting(h):  # the second call (the recompute) sends one token elsewhere
        probs, weights, index = original(h)
        calls["n"] += 1
        if calls["n"] == 2:
            index = index.clone()
            index[0] = torch.tensor([0, 1]) if index[0, 0] > 1 else torch.tensor([2, 3])
        return probs, weights, index

    model.blocks[1].mlp.route = drifting
    x = torch.randn(2, 6, D, requires_grad=True)
    with pytest.raises(StateTransitionError, match=r"the recompute routed .* its true forward .* deterministic"):
        with state.step(0):
            model(x).float().pow(2).mean().backward()


# --- (c) the naive mode is caught -----------------------------------------------------------


def test_the_naive_mode_is_caught_on_the_experts():
    _, _, _, _, report = stack_run("nonreentrant", mode="naive", audit=True)
    assert not report.ok
    assert any(".experts." in r.layer and r.max_abs_diff > 0 for r in report.mismatches)


def test_the_naive_mode_on_a_moe_llama_diverts_the_recompute_routing_and_is_refused():
    """Under the naive mode the recompute's activations differ, so its router may send tokens
    elsewhere: the experts refuse that recompute (fail closed) and the audit has the mismatches."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY_MOE))
    state = convert(model, mode="naive", strict=False, exclude=["lm_head"])
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with f8s.RecomputeAuditor(state) as auditor:
        with pytest.raises(StateTransitionError, match=r"experts\..*the recompute routed .* its true forward"):
            with state.step(0):
                loss = model.loss(idx, idx.roll(-1, dims=1))
                state.commit_forward()
                loss.backward()
    report = auditor.report()
    assert not report.ok and report.mismatches and state.event is None  # the event was aborted


# --- (d) (e) idle experts and the ledger ------------------------------------------------------


def owners_of(state, expert: int):
    return [o for o in state.bank.owners if o.layer.endswith(f".{expert}")]


def test_an_idle_expert_commits_nothing_and_keeps_its_scale_across_events():
    model = experts_model()
    state = convert(model)
    events = [routed(0), routed(1, idle=(2,)), routed(2, idle=(2,)), routed(3, idle=(2,)), routed(4)]
    run_experts(state, model.experts, events[:1])
    kept = {o: state.scale_of(o).clone() for o in owners_of(state, 2)}
    history = {o: state.bank.amax_history[:, state.bank.index[o]].clone() for o in kept}
    moving = {o: state.scale_of(o).clone() for o in owners_of(state, 0)}
    assert len(kept) == 6  # gate_up and down: input, weight, grad_output
    for step in range(1, 4):
        run_experts_at(state, model.experts, events[step], step)
        for o in kept:
            assert state.ledger.commits(o, (step, 0)) == 0 and state.ledger.observations(o, (step, 0)) == 0
            assert bitwise_equal(state.scale_of(o), kept[o]), (step, o)
            assert bitwise_equal(state.bank.amax_history[:, state.bank.index[o]], history[o])
            assert torch.isfinite(state.scale_of(o)) and state.scale_of(o) > 0
    assert any(not bitwise_equal(state.scale_of(o), moving[o]) for o in moving)  # the others moved
    # active again: it quantizes with the scale it kept, and commits once
    seen = {}
    model.experts.protocol.auditors.append(_SnapshotProbe(seen))
    run_experts_at(state, model.experts, events[4], 4)
    x_owner = next(o for o in kept if o.role == "input" and ".gate_up_proj." in o.layer)
    assert bitwise_equal(seen[x_owner], kept[x_owner])
    assert all(state.ledger.commits(o, (4, 0)) == 1 for o in kept)


class _SnapshotProbe:
    """An auditor stand-in that notes the scale each true-forward operand was quantized with."""

    def __init__(self, seen: dict) -> None:
        self.seen = seen

    def observe_operand(self, record, role, phase, data, snap):
        if phase is Phase.FORWARD:
            self.seen[snap.owner] = snap.scale.clone()

    def observe(self, *args):
        pass


def run_experts_at(state, module, event, step):
    x, index, weights = event
    with state.step(step):
        y = module(x.clone().requires_grad_(True), index, weights)
        state.commit_forward()
        y.float().pow(2).mean().backward()


def test_the_ledger_counts_one_commit_per_active_expert_per_event():
    model = MoEStack("reentrant")  # every expert call recomputed: still one commit
    state = convert(model)
    routes = []
    record_routes(model, routes)
    for step in range(3):
        x = torch.randn(1, 1 + 2 * step, D, generator=torch.Generator().manual_seed(step)) * 3.0  # 1 token: 2 idle
        routes.append(("step", step))
        with state.step(step):
            model(x.requires_grad_(True)).float().pow(2).mean().backward()
    idle_seen = 0
    for (step, b), (index, recomputed) in routes_by_call(routes).items():
        assert torch.equal(index, recomputed)
        counts = torch.bincount(index.flatten(), minlength=E)
        for e in range(E):
            for proj in ("gate_up_proj", "down_proj"):
                layer = f"blocks.{b}.mlp.experts.{proj}.{e}"
                owners = [o for o in state.ledger.owners() if o.layer == layer]
                want = 1 if counts[e] else 0
                idle_seen += not want
                assert len(owners) == 3 or not want, layer
                assert all(state.ledger.commits(o, (step, 0)) == want for o in owners), (step, layer)
    assert idle_seen  # the data leaves some expert idle in some event
    assert state.ledger.ok


# --- (f) the per-expert owners through state_dict and back --------------------------------------


def test_per_expert_owners_round_trip_through_state_dict(tmp_path):
    events = [routed(0), routed(1, idle=(1,)), routed(2, idle=(1, 3)), routed(3)]
    model = experts_model()
    state = convert(model)
    run_experts(state, model.experts, events[:3])
    path = tmp_path / "state.pt"
    torch.save({"fp8": state.state_dict(), "model": model.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    resumed = experts_model(seed=5)
    resumed.load_state_dict(saved["model"])
    resumed_state = convert(resumed)
    resumed_state.load_state_dict(saved["fp8"])
    assert resumed_state.bank.owners == state.bank.owners
    assert any(o.layer.endswith(".1") for o in state.bank.owners)  # expert 1 kept its owners while idle
    # the next event, on both: bitwise the same outputs, gradients and committed scales
    a = run_experts_at_out(state, model.experts, events[3], 3)
    b = run_experts_at_out(resumed_state, resumed.experts, events[3], 3)
    for x, y in zip(a, b, strict=True):
        assert bitwise_equal(x, y)
    assert bitwise_equal(state.bank.scale, resumed_state.bank.scale)
    assert bitwise_equal(state.bank.amax_history, resumed_state.bank.amax_history)


def run_experts_at_out(state, module, event, step):
    x, index, weights = event
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with state.step(step):
        y = module(x, index, weights)
        y.float().pow(2).mean().backward()
    return y.detach(), x.grad, *(getattr(module, p).grad for p in module.projections)


def test_a_state_with_other_experts_is_refused():
    model = experts_model()
    state = convert(model)
    run_experts(state, model.experts, [routed(0)])
    sd = state.state_dict()
    other = nn.Module()
    other.moe = GroupedExperts(E, D, FF)  # another layer name: its owners are not the saved ones
    other_state = convert(other)
    with pytest.raises(f8s.errors.StateLoadError, match="does not have"):
        other_state.load_state_dict(sd)


# --- the Llama MoE feed-forward ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(moe_experts=-1), r"moe_experts=-1 is not allowed: expected an integer >= 0"),
        (dict(moe_experts=4, moe_top_k=5), r"moe_top_k=5 is not allowed: expected an integer >= 1 and <= 4"),
        (dict(moe_experts=4, moe_top_k=0), r"moe_top_k=0 is not allowed"),
        (dict(moe_shared_expert=1), r"moe_shared_expert=1 is not allowed: expected true or false"),
        (dict(moe_aux_loss_coef=-0.1), r"moe_aux_loss_coef=-0.1 is not allowed: expected a finite number >= 0"),
    ],
)
def test_moe_config_keys_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        LlamaConfig(**kw)


def test_moe_is_off_by_default_and_the_block_names_follow_mixtral():
    dense = Llama(LlamaConfig(d_model=32, n_heads=4, n_layers=1, ffn_hidden=48))
    assert not any("experts" in n for n in dense.state_dict())
    moe = Llama(LlamaConfig(d_model=32, n_heads=4, n_layers=1, ffn_hidden=48, moe_experts=3, moe_shared_expert=True))
    shapes = {n: tuple(t.shape) for n, t in moe.state_dict().items() if ".mlp." in n}
    assert shapes == {
        "layers.0.mlp.gate.weight": (3, 32),
        "layers.0.mlp.experts.gate_up_proj": (3, 96, 32),
        "layers.0.mlp.experts.down_proj": (3, 32, 48),
        "layers.0.mlp.shared_expert.gate_proj.weight": (48, 32),
        "layers.0.mlp.shared_expert.up_proj.weight": (48, 32),
        "layers.0.mlp.shared_expert.down_proj.weight": (32, 48),
    }
    assert 0 < float(moe.layers[0].mlp.experts.gate_up_proj.detach().std()) < 0.05  # initialised, not left empty


def test_the_router_is_kept_in_high_precision_and_reported():
    model = Llama(LlamaConfig(d_model=32, n_heads=4, n_layers=1, ffn_hidden=48, moe_experts=4))
    state = convert(model, exclude=["lm_head"])
    report = state.last_conversion
    assert "layers.0.mlp.gate" not in report.converted and type(model.layers[0].mlp.gate) is nn.Linear
    assert "kept in high precision" in report.skipped["layers.0.mlp.gate"]
    assert report.how["layers.0.mlp.experts"].startswith("GroupedExperts -> Fp8Experts")
    assert len(report.layers()) == 4 + 2 * 4  # q k v o, and each expert's two projections


def test_load_balancing_loss_is_switch_transformers():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.6, 0.2, 0.1]])
    index = torch.tensor([[0, 1], [1, 2]])
    # slots per expert: 1, 2, 1, 0 over T=2; mean probs: 0.4, 0.4, 0.15, 0.05; E=4
    expected = 4 * (0.5 * 0.4 + 1.0 * 0.4 + 0.5 * 0.15 + 0.0 * 0.05)
    assert load_balancing_loss(probs, index).item() == pytest.approx(expected)
    uniform = torch.full((6, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([[0, 1], [2, 3]] * 3)).item() == pytest.approx(2.0)


def test_the_aux_loss_gradient_reaches_the_router():
    block = MoEStack(None, shared=False).blocks[0]
    x = torch.randn(1, 8, D, generator=torch.Generator().manual_seed(0))

    def router_grad(coef: float, explicit: float) -> torch.Tensor:
        block.mlp.aux_loss_coef = coef
        block.zero_grad(set_to_none=True)
        probs, _, index = block.mlp.route(block.norm(x).flatten(0, 1))
        (block(x).pow(2).mean() + explicit * load_balancing_loss(probs, index)).backward()
        return block.mlp.gate.weight.grad.clone()

    injected, plain, explicit = router_grad(0.05, 0.0), router_grad(0.0, 0.0), router_grad(0.0, 0.05)
    assert not torch.equal(injected, plain)
    torch.testing.assert_close(injected, explicit, rtol=1e-5, atol=1e-8)
    assert block.mlp.last_aux_loss is not None and block.mlp.last_aux_loss.requires_grad is False


# --- the Llama with MoE blocks: engines, autocast ----------------------------------------------


def llama_run(autocast: bool = False, steps: int = 2, **kw):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY_MOE, moe_shared_expert=True, **kw))
    state = convert(model, exclude=["lm_head"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(steps):
            idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(step))
            with state.step(step), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = model.loss(idx, idx.roll(-1, dims=1))
                state.commit_forward()
                loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return state, auditor.report(), losses, grads


@pytest.mark.parametrize(
    "engine, reentrant, autocast",
    [("torch", True, True), ("torch", False, True), ("deepspeed", False, False)],
    ids=["torch-reentrant-bf16-autocast", "torch-nonreentrant-bf16-autocast", "deepspeed"],
)
def test_a_moe_llama_trains_bitwise_its_uncheckpointed_run(engine, reentrant, autocast):
    state, report, losses, grads = llama_run(autocast, checkpoint_engine=engine, use_reentrant=reentrant)
    assert report.ok, report.format_table()
    assert any(".experts." in r.layer and r.recomputed for r in report.rows)
    plain, _, losses_p, grads_p = llama_run(autocast, checkpoint=False)
    for step in range(2):
        assert bitwise_equal(losses[step], losses_p[step]), step
        for name, g in grads_p[step].items():
            assert bitwise_equal(grads[step][name], g), (step, name)
    assert bitwise_equal(state.bank.scale, plain.bank.scale)


def test_the_aux_loss_gradient_survives_torch_compile():
    def router_grad(coef: float, compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**{**TINY_MOE, "n_layers": 1}, checkpoint=False, moe_aux_loss_coef=coef))
        state = convert(model, exclude=["lm_head"])
        if compiled:
            model.layers[0] = torch.compile(model.layers[0], backend="aot_eager")
        idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
        with state.step(0):
            model.loss(idx, idx.roll(-1, dims=1)).backward()
        return next(p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))

    eager, compiled, without = router_grad(0.5, False), router_grad(0.5, True), router_grad(0.0, False)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)
    assert (compiled - without).abs().max() > 100 * (compiled - eager).abs().max()


def test_routing_inside_a_cuda_graph_capture_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(StateTransitionError, match=r"inside a CUDA graph capture.*trainer.cuda_graphs=false"):
        route(torch.zeros(3, 2, dtype=torch.long), E)


def test_an_expert_id_out_of_range_is_refused():
    with pytest.raises(ConfigError, match=r"top_k_index=expert ids up to 4 is not allowed: expected ids in \[0, 4\)"):
        route(torch.tensor([[0, 4]]), E)
