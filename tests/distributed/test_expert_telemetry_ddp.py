"""Per-expert telemetry under data parallelism (two gloo ranks): the ranks route different tokens,
so their per-expert counts differ; the rows rank 0 writes hold the sums over both ranks (tokens
per expert, and the idle experts derived from those sums: an expert idle on rank 0 but busy on
rank 1 is not idle), and each written window costs one all-reduce of its [steps, experts] counts
on every rank (the rank that does not write too), over the amax reduction's group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.telemetry import TrainingTelemetry, read_jsonl
from tests.distributed.spawn import save_rank_results, spawn

E, D, FF = 4, 8, 12
LAYER = "experts"
# per step, per rank: the experts of each token's top-2. Step 0: expert 3 only on rank 1 (idle on
# rank 0 alone); step 1: expert 2 only on rank 0; step 2: every expert busy in the sum, not on
# rank 0; step 3: experts 2 and 3 idle on both; step 4 (after the last log step) goes with close()
ROUTES = [
    {0: [[0, 1], [1, 0], [0, 1]], 1: [[3, 0], [1, 3], [0, 1]]},
    {0: [[0, 2], [1, 0], [2, 1]], 1: [[1, 0], [0, 1], [1, 0]]},
    {0: [[1, 0], [0, 1], [1, 0]], 1: [[2, 3], [3, 2], [0, 1]]},
    {0: [[0, 1], [0, 1], [0, 1]], 1: [[1, 0], [1, 0], [1, 0]]},
    {0: [[3, 1], [0, 1], [1, 0]], 1: [[0, 1], [1, 0], [0, 1]]},
]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # the amax reduction's group: the window's sum goes over it
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = GroupedExperts(E, D, FF)
    with torch.no_grad():
        model.experts.gate_up_proj.normal_(0, 0.2)
        model.experts.down_proj.normal_(0, 0.2)
    state = f8s.Fp8State(f8s.QuantConfig(), rank=rank)
    assert state.enable_amax_reduction(group=group)
    state.convert(model)
    run_dir = os.path.join(out, f"run{rank}")
    tel = TrainingTelemetry(run_dir, model=model, log_every=2, saturation=False, write=rank == 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    real_all_reduce = dist.all_reduce
    calls: list[tuple] = []

    def counting(tensor, *args, **kwargs):
        calls.append((tensor.dtype, tuple(tensor.shape), kwargs.get("group") is group))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    own, per_step = [], []
    for step, routes in enumerate(ROUTES):
        index = torch.tensor(routes[rank])
        own.append(torch.bincount(index.flatten(), minlength=E).tolist())  # this rank's reference
        x = torch.randn(3, D, generator=torch.Generator().manual_seed(10 * step + rank))
        with state.step(step):
            model.experts(x, index, torch.full(index.shape, 0.5)).pow(2).mean().backward()
        tel.before_optimizer_step(opt)
        opt.step()
        opt.zero_grad()
        seen = len(calls)
        tel.after_optimizer_step()
        per_step.append(calls[seen:])
    seen = len(calls)
    tel.close()
    dist.all_reduce = real_all_reduce
    rows = read_jsonl(os.path.join(run_dir, "telemetry.jsonl")) if rank == 0 else []
    save_rank_results(out, rank, {"own": own, "collectives": per_step, "close": calls[seen:], "rows": rows})


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_telemetry_ddp")
    spawn(_worker, (str(out),), what="gloo workers")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_rank_zero_writes_the_tokens_and_idle_experts_summed_over_the_ranks(ranks):
    a, b = ranks
    rows = a["rows"]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    # the ranks' views differ, except in step 3 (both send every token to experts 0 and 1)
    assert [oa != ob for oa, ob in zip(a["own"], b["own"], strict=True)] == [True, True, True, False, True]
    for step, row in enumerate(rows):
        want = [x + y for x, y in zip(a["own"][step], b["own"][step], strict=True)]
        assert [row[f"fp8state/expert_tokens/{LAYER}/{e}"] for e in range(E)] == want, step
        idle = [e for e in range(E) if want[e] == 0]
        assert row[f"fp8state/experts_idle/{LAYER}"] == len(idle), step
        assert row[f"fp8state/experts_idle_ids/{LAYER}"] == ",".join(map(str, idle)), step
        assert row[f"fp8state/expert_calls/{LAYER}"] == 1
    # the cases the routing sets up: idle on rank 0 only is not idle; idle on both is
    assert [row[f"fp8state/experts_idle_ids/{LAYER}"] for row in rows] == ["2", "3", "", "2,3", "2"]


def test_one_all_reduce_per_written_window_on_every_rank(ranks):
    for rank in ranks:
        per_step = rank["collectives"]
        assert [len(c) for c in per_step] == [0, 1, 0, 1, 0]  # log steps 2 and 4 only
        assert per_step[1] == per_step[3] == [(torch.int64, (2, E), True)]  # [steps, experts], the group
        assert rank["close"] == [(torch.int64, (1, E), True)]  # the last window, written by close()
