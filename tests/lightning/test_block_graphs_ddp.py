"""Per-block graphs under fp8state_ddp on two CPU ranks (gloo), the graphs emulated
(tests/graph_emulation.py: a replay runs the captured operators, no Python per call): the graphed
fit is bitwise the eager fit on every rank (weights, momentum, quantizer state), with DDP's
all-reduce and the cross-rank amax reduction eager between the replays, gradient accumulation,
one commit per owner per event, and a resume from a checkpoint bitwise the uninterrupted run; and
a Hugging Face Llama's decoder layers graphed by Fp8StateCallback(graph_blocks=True), bitwise its
eager checkpointed fit under DDP."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.launch import load_ranks, run_plan
from tests.lightning.test_ddp import ACCUMULATE, BATCHES_PER_EPOCH, EPOCHS, N_OWNERS, bitwise, expected_events

COMMON = {"audit": False}  # an auditor runs Python per call: GraphedBlocks refuses it
HF = {**COMMON, "samples": 16, "max_epochs": 1, "accumulate": 1}  # 4 steps a rank: 2 warm-up, 2 replayed
PLAN = [
    {"name": "eager", **COMMON},
    {"name": "graphed", "graphed": True, **COMMON},
    {
        "name": "graphed_interrupted",
        "graphed": True,
        "save_at": [[0, 5, "graphed_step.ckpt"]],  # mid-epoch, right after an optimizer step
        "stop_after_save": True,
        **COMMON,
    },
    {"name": "graphed_resumed", "graphed": True, "resume_from": "graphed_step.ckpt", **COMMON},
    # a user's Hugging Face Llama in its own LightningModule: Fp8StateCallback(graph_blocks=True)
    *(
        {"name": f"hf_{mode}", "model": "hf_llama", "graph_blocks": mode == "graphed", **HF}
        for mode in ("eager", "graphed")
    ),
]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("ddp_graphed")
    run_plan(PLAN, path, timeout=420)
    return path


def assert_same_run(a: dict, b: dict, where: str) -> None:
    assert a["global_step"] == b["global_step"], where
    for k in a["params"]:
        assert bitwise(a["params"][k], b["params"][k]), f"{where}: {k}"
    for x, y in zip(a["momentum"], b["momentum"], strict=True):
        assert bitwise(x, y), f"{where}: momentum"
    for k in ("scale", "amax_history"):
        assert bitwise(a["bank"][k], b["bank"][k]), f"{where}: bank {k}"


def test_graphed_fit_is_bitwise_the_eager_fit_on_every_rank(out):
    eager, graphed = load_ranks(out, "eager", 2), load_ranks(out, "graphed", 2)
    events = expected_events(BATCHES_PER_EPOCH, ACCUMULATE, EPOCHS)
    for r in range(2):
        assert graphed[r]["replays"] == len(events) - 2  # two warm-up events, then a capture and replays
        assert graphed[r]["events"] == eager[r]["events"] == events
        assert_same_run(eager[r], graphed[r], f"rank {r}")
        assert graphed[r]["violations"] == 0
        for event in events:
            per_owner = graphed[r]["per_event"][event]
            assert len(per_owner) == N_OWNERS, (r, event)
            assert set(per_owner.values()) == {(1, 1, 0)}, (r, event)  # (commits, observations, recompute records)
        assert graphed[r]["collectives"] == eager[r]["collectives"] and graphed[r]["collectives"] > 0
    # the replicas agree (DDP's all-reduce ran on the replayed gradients)
    for k in graphed[0]["params"]:
        assert bitwise(graphed[0]["params"][k], graphed[1]["params"][k]), k


def test_graphed_resume_is_bitwise_the_uninterrupted_graphed_run(out):
    uninterrupted, resumed = load_ranks(out, "graphed", 2), load_ranks(out, "graphed_resumed", 2)
    for r in range(2):
        assert_same_run(uninterrupted[r], resumed[r], f"rank {r}")
        assert torch.equal(torch.tensor(resumed[r]["clock_last"]), torch.tensor(uninterrupted[r]["clock_last"]))


def test_graph_blocks_switch_under_ddp_is_bitwise_the_eager_fit_on_every_rank(out):
    eager, graphed = load_ranks(out, "hf_eager", 2), load_ranks(out, "hf_graphed", 2)
    for r in range(2):
        assert eager[r]["replays"] is None and graphed[r]["replays"] == 2  # 4 events: 2 warm-up, capture, replay
        assert graphed[r]["events"] == eager[r]["events"] == [(s, 0) for s in range(4)]
        for i, (a, b) in enumerate(zip(eager[r]["losses"], graphed[r]["losses"], strict=True)):
            assert bitwise(a.reshape(1), b.reshape(1)), f"rank {r} step {i}: loss"
        assert_same_run(eager[r], graphed[r], f"rank {r}")
        assert graphed[r]["violations"] == 0
        for event in graphed[r]["events"]:
            assert {c for c, _, _ in graphed[r]["per_event"][event].values()} == {1}, (r, event)
    # each rank trained on its own rows; DDP's all-reduce ran on the replayed gradients
    assert not torch.equal(eager[0]["losses"][0], eager[1]["losses"][0])
    for k in graphed[0]["params"]:
        assert bitwise(graphed[0]["params"][k], graphed[1]["params"][k]), k
