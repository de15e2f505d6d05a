"""QuantConfig.fallback across two gloo ranks under DDP: a fault seen by one rank moves the layer on
both, at the same event, and the ranks stay alike afterwards.

The outlier (as in tests/unit/test_fallback_current.py): from step 3 on, ``fc1``'s weight holds
one element of 1e37 (a replicated parameter: both ranks); at step 3 only, rank 1's input (not
rank 0's) carries one feature scaled by 1e8. Inputs are not amax-reduced (the default reduces
weights only), so only rank 1's delayed input scale takes the 1e8 into its history: at step 4
only rank 1's fc1 output is inf/NaN (its descales' product overflows float32), rank 0's is
finite. The flags are MAX-reduced before the decision, so both ranks move fc1 at step 4's end;
DDP averages the non-finite gradient into both ranks, so both skip step 4. Each target runs
(bf16 and current), each in its own pair of states in one pair of processes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal
from tests.distributed.spawn import spawn

STEPS, OUTLIER_STEP, MOVE_STEP = 7, 3, 4
TARGETS = ("bf16", "current")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 32)
        self.register_buffer("gain", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.tanh(self.fc1(x * self.gain))))


def _run(rank: int, target: str) -> dict:
    torch.manual_seed(0)
    net = _Net()
    state = f8s.Fp8State(f8s.QuantConfig(fallback=True, fallback_to=target), rank=rank)
    state.convert(net)
    assert state.enable_amax_reduction()  # weights: the fallback's flags reduce over the same group
    model = DistributedDataParallel(net, broadcast_buffers=False)  # (the gain buffer differs per rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    finite_out: dict[int, bool] = {}
    net.fc1.register_forward_hook(
        lambda m, a, out: finite_out.update({state.clock.event[0]: bool(out.isfinite().all())})
    )
    result = {"skipped": [], "moved_after": []}
    for step in range(STEPS):
        with torch.no_grad():
            if step == OUTLIER_STEP:
                net.fc1.weight[0, 0] = 1e37
            net.gain[1] = 1e8 if step == OUTLIER_STEP and rank == 1 else 1.0
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x = torch.randn(16, 32, generator=g)
        with state.step(step):
            loss = model(x).sum()
            state.commit_forward()
            loss.backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        else:
            result["skipped"].append(step)
        opt.zero_grad()
        result["moved_after"].append(dict(state.protocol.fallen_back))
    result["finite_out"] = finite_out
    result["fallback"] = state.state_dict()["fallback"]
    result["routes"] = {n: r.name for n, r in state.protocol.layer_recipes.items()}
    result["params"] = {n: p.detach().clone() for n, p in net.named_parameters()}
    weights = [i for i, o in enumerate(state.bank.owners) if o.role == "weight"]
    result["weight_history"] = state.bank.amax_history[:, weights].clone()
    return result


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {target: _run(rank, target) for target in TARGETS}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fallback_ranks")
    spawn(_worker, (str(out),), what="gloo workers")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("target", TARGETS)
def test_a_fault_on_one_rank_moves_the_layer_on_both_at_the_same_event(ranks, target):
    r0, r1 = ranks[0][target], ranks[1][target]
    # the fault is local: only rank 1's fc1 output went non-finite, at step 4 only
    assert r1["finite_out"][MOVE_STEP] is False and r0["finite_out"][MOVE_STEP] is True
    assert all(r0["finite_out"].values())
    # both ranks moved fc1 at the end of step 4, not before: the same event
    for r in (r0, r1):
        assert [bool(moved) for moved in r["moved_after"]] == [s >= MOVE_STEP for s in range(STEPS)]
        assert r["moved_after"][-1] == {"fc1": MOVE_STEP}
        assert r["fallback"]["events"] == [["fc1", MOVE_STEP, 0, "nonfinite", target]]
        assert r["routes"] == {"fc1": {"bf16": "bf16", "current": "fp8_current"}[target]}
        assert r["skipped"] == [MOVE_STEP]  # DDP averaged rank 1's non-finite gradient into both
    assert r0["fallback"] == r1["fallback"]


@pytest.mark.parametrize("target", TARGETS)
def test_after_the_move_the_ranks_train_bitwise_alike(ranks, target):
    r0, r1 = ranks[0][target], ranks[1][target]
    for name, p in r0["params"].items():
        assert torch.isfinite(p).all() or name == "fc1.weight", name
        assert bitwise_equal(p, r1["params"][name]), name
    assert bitwise_equal(r0["weight_history"], r1["weight_history"])
