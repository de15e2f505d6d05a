"""Amax reduction across two gloo processes (no Lightning): per role, both sides of each claim.

Both ranks run the same model on different data (rank 1's inputs are 8x louder). Every
scenario runs in one pair of spawned processes; each rank saves what it saw and the test
compares the ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import lightning_fp8state as f8s
from tests.conftest import event_inputs, make_stack, run_events
from tests.distributed.spawn import spawn

N_EVENTS = 3


def _scales(state) -> dict:
    """(layer, role, site) -> live scale, rank left out so ranks can be compared."""
    return {(o.layer, o.role, o.site): state.bank.scale[i].item() for i, o in enumerate(state.bank.owners)}


def _run(reduction, rank, *, weight_seed=0, nan_event=None, reverse=False):
    state = f8s.Fp8State(f8s.QuantConfig(amax_reduction=reduction, strict=False), rank=rank)
    enabled = state.enable_amax_reduction()
    model = state.convert(make_stack(n=2, seed=weight_seed, ckpt=("torch", False)))
    if reverse:  # rank-dependent layer order: the owners register in another order
        model.blocks = torch.nn.ModuleList(reversed(list(model.blocks)))
    xs = [x * (8.0 if rank == 1 else 1.0) for x in event_inputs(N_EVENTS, seed=11)]
    if nan_event is not None and rank == 1:
        xs[nan_event][0, 0] = float("nan")
    run_events(state, model, xs)
    reducer = state.protocol.amax_reducer
    return {
        "enabled": enabled,
        "collectives": 0 if reducer is None else reducer.collectives,
        "scales": _scales(state),
        "nonfinite": {(o.layer, o.role, o.site): c for o, c in state.nonfinite_counts().items()},
        "owner_ranks": sorted({o.rank for o in state.bank.owners}),
    }


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    results = {
        "all": _run("data_parallel", rank),
        "none": _run("none", rank),
        "default": _run(f8s.QuantConfig().amax_reduction, rank),
        "weights_differ_default": _run(f8s.QuantConfig().amax_reduction, rank, weight_seed=rank),
        "weights_differ_none": _run("none", rank, weight_seed=rank),
        "nan_all": _run("data_parallel", rank, nan_event=1),
        "nan_none": _run("none", rank, nan_event=1),
    }
    try:
        _run("data_parallel", rank, reverse=(rank == 1))
        results["misaligned"] = None
    except f8s.OwnerAlignmentError as exc:
        results["misaligned"] = str(exc)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reduction")
    spawn(_worker, (str(out),), what="gloo workers")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _by_role(scales: dict, role: str) -> dict:
    return {k: v for k, v in scales.items() if k[1] == role}


def test_every_role_reduced_gives_identical_scales_on_both_ranks(ranks):
    a, b = ranks[0]["all"], ranks[1]["all"]
    assert a["enabled"] and b["enabled"]
    assert a["owner_ranks"] == [0] and b["owner_ranks"] == [1]  # rank is part of each owner key
    assert len(a["scales"]) == 2 * 2 * 3
    assert a["scales"] == b["scales"]
    # one collective at commit_forward and one at the event's end (grad_output reduces too)
    assert a["collectives"] == b["collectives"] == 2 * N_EVENTS


def test_without_reduction_data_dependent_scales_differ_between_ranks(ranks):
    a, b = ranks[0]["none"], ranks[1]["none"]
    assert not a["enabled"] and a["collectives"] == 0
    for role in ("input", "grad_output"):
        ra, rb = _by_role(a["scales"], role), _by_role(b["scales"], role)
        assert all(ra[k] != rb[k] for k in ra), role  # rank 1's data is 8x louder
    # weights are replicated (same seed): their scales agree even without reduction
    assert _by_role(a["scales"], "weight") == _by_role(b["scales"], "weight")


def test_default_reduces_weights_only_one_collective_per_event(ranks):
    a, b = ranks[0]["default"], ranks[1]["default"]
    assert a["enabled"] and a["collectives"] == b["collectives"] == N_EVENTS
    assert _by_role(a["scales"], "weight") == _by_role(b["scales"], "weight")
    ia, ib = _by_role(a["scales"], "input"), _by_role(b["scales"], "input")
    assert all(ia[k] != ib[k] for k in ia)


def test_weight_reduction_keeps_drifted_replicas_scales_identical(ranks):
    """Replicas whose weights differ (here: another init per rank): weight reduction on
    makes their weight scales identical; off, they differ."""
    on_a, on_b = ranks[0]["weights_differ_default"], ranks[1]["weights_differ_default"]
    off_a, off_b = ranks[0]["weights_differ_none"], ranks[1]["weights_differ_none"]
    assert _by_role(on_a["scales"], "weight") == _by_role(on_b["scales"], "weight")
    wa, wb = _by_role(off_a["scales"], "weight"), _by_role(off_b["scales"], "weight")
    assert all(wa[k] != wb[k] for k in wa)


def test_a_nan_on_one_rank_stays_non_finite_on_every_rank_after_reduction(ranks):
    key = ("blocks.0.fc1", "input", 0)
    assert ranks[0]["nan_all"]["nonfinite"][key] == ranks[1]["nan_all"]["nonfinite"][key] == 1
    assert ranks[0]["nan_all"]["scales"] == ranks[1]["nan_all"]["scales"]
    # without reduction only the rank that saw the NaN counts it
    assert ranks[0]["nan_none"]["nonfinite"][key] == 0
    assert ranks[1]["nan_none"]["nonfinite"][key] == 1


def test_ranks_registering_owners_in_another_order_fail_closed_on_every_rank(ranks):
    for r in range(2):
        message = ranks[r]["misaligned"]
        assert message is not None, f"rank {r} did not refuse"
        assert "different quantizer owners" in message and "amax_reduction='none'" in message


def test_enable_amax_reduction_is_a_no_op_without_a_process_group():
    state = f8s.Fp8State(f8s.QuantConfig(amax_reduction="data_parallel"))
    assert not state.enable_amax_reduction()
    assert state.protocol.amax_reducer is None


def test_amax_reduction_config_is_validated():
    with pytest.raises(f8s.ConfigError, match=r"amax_reduction\['weight'\]='all' is not allowed"):
        f8s.QuantConfig(amax_reduction={"weight": "all"})
    with pytest.raises(f8s.ConfigError, match="amax_reduction='sum' is not allowed"):
        f8s.QuantConfig(amax_reduction="sum")
    with pytest.raises(f8s.ConfigError, match=r"unknown role\(s\) \['weights'\]"):
        f8s.Fp8State(f8s.QuantConfig(amax_reduction={"weights": "data_parallel"}))
    cfg = f8s.QuantConfig.from_dict({"amax_reduction": {"input": "data_parallel", "*": "none"}})
    assert cfg.reduction_of("input") == "data_parallel"
    assert cfg.reduction_of("weight") == "none"
    assert f8s.QuantConfig().reduction_of("weight") == "data_parallel"
    assert f8s.QuantConfig().reduction_of("grad_output") == "none"
