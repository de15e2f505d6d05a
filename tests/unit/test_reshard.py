"""The quantizer state of N saved ranks mapped onto M (``state/reshard.py``), without processes.

Each "rank" is an Fp8State of its own rank number trained on its own data: its weight owners
see the same weights on every rank (equal histories, as if reduced), its input and gradient
owners see its own data (histories that differ). The expected merged values are computed here
from the saved tensors themselves (elementwise max, the smallest scale), not by the code under test.
"""

from __future__ import annotations

import io

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.errors import StateLoadError
from lightning_fp8state.state.reshard import WorldSizeMergeError, plan_reshard, reshard_state, reshard_states
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

EVENTS = 3


def trained_ranks(world: int, **cfg) -> dict[int, dict]:
    """``{rank: state_dict}`` of ``world`` ranks, each trained EVENTS events on its own inputs
    (the same model weights on every rank), saved and read back as a checkpoint would be."""
    ranks = {}
    for r in range(world):
        state = f8s.Fp8State(f8s.QuantConfig(**cfg), rank=r)
        model = state.convert(make_stack(n=2, ckpt=("torch", False)))
        run_events(state, model, event_inputs(EVENTS, seed=10 + r, scale_growth=1.0 + r))
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        buf.seek(0)
        ranks[r] = torch.load(buf, weights_only=True)
    return ranks


def column(sd: dict, layer: str, role: str) -> dict[str, torch.Tensor]:
    bank = sd["bank"]
    i = next(i for i, o in enumerate(bank["owners"]) if o[0] == layer and o[1] == role)
    return {"amax_history": bank["amax_history"][:, i], "scale": bank["scale"][i], "descale": bank["descale"][i]}


def test_two_ranks_onto_one_copy_the_equal_owners_and_merge_the_rest_by_max():
    saved = trained_ranks(2)
    state, report = reshard_state(saved, 1, 0, "max")
    layers = sorted({o[0] for o in saved[0]["bank"]["owners"]})
    assert {n.split(".")[-1] for n in report.copied} == {"weight"}
    assert {n.split(".")[-1] for n in report.merged} == {"input", "grad_output"}
    assert len(report.copied) + len(report.merged) == len(saved[0]["bank"]["owners"])
    for layer in layers:
        got = column(state, layer, "weight")
        for r in (0, 1):  # copied: bitwise each saved rank's column
            want = column(saved[r], layer, "weight")
            assert all(bitwise_equal(got[k], want[k]) for k in want), layer
        for role in ("input", "grad_output"):
            a, b = column(saved[0], layer, role), column(saved[1], layer, role)
            assert not bitwise_equal(a["amax_history"], b["amax_history"])  # they do differ per rank
            got = column(state, layer, role)
            assert bitwise_equal(got["amax_history"], torch.maximum(a["amax_history"], b["amax_history"]))
            small = a if a["scale"] <= b["scale"] else b
            assert bitwise_equal(got["scale"], small["scale"]) and bitwise_equal(got["descale"], small["descale"])
    assert all(o[2] == 0 for o in state["bank"]["owners"])  # re-keyed to the new rank
    assert state["rank"] == 0


def test_one_rank_onto_two_copies_everything_bitwise_under_the_new_ranks():
    saved = trained_ranks(1)
    states, report = reshard_states(saved, 2, "refuse")  # nothing differs: refuse has nothing to refuse
    assert report.merged == () and len(report.copied) == len(saved[0]["bank"]["owners"])
    for r in (0, 1):
        sd = states[r]
        assert sd["rank"] == r and {o[2] for o in sd["bank"]["owners"]} == {r}
        for key in ("amax_history", "scale", "descale", "amax_pending", "nonfinite_count"):
            assert bitwise_equal(sd["bank"][key], saved[0]["bank"][key]), key
        assert sd["clock"] == saved[0]["clock"] and sd["ledger"]["commits"] == saved[0]["ledger"]["commits"]


def test_the_mapped_state_loads_and_the_clock_and_ledger_continue():
    saved = trained_ranks(2)
    states, _ = reshard_states(saved, 3, "max")
    for r, sd in states.items():
        state = f8s.Fp8State(f8s.QuantConfig(), rank=r)
        model = state.convert(make_stack(n=2, ckpt=("torch", False)))
        state.load_state_dict(sd)
        # the quantizer state after the load is the mapped one, bit for bit
        back = state.state_dict()["bank"]
        for key in ("amax_history", "scale", "descale"):
            assert bitwise_equal(back[key], sd["bank"][key]), key
        owner = state.bank.owners[0]
        assert state.ledger.commits(owner) == EVENTS  # the totals continue
        with pytest.raises(f8s.StateTransitionError, match="not after the last one"):
            state.clock.begin(EVENTS - 1, 0)  # a stamp of an event already taken is refused
        run_events(state, model, event_inputs(1, seed=99), step0=EVENTS)
        assert state.ledger.commits(owner) == EVENTS + 1
        assert state.ledger.ok


