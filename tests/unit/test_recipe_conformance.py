"""Every registered recipe, one test file: what each must keep, checked the same way for all
(a new recipe module is picked up here with no test of its own to write first).

Ownership (a shared owner refused under strict ownership), stamps (a snapshot names its
owner and event, a consumer refuses another's, its scales have the recipe's declared layout),
the ledger (one commit per owner per event), the auditor (recompute bitwise the true forward,
gradients bitwise the uncheckpointed run, under every checkpoint engine), the naive modes
caught where the recipe has them, a checkpoint of another recipe refused in one line, the
FSDP2 FP8 all-gather allowed or refused as the layouts say, and per-block CUDA graphs
(emulated) bitwise the eager run or refused with the recipe's reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError, StaleSnapshotError, StateLoadError, StateTransitionError
from lightning_fp8state.quant_recipes import RECIPE_CLASSES, recipe_for
from lightning_fp8state.quant_recipes.base import LINEAR_GEMM_ROLES
from tests import block_scaled_recipe
from tests.conftest import ENGINE_IDS, ENGINES, bitwise_equal, event_inputs, make_stack, run_events

# every registered recipe, and one written in tests/ from the plug-in's parts only, whose
# block-scaled layouts no code outside its module knows
SHIPPED = list(RECIPE_CLASSES)
RECIPES = [*SHIPPED, block_scaled_recipe.NAME]
QUANTIZED = [name for name in SHIPPED if RECIPE_CLASSES[name].quantized] + [block_scaled_recipe.NAME]
# a registered recipe that is another one with a different op option (same code path, its own
# numerics tested with the op's reference): the costly checks (the audit under every engine,
# per-block graphs) run once per family, the rest for every name
VARIANTS = {"fp8_blockwise_pow2": "fp8_blockwise"}
FAMILIES = [name for name in RECIPES if name not in VARIANTS]
NAIVE = [(name, mode) for name, cls in RECIPE_CLASSES.items() for mode in cls.modes if mode != "safe"]
N_EVENTS = 3


@pytest.fixture(autouse=True)
def _block_scaled_registered():
    with block_scaled_recipe.registered():
        yield


def _config(recipe: str, **kw) -> f8s.QuantConfig:
    # E4M3 grad_output: the format every recipe's shipped config runs (rowwise GEMMs take only it)
    return f8s.QuantConfig(recipe=recipe, backward_format="e4m3", **kw)


def _audited(recipe, ckpt, mode="safe", n_events=N_EVENTS, **kw):
    state = f8s.Fp8State(_config(recipe, mode=mode, strict=mode == "safe", **kw))
    model = state.convert(make_stack(ckpt=ckpt))
    with f8s.RecomputeAuditor(state) as auditor:
        outs, grads = run_events(state, model, event_inputs(n_events))
    return state, auditor.report(), outs, grads


def test_every_shipped_recipe_is_registered():
    shipped = {"fp8_delayed", "bf16", "fp8_current", "fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"}
    assert shipped | {"fp8_blockwise_pow2"} <= set(SHIPPED)
    assert set(VARIANTS.values()) <= set(FAMILIES)
    assert SHIPPED[0] == "fp8_delayed" and block_scaled_recipe.NAME not in SHIPPED


def test_the_block_scaled_recipe_quantizes_each_tile_at_its_own_scale():
    from lightning_fp8state.formats import E4M3

    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(2)) * torch.arange(1, 21)
    q, scale, descale, amax = block_scaled_recipe.block_quantize(x, block_scaled_recipe.TILE, torch.float8_e4m3fn, 0)
    assert scale.shape == (5, 3)  # 20 columns in tiles of 8: 8, 8 and the edge's 4
    want = torch.stack([x[:, :8].abs().amax(1), x[:, 8:16].abs().amax(1), x[:, 16:].abs().amax(1)], 1)
    assert torch.equal(amax, want) and torch.equal(scale, torch.full_like(want, E4M3.max) / want)
    assert torch.equal(q, (x * block_scaled_recipe.TILE.expand(scale, x.shape)).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("recipe", FAMILIES)
@pytest.mark.parametrize("ckpt", ENGINES, ids=ENGINE_IDS)
def test_recompute_is_audited_bitwise_and_the_ledger_counts_one_commit_per_owner_per_event(recipe, ckpt):
    _, _, outs_ref, grads_ref = _audited(recipe, None)
    state, report, outs, grads = _audited(recipe, ckpt)
    assert report.ok, report.format_table()
    assert {r.event for r in report.rows if r.recomputed} == {(i, 0) for i in range(N_EVENTS)}
    for event, (g_ref, g_ck) in enumerate(zip(grads_ref, grads, strict=True)):
        assert bitwise_equal(outs_ref[event], outs[event])
        for name in g_ref:
            assert bitwise_equal(g_ref[name], g_ck[name]), f"{recipe} event {event}: grad of {name} differs"
    owners = state.protocol.owners()
    if not RECIPE_CLASSES[recipe].quantized:
        assert owners == [] and len(state.bank) == 0
        return
    assert len(owners) == 4 * 2 * 3 and {o.role for o in owners} == set(LINEAR_GEMM_ROLES)
    for owner in owners:
        assert state.ledger.commits(owner) == N_EVENTS
    assert state.ledger.ok


@pytest.mark.parametrize(("recipe", "mode"), NAIVE)
def test_a_naive_mode_is_caught_by_the_auditor(recipe, mode):
    # one owner for the model: the seed's shared state, which an owner snapshot does not repair
    _, report, _, _ = _audited(recipe, ("torch", False), mode=mode, ownership="per_model")
    assert not report.ok and report.mismatches, report.format_table()


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_snapshots_are_stamped_checked_by_consumers_and_laid_out_as_declared(recipe):
    state = f8s.Fp8State(_config(recipe))
    layer = state.convert(nn.Sequential(nn.Linear(16, 8)))[0]
    r = recipe_for(state.config)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(5)) * 5
    with state.step(0):
        phase, record = state.protocol.enter_call("probe", ("input", "weight"), x.device)
        for role, data in (("input", x), ("weight", layer.weight)):
            _, snap = state.protocol.quantize(record, role, data, phase)
            assert snap.event == (0, 0) and snap.owner.layer == "probe" and snap.owner.role == role
            layout = r.scale_layout(role)
            assert layout.holds(snap.descale, data.shape), (role, layout, snap.descale.shape)
            assert layout.expand(snap.descale, data.shape).dim() in (0, 2)
            other = dataclasses.replace(snap, owner=dataclasses.replace(snap.owner, layer="elsewhere"))
            with pytest.raises(StaleSnapshotError, match="owner mismatch"):
                state.protocol.check_consumer(record, role, other)
        layer(x).sum().backward()


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_a_shared_owner_is_refused_under_strict_ownership(recipe):
    state = f8s.Fp8State(_config(recipe, ownership="per_model"))
    model = state.convert(make_stack(n=2))
    with pytest.raises(StateTransitionError, match="shared|entered|call site"):
        with state.step(0):
            model(torch.randn(4, 16)).sum().backward()


@pytest.mark.parametrize("saved", RECIPES)
def test_a_checkpoint_of_another_recipe_is_refused_in_one_line(saved):
    live = next(name for name in RECIPES if name != saved)
    src = f8s.Fp8State(_config(saved))
    run_events(src, src.convert(make_stack(n=1)), event_inputs(1))
    dst = f8s.Fp8State(_config(live))
    dst.convert(make_stack(n=1))
    with pytest.raises(StateLoadError, match=f"recipe '{saved}'.*recipe '{live}'") as info:
        dst.load_state_dict(src.state_dict())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_fsdp2_fp8_all_gather_is_allowed_exactly_where_the_layouts_allow_it(recipe):
    from lightning_fp8state.nn.fsdp import enable_fp8_all_gather, fp8_all_gather_problem

    r = recipe_for(_config(recipe))
    stored = r.scale_layout("weight")
    gatherable = not r.quantized or (
        (stored.per_tensor or r.shard_scales) and all(op.scales == stored for op in r.gemm_layouts.operands("weight"))
    )
    problem = fp8_all_gather_problem(_config(recipe))
    assert (problem is None) == gatherable, problem
    state = f8s.Fp8State(_config(recipe))
    model = state.convert(nn.Sequential(nn.Linear(16, 16)))
    if problem is None:
        enable_fp8_all_gather(model)
    else:
        with pytest.raises(ConfigError, match=f"recipe='{recipe}'.*high precision"):
            enable_fp8_all_gather(model)


@pytest.mark.parametrize("recipe", FAMILIES)
def test_per_block_graphs_replay_bitwise_the_eager_run_or_refuse_with_the_recipes_reason(recipe):
    from tests.unit.test_block_graphs import N_EVENTS as EVENTS
    from tests.unit.test_block_graphs import WARMUP, train

    if recipe_for(_config(recipe)).graph_problem() is not None:
        with pytest.raises((ConfigError, StateTransitionError), match=recipe):
            train(True, recipe=recipe)
        return
    # two microbatches an optimizer step: replays inside an accumulation too
    _, _, ref_outs, ref_grads, _ = train(False, recipe=recipe, accumulate=2)
    _, model, outs, grads, _ = train(True, recipe=recipe, accumulate=2)
    assert model.runner.replays == EVENTS - WARMUP
    for a, b in zip(ref_outs, outs, strict=True):
        assert bitwise_equal(a, b)
    for ga, gb in zip(ref_grads, grads, strict=True):
        assert all(bitwise_equal(ga[n], gb[n]) for n in ga)
