"""GraphedBlocks over FSDP2 units that take side inputs (rotary-like cos/sin, a mask, plain
keywords), on one gloo rank with the graphs emulated (tests/graph_emulation.py). Every block is
a unit whose MixedPrecisionPolicy computes in bf16 and casts its floating inputs, so FSDP2's
pre-forward hands the block bf16 copies of the float32 cos/sin: the whole-stack call captures
that cast inside the graphs (a replay casts what it is given, as the hook does), and call_block
runs each block inside the unit's own call (hooks first) and captures with the inputs as cast.
Both are bitwise the eager checkpointed run (outputs, weights, scales), one commit per owner per
event; a per-call pass over units without checkpointing, and a side input that requires grad,
are refused by name."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.spawn import spawn

EVENTS, WARMUP = 5, 2


def _train(mode: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    import lightning_fp8state as f8s  # noqa: PLC0415
    from lightning_fp8state.graphs import GraphedBlocks  # noqa: PLC0415
    from tests.graph_emulation import EmulatedGraphBackend  # noqa: PLC0415
    from tests.unit.test_block_graphs_side_inputs import SideNet, side  # noqa: PLC0415

    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(SideNet())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model)
    if mode != "eager":
        runner = GraphedBlocks(
            model.blocks, warmup=WARMUP, backend=EmulatedGraphBackend(), checkpoint=mode != "unchecked"
        )
        model.runner, model.per_block = runner, mode != "whole"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for i in range(EVENTS):
        with state.step(i):
            y = model(*side(i))
            loss = y.float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        outs.append(y.detach().float().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {
        "outs": outs,
        "weights": {k: v.full_tensor().clone() for k, v in model.state_dict().items()},
        "scales": state.bank.scales.clone(),
        "commits": {e: sorted({r.commits for r in state.ledger.event(e).values()}) for e in state.ledger.events()},
        "ok": state.ledger.ok,
    }
    if mode != "eager":
        result["replays"] = model.runner.replays
        # the side inputs' static buffers, as the graphs read them
        result["static_dtypes"] = sorted(
            {str(s.buffer.dtype) for g in model.runner.graphs for s in g.sides if s.buffer.is_floating_point()}
        )
    return result


def _side_input_that_requires_grad() -> tuple[str, str]:
    """call_block on a unit (through its hooks) given a cos that requires grad: the refusal."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    import lightning_fp8state as f8s  # noqa: PLC0415
    from lightning_fp8state.graphs import GraphedBlocks  # noqa: PLC0415
    from tests.graph_emulation import EmulatedGraphBackend  # noqa: PLC0415
    from tests.unit.test_block_graphs_side_inputs import SideNet, side  # noqa: PLC0415

    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(SideNet())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    runner = GraphedBlocks(model.blocks, warmup=1, backend=EmulatedGraphBackend())
    x, cos, sin, mask = side(0)
    with state.step(0):
        try:
            runner.call_block(0, x.requires_grad_(), cos.requires_grad_(), sin, mask=mask)
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
    return "", "no error"


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    results = {}
    for mode in ("eager", "whole", "call_block", "unchecked"):
        try:
            results[mode] = _train(mode)
        except Exception as exc:  # noqa: BLE001  (a refusal is a result)
            results[mode] = {"error": (type(exc).__name__, str(exc))}
    results["grad_side"] = _side_input_that_requires_grad()
    torch.save(results, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_side")
    spawn(_worker, (str(out),), nprocs=1, what="gloo worker")
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("mode", ["whole", "call_block"])
def test_units_with_side_inputs_cast_by_their_policy_replay_bitwise_the_eager_run(results, mode):
    eager, graphed = results["eager"], results[mode]
    assert "error" not in eager, eager.get("error")
    assert "error" not in graphed, graphed.get("error")
    assert graphed["replays"] == EVENTS - WARMUP
    assert all(torch.isfinite(y).all() for y in eager["outs"])
    assert not torch.equal(eager["outs"][0], eager["outs"][-1])
    for i, (a, b) in enumerate(zip(eager["outs"], graphed["outs"], strict=True)):
        assert torch.equal(a, b), f"event {i}: output differs"
    for k, w in eager["weights"].items():
        assert torch.equal(w, graphed["weights"][k]), k
    assert torch.equal(eager["scales"], graphed["scales"])
    assert graphed["ok"] and set(map(tuple, graphed["commits"].values())) == {(1,)}
    # the whole stack's buffers hold what the caller passed (float32), the graphs cast them; a
    # per-call pass captured inside each unit's call, with cos/sin as its hook cast them (bf16)
    assert graphed["static_dtypes"] == (["torch.float32"] if mode == "whole" else ["torch.bfloat16"])


def test_per_call_refusals_over_units_name_what_they_refuse(results):
    """A per-call pass over units without checkpointing (its forwards run before the backwards
    are captured); a side input that requires grad, named after the block's forward (``cos``,
    not ``args[0]``) although call_block runs the unit through its own call, where the unit's
    forward is a stand-in."""
    kind, message = results["unchecked"]["error"]
    assert kind == "ConfigError"
    assert "GraphedBlocks(checkpoint=False) is not allowed with FSDP2 units called block by block: expected" in message
    kind, message = results["grad_side"]
    assert kind == "ConfigError" and "argument 'cos' requires grad" in message, (kind, message)
