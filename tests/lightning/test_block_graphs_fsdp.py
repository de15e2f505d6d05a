"""Per-block graphs under fp8state_fsdp on two CPU ranks (gloo), the graphs emulated
(tests/graph_emulation.py: a replay runs the captured operators on the captured tensors, no
Python per call). FSDP2 gathers each block's parameters in the block's own hooks and frees them
after use, so the replayed blocks run through each unit's ``__call__`` and the graphs read
static copies of the gathered parameters, refilled before every replay: the graphed fit is
bitwise the eager fit on every rank (weights, momentum, quantizer state), FSDP2's gathers and
reduce-scatters and the cross-rank amax reduction eager between the replays, one commit per
owner per event, and a resume from a checkpoint bitwise the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.launch import load_ranks, run_plan
from tests.lightning.test_block_graphs_ddp import assert_same_run
from tests.lightning.test_fsdp import BATCHES_PER_EPOCH, N_OWNERS

EPOCHS = 1  # (the BoringModel's SGD at accumulate 1 leaves finite weights for one epoch only)
# the weights gathered in high precision: per-block graphs read static copies of them
COMMON = {
    "strategy": "fp8state_fsdp",
    "strategy_kwargs": {"fp8_all_gather": False},
    "accumulate": 1,
    "max_epochs": EPOCHS,
    "audit": False,  # an auditor runs Python per call: GraphedBlocks refuses it
}
PLAN = [
    {"name": "eager", **COMMON},
    {"name": "graphed", "graphed": True, **COMMON},
    {
        "name": "graphed_interrupted",
        "graphed": True,
        "save_at": [[0, 5, "graphed_step.ckpt"]],
        "stop_after_save": True,
        **COMMON,
    },
    {"name": "graphed_resumed", "graphed": True, "resume_from": "graphed_step.ckpt", **COMMON},
    {"name": "eager_current", "config": {"recipe": "fp8_current"}, **COMMON},
    {"name": "eager_fp8_gather", **COMMON, "strategy_kwargs": {}},
    {"name": "graphed_fp8_gather", "graphed": True, **COMMON, "strategy_kwargs": {}},
    {"name": "eager_current_fp8_gather", "config": {"recipe": "fp8_current"}, **COMMON, "strategy_kwargs": {}},
    {
        "name": "graphed_current_fp8_gather",
        "graphed": True,
        "config": {"recipe": "fp8_current"},
        **COMMON,
        "strategy_kwargs": {},
    },
    {"name": "eager_kept", **COMMON, "strategy_kwargs": {"fp8_all_gather": False, "reshard_after_forward": False}},
    {
        "name": "graphed_kept",
        "graphed": True,
        **COMMON,
        "strategy_kwargs": {"fp8_all_gather": False, "reshard_after_forward": False},
    },
    {"name": "graphed_current", "graphed": True, "config": {"recipe": "fp8_current"}, **COMMON},
]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp_graphed")
    run_plan(PLAN, path, timeout=420)
    return path


def test_graphed_fsdp_fit_is_bitwise_the_eager_fit_on_every_rank(out):
    eager, graphed = load_ranks(out, "eager", 2), load_ranks(out, "graphed", 2)
    events = [(s, 0) for s in range(BATCHES_PER_EPOCH * EPOCHS)]
    for r in range(2):
        assert graphed[r]["strategy"] == "Fp8StateFSDPStrategy"
        assert graphed[r]["replays"] == len(events) - 2  # two warm-up events, then a capture and replays
        assert graphed[r]["events"] == eager[r]["events"] == events
        assert all(torch.isfinite(v).all() for v in eager[r]["params"].values())  # a comparison that can fail
        assert_same_run(eager[r], graphed[r], f"rank {r}")
        assert graphed[r]["violations"] == 0
        for event in events:
            per_owner = graphed[r]["per_event"][event]
            assert len(per_owner) == N_OWNERS, (r, event)
            assert set(per_owner.values()) == {(1, 1, 0)}, (r, event)  # (commits, observations, recompute records)
        assert graphed[r]["collectives"] == eager[r]["collectives"] == len(events)  # one amax all-reduce per event
    # the ranks' shards make one model (FSDP2 reduce-scattered the replayed gradients)
    for k in graphed[0]["params"]:
        assert torch.equal(graphed[0]["params"][k], graphed[1]["params"][k]), k


def test_graphed_fsdp_resume_is_bitwise_the_uninterrupted_graphed_run(out):
    uninterrupted, resumed = load_ranks(out, "graphed", 2), load_ranks(out, "graphed_resumed", 2)
    for r in range(2):
        assert_same_run(uninterrupted[r], resumed[r], f"rank {r}")


@pytest.mark.parametrize(
    ("eager_name", "graphed_name"),
    [
        ("eager_current", "graphed_current"),
        ("eager_kept", "graphed_kept"),
        ("eager_fp8_gather", "graphed_fp8_gather"),
        ("eager_current_fp8_gather", "graphed_current_fp8_gather"),
    ],
)
def test_graphed_fsdp_fit_is_bitwise_its_eager_fit_with_a_stateless_recipe_kept_parameters_or_fp8_gathers(
    out, eager_name, graphed_name
):
    """fp8_current: scales derived on the device from each call's tensors, replayed so;
    reshard_after_forward=False: FSDP2 keeps the gathered parameters from the forward to the
    backward (no second gather), and the backward's copies read those; FP8 all-gather: the graphs
    read static copies of the gathered codes and of their snapshot's scales, refreshed before
    every replay (delayed: the event's frozen copy; fp8_current: the full weight's scale, derived
    anew every event)."""
    eager, graphed = load_ranks(out, eager_name, 2), load_ranks(out, graphed_name, 2)
    fp8_gathers = 4 if graphed_name.endswith("fp8_gather") else 0  # the blocks' weights (inp, head: not units)
    for r in range(2):
        assert len([k for k in graphed[r]["fp8_gathered"] if k.startswith("blocks.")]) == fp8_gathers
        assert eager[r]["collectives"] == graphed[r]["collectives"]
        for event, per_owner in graphed[r]["per_event"].items():
            assert set(per_owner.values()) == {(1, 1, 0)}, (r, event)
        assert graphed[r]["replays"] == BATCHES_PER_EPOCH * EPOCHS - 2
        assert all(torch.isfinite(v).all() for v in eager[r]["params"].values())
        assert eager[r]["global_step"] == graphed[r]["global_step"]
        for k in eager[r]["params"]:
            assert torch.equal(eager[r]["params"][k], graphed[r]["params"][k]), (r, k)
        assert graphed[r]["violations"] == 0