def test_refuse_names_the_owners_that_differ():
    saved = trained_ranks(2)
    with pytest.raises(WorldSizeMergeError, match=r"2 rank\(s\) cannot be mapped onto 3: 8 owner\(s\) differ"):
        plan_reshard(saved, 3, "refuse")
    with pytest.raises(f8s.ConfigError, match="world_size_merge='min' is not allowed"):
        plan_reshard(saved, 3, "min")


def test_ranks_of_different_logical_events_are_refused():
    saved = trained_ranks(2)
    saved[1] = dict(saved[1], clock={"last": [EVENTS, 0]})
    with pytest.raises(StateLoadError, match="differs between rank 0 and rank 1 in 'clock'"):
        plan_reshard(saved, 1, "max")


def test_per_layer_ownership_keeps_rank_free_keys():
    saved = trained_ranks(2, ownership="per_layer")
    state, report = reshard_state(saved, 3, 2, "max")
    assert {o[2] for o in state["bank"]["owners"]} == {0}  # per_layer keys carry no rank
    assert report.merged and report.copied
    fresh = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer"), rank=2)
    fresh.convert(make_stack(n=2, ckpt=("torch", False)))
    fresh.load_state_dict(state)


def test_the_report_names_world_sizes_and_counts_in_one_line():
    saved = trained_ranks(2)
    report = plan_reshard(saved, 1, "max")
    line = report.line()
    assert "\n" not in line and "of 2 rank(s) on 1" in line
    assert f"{len(report.copied)} owner(s) copied bitwise (roles weight:" in line
    assert f"{len(report.merged)} merged by quant.world_size_merge=max (roles grad_output, input:" in line
    doc = report.to_dict()
    assert doc["saved_world_size"] == 2 and doc["world_size"] == 1 and doc["merged"] == list(report.merged)


def with_stream_owner(sd: dict, layer: str, stream: int, amax: float) -> dict:
    """``sd`` with one more owner: ``layer``'s input entered from CUDA stream ``stream``."""
    bank = dict(sd["bank"])
    i = next(i for i, o in enumerate(bank["owners"]) if o[0] == layer and o[1] == "input")
    bank["owners"] = [*bank["owners"], [layer, "input", sd["rank"], stream, 0]]
    bank["dtypes"] = [*bank["dtypes"], bank["dtypes"][i]]
    bank["center_width"] = [*bank["center_width"], bank["center_width"][i]]
    history = torch.full_like(bank["amax_history"][:, i : i + 1], amax)
    bank["amax_history"] = torch.cat([bank["amax_history"], history], dim=1)
    for key in ("scale", "descale", "amax_pending", "nonfinite_count", "center", "center_max", "center_min"):
        bank[key] = torch.cat([bank[key], bank[key][i : i + 1]])
    return dict(sd, bank=bank)


def test_per_stream_owners_are_merged_across_the_ranks_that_hold_them():
    saved = trained_ranks(2, ownership="per_layer_rank_stream")
    layer = saved[0]["bank"]["owners"][0][0]
    saved[0] = with_stream_owner(saved[0], layer, 1, 2.0)  # only rank 0 ran a second stream
    with pytest.raises(WorldSizeMergeError, match=r"9 owner\(s\) differ per rank"):  # 8 + the stream owner
        plan_reshard(saved, 1, "refuse")
    state, report = reshard_state(saved, 1, 0, "max")
    assert f"{layer}#0.input/stream1" in report.merged
    bank = state["bank"]
    i = bank["owners"].index([layer, "input", 0, 1, 0])
    assert bitwise_equal(bank["amax_history"][:, i], torch.full_like(bank["amax_history"][:, i], 2.0))
    fresh = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank_stream"), rank=0)
    fresh.convert(make_stack(n=2, ckpt=("torch", False)))
    fresh.load_state_dict(state)


def test_the_fallbacks_moves_carry_over_to_every_new_rank_and_ranks_that_disagree_are_refused():
    """QuantConfig.fallback's moves are decided from flags reduced over the ranks: equal on each
    saved rank, they carry over to every new one (each layer's saturation streak the longest any
    rank saw); saved ranks that disagree on the moves are refused."""
    ranks = trained_ranks(2, fallback=True)
    layer = ranks[0]["bank"]["owners"][0][0]
    for sd in ranks.values():
        sd["fallback"]["events"] = [[layer, 2, 0, "nonfinite"]]
    mapped, _ = reshard_states(ranks, 3, "max")
    for r, sd in mapped.items():
        state = f8s.Fp8State(f8s.QuantConfig(fallback=True), rank=r)
        state.convert(make_stack(n=2, ckpt=("torch", False)))
        state.load_state_dict(sd)
        assert state.protocol.fallen_back == {layer: 2}, r
        streaks = {
            k: max(ranks[0]["fallback"]["streaks"][k], ranks[1]["fallback"]["streaks"][k])
            for k in ranks[0]["fallback"]["streaks"]
        }
        assert state.protocol.fallback.streaks == streaks, r
    ranks[1]["fallback"]["events"] = []
    with pytest.raises(StateLoadError, match="differs between rank 0 and rank 1 in 'fallback' moves"):
        reshard_states(ranks, 1, "max")
