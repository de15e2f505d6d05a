"""FSDP2 with FP8 all-gather under ``quant.recipe=fp8_current``, two gloo processes, no Lightning.

The weight's scale is the full weight's, per event: at ``begin_event`` each rank takes its
shards' amaxes, one all-reduce (MAX) over the shard group gives the full weights' amaxes, and
each shard is encoded at its weight's scale before the all-gather (``Recipe.gather_scales``).
The model and helpers are ``test_fsdp.py``'s (every block an FSDP2 unit under torch's
non-reentrant checkpoint: the backward re-gathers, the recompute reads the re-gather). Each
scenario is compared with an unsharded single-process fp8_current run of the same model and data.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn.fsdp import enable_fp8_all_gather
from lightning_fp8state.ops.library_dynamic import quantize_fp8_current
from tests.conftest import bitwise_equal, event_inputs, make_stack
from tests.distributed.spawn import save_rank_results, spawn_pair_results
from tests.distributed.test_fsdp import N_EVENTS, N_LAYERS, D, _CollectiveCounter, _full_weights, _layers, _Recorder

SKEW = 16.0  # the first half of every weight's rows (rank 0's shard) divided by this


def _model(state, device: torch.device, *, fsdp: bool, skew: float, fp8_all_gather: bool = True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stack = make_stack(n=2, d=D, seed=0, ckpt=("torch", False))
    with torch.no_grad():  # shards of very different magnitudes: a shard's own amax is not the weight's
        for m in stack.modules():
            if isinstance(m, nn.Linear):
                m.weight[: m.weight.shape[0] // 2] /= skew
    model = state.convert(stack.to(device))
    if fsdp:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if fp8_all_gather:
            enable_fp8_all_gather(model)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state.enable_amax_reduction(group=mesh.get_group())  # no stateful role: nothing to reduce
    return model


def _full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _train(rank: int, device: torch.device, *, fsdp: bool, skew: float = 1.0, fp8_all_gather: bool = True) -> dict:
    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_current"), rank=rank)
    model = _model(state, device, fsdp=fsdp, skew=skew, fp8_all_gather=fp8_all_gather)
    recorder = _Recorder(state)
    counter = _CollectiveCounter(state) if fsdp else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outputs, grads, full_before = [], [], []
    xs = event_inputs(N_EVENTS, d=D, seed=11)
    try:
        with f8s.RecomputeAuditor(state) as auditor:
            for i, x in enumerate(xs):
                full_before.append(_full_weights(model))
                with state.step(i):
                    y = model(x.to(device))
                    loss = y.float().pow(2).mean()
                    state.commit_forward()
                    loss.backward()
                outputs.append(y.detach().clone())
                grads.append(_full_grads(model))
                opt.step()
                opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # evaluation: no event, each weight's scale from its own collective
            evaluated = model(xs[0].to(device)).detach().clone()
    finally:
        if counter is not None:
            counter.close()
    report = auditor.report()
    return {
        "outputs": outputs,
        "grads": grads,
        "evaluated": evaluated,
        "weights": recorder.weights,
        "snapshots": recorder.snapshots,
        "gathers": recorder.gathers,
        "full_before": full_before,
        "full_after": _full_weights(model),
        "owners": [(o.layer, o.role, o.rank) for o in state.protocol.owners()],
        "commits": {
            e: sorted((o.layer, o.role, r.commits) for o, r in state.ledger.event(e).items())
            for e in state.ledger.events()
        },
        "violations": len(state.ledger.violations),
        "audit": (report.ok, report.recomputed, len(report.mismatches)),
        "all_reduces": None if counter is None else counter.all_reduces,
        "gather_bytes": None if counter is None else counter.gather_bytes,
        "weight_numel": sum(m.weight.numel() for m in _layers(model).values()),
        "bias_numel": sum(m.bias.numel() for m in _layers(model).values()),
    }


def _worker(rank: int, port: int, out: str, device_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    results = {
        "same": _train(rank, device, fsdp=True),
        "skew": _train(rank, device, fsdp=True, skew=SKEW),
        "skew_off": _train(rank, device, fsdp=True, skew=SKEW, fp8_all_gather=False),
    }
    if rank == 0:  # the unsharded runs: one process, the same model and data as each rank's
        results["unsharded"] = _train(rank, device, fsdp=False)
        results["unsharded_skew"] = _train(rank, device, fsdp=False, skew=SKEW)
    save_rank_results(out, rank, results)


def run_pair(out, device_type: str = "cpu", timeout: float = 300) -> list[dict]:
    """Every scenario in two spawned ranks (gloo on the CPU, NCCL on two GPUs); what each saw."""
    return spawn_pair_results(_worker, out, device_type, timeout)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(tmp_path_factory.mktemp("fsdp_current"))


def _equal_trees(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def test_sharded_fp8_gather_trains_bitwise_as_the_unsharded_run(ranks):
    """Outputs, every parameter's gradient, the parameters after every step, the weight codes
    every call consumed (forward and recompute) and their scales, and an evaluation forward
    after training: bitwise the unsharded fp8_current run's, on both ranks, with and without
    weights of very different magnitudes per shard."""
    for d in ranks:
        for name, ref_name in (("same", "unsharded"), ("skew", "unsharded_skew")):
            run, ref = d[name], ranks[0][ref_name]
            assert all(bitwise_equal(a, b) for a, b in zip(run["outputs"], ref["outputs"], strict=True)), name
            assert all(_equal_trees(a, b) for a, b in zip(run["grads"], ref["grads"], strict=True)), name
            assert all(_equal_trees(a, b) for a, b in zip(run["full_before"], ref["full_before"], strict=True))
            assert _equal_trees(run["full_after"], ref["full_after"]), name
            assert run["weights"].keys() == ref["weights"].keys()
            # forward and recompute of every call, and the evaluation's (no event)
            assert len(ref["weights"]) == N_EVENTS * N_LAYERS * 2 + N_LAYERS
            for key, codes in ref["weights"].items():
                assert bitwise_equal(run["weights"][key], codes), (name, key)
                assert bitwise_equal(run["snapshots"][key][0], ref["snapshots"][key][0]), (name, key)
            assert bitwise_equal(run["evaluated"], ref["evaluated"]), name


def test_each_shard_is_encoded_at_the_full_weights_scale_not_its_own(ranks):
    """Rank 0 holds the quiet half of every weight (16x smaller than rank 1's rows): its gathered
    codes are its rows of quantize_fp8_current(full weight), and differ from what its shard's
    own amax would give. Without the all-reduce of the amaxes this test fails."""
    for r, d in enumerate(ranks):
        run = d["skew"]
        forward = [(e, layer, q) for e, layer, backward, q in run["gathers"] if not backward and e is not None]
        assert len(forward) == N_EVENTS * N_LAYERS
        for e, layer, q in forward:
            full = run["full_before"][e[0]][layer]
            rows = full.shape[0] // 2
            want = quantize_fp8_current(full, torch.float8_e4m3fn)[0][r * rows : (r + 1) * rows]
            assert q.dtype == torch.float8_e4m3fn and bitwise_equal(q, want), (r, e, layer)
            if r == 0:
                local = quantize_fp8_current(full[:rows], torch.float8_e4m3fn)[0]
                assert not bitwise_equal(q, local), (e, layer)


def test_the_all_gather_is_fp8_and_the_scales_take_one_all_reduce_per_event(ranks):
    """Counted at the collectives: a weight element costs 1 byte per gather (forward and the
    backward's re-gather; fp32 without FP8 all-gather: 4), biases stay fp32; each event runs
    exactly one all-reduce (all weights' amaxes, at begin_event); evaluation outside any event
    one per weight."""
    for d in ranks:
        on, off = d["skew"], d["skew_off"]
        w, b = on["weight_numel"], on["bias_numel"]
        for run, width in ((on, 1), (off, 4)):
            events = [e for e in run["gather_bytes"] if e is not None]
            assert len(events) == N_EVENTS
            for event in events:
                assert run["gather_bytes"][event] == 2 * (width * w + 4 * b) // 2, event
        assert {e: n for e, n in on["all_reduces"].items() if e is not None} == {(i, 0): 1 for i in range(N_EVENTS)}
        assert on["all_reduces"][None] == N_LAYERS
        assert not any(e is not None for e in off["all_reduces"])  # stateless: nothing reduced without it


def test_recompute_reads_the_forward_bytes_and_the_rules_hold(ranks):
    """The backward re-gather gives the forward gather's bytes and the recompute consumes the
    forward's weight codes; the recompute auditor finds every recomputed call bitwise; owners
    carry the rank; one ledger commit per owner per event, no violation."""
    for r, d in enumerate(ranks):
        for name in ("same", "skew"):
            run = d[name]
            forward = {(e, layer): q for e, layer, backward, q in run["gathers"] if not backward}
            backward = [(e, layer, q) for e, layer, backward, q in run["gathers"] if backward]
            assert len(backward) == N_EVENTS * N_LAYERS
            for e, layer, q in backward:
                assert bitwise_equal(q, forward[(e, layer)]), (e, layer)
            for (e, layer, phase), codes in run["weights"].items():
                if phase == "RECOMPUTE":
                    assert bitwise_equal(codes, run["weights"][(e, layer, "FORWARD")])
            ok, recomputed, mismatches = run["audit"]
            assert ok and mismatches == 0 and recomputed == N_EVENTS * N_LAYERS, run["audit"]
            assert {o[2] for o in run["owners"]} == {r} and len(run["owners"]) == N_LAYERS * 3
            assert run["violations"] == 0 and len(run["commits"]) == N_EVENTS
            for event, rows in run["commits"].items():
                assert len(rows) == N_LAYERS * 3 and all(c == 1 for _, _, c in rows), event
