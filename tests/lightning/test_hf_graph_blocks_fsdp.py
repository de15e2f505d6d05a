"""Fp8StateCallback(graph_blocks=True) under fp8state_fsdp on two CPU ranks (gloo), the graphs
emulated (tests/graph_emulation.py): a tiny transformers Llama whose decoder layers are FSDP2
units (the strategy shards every member of ``model.layers``), its weights all-gathered as FP8
codes. Transformers' own loop calls each layer with its side inputs (rotary cos/sin, mask,
position ids); the runner captures each layer inside the unit's call, FSDP2's gathers, casts and
reduce-scatters eager around the replays. The graphed fit is bitwise the eager checkpointed fit
on every rank: losses, the gathered weights, the quantizer state; one commit per owner per event."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import bitwise_equal
from tests.lightning.launch import load_ranks, run_plan

pytest.importorskip("transformers")

STEPS = 4  # a rank's 8 rows in batches of 2: 2 warm-up events, the capture's, one replay
HF = {
    "model": "hf_llama",
    "strategy": "fp8state_fsdp",
    "audit": False,  # an auditor runs Python per call: GraphedBlocks refuses it
    "samples": 2 * 2 * STEPS,
    "max_epochs": 1,
    "accumulate": 1,
}
PLAN = [{"name": "eager", **HF}, {"name": "graphed", "graph_blocks": True, **HF}]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_fsdp_graphed")
    run_plan(PLAN, path, timeout=300)
    return path


def test_graph_blocks_switch_under_fsdp2_is_bitwise_the_eager_fit_on_every_rank(out):
    eager, graphed = load_ranks(out, "eager", 2), load_ranks(out, "graphed", 2)
    events = [(s, 0) for s in range(STEPS)]
    for r in range(2):
        assert graphed[r]["strategy"] == eager[r]["strategy"] == "Fp8StateFSDPStrategy"
        assert len([k for k in graphed[r]["fp8_gathered"] if ".layers." in k]) == 14  # 7 linears a layer
        assert eager[r]["replays"] is None and graphed[r]["replays"] == STEPS - 2  # the capture's and one
        assert graphed[r]["events"] == eager[r]["events"] == events
        assert len(graphed[r]["losses"]) == STEPS
        for i, (a, b) in enumerate(zip(eager[r]["losses"], graphed[r]["losses"], strict=True)):
            assert bitwise_equal(a, b), f"rank {r} step {i}: loss"
        assert all(torch.isfinite(p).all() for p in eager[r]["params"].values())
        assert eager[r]["global_step"] == graphed[r]["global_step"] == STEPS
        for name, p in eager[r]["params"].items():
            assert bitwise_equal(p, graphed[r]["params"][name]), f"rank {r}: {name}"
        for k in ("scale", "amax_history"):
            assert bitwise_equal(eager[r]["bank"][k], graphed[r]["bank"][k]), f"rank {r}: bank {k}"
        assert graphed[r]["violations"] == 0
        for event in events:
            assert set(graphed[r]["per_event"][event].values()) == {(1, 1, 0)}, (r, event)
        assert graphed[r]["collectives"] == eager[r]["collectives"] == STEPS  # one amax all-reduce per event
    # each rank trained on its own rows; FSDP2 reduce-scattered the replayed gradients into one model
    assert not torch.equal(eager[0]["losses"][0], eager[1]["losses"][0])
    for name, p in graphed[0]["params"].items():
        assert bitwise_equal(p, graphed[1]["params"][name]), name
    # the weights moved during the fit (a comparison of untrained weights would prove nothing)
    assert not bitwise_equal(eager[0]["losses"][0], eager[0]["losses"][-1])
