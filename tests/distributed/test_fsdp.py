"""FSDP2 (``fully_shard``) with FP8 all-gather at the delayed scale, two gloo processes, no Lightning.

Every scenario runs in one pair of spawned processes; each rank saves what it saw and the tests
compare ranks, phases and an unsharded single-process run of the same model and data. The
model is the protocol tests' checkpointed stack (``tests/conftest.py``): every block is an FSDP2
unit run through ``lightning_fp8state.checkpoint`` (torch non-reentrant), so FSDP2 reshards
after the forward and re-gathers each block's weights in the backward, where the recompute
reads them.

``run_pair`` is shared with ``tests/gpu/test_fsdp.py``, which runs the same scenarios on two
CUDA GPUs (NCCL, ``_scaled_mm``, the CUDA kernels) and steady-state steps under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.nn.fsdp import (
    Fp8GatheredWeight,
    enable_fp8_all_gather,
    gathered_layers,
    mark_sharded,
    plain_shard,
)
from lightning_fp8state.recompute import Phase
from tests.conftest import bitwise_equal, event_inputs, make_stack
from tests.distributed.spawn import save_rank_results, spawn_pair_results

N_EVENTS = 4
N_LAYERS = 4  # 2 blocks x (fc1, fc2)
D = 16


def _layers(model) -> dict:
    return {m.layer_name: m for m in model.modules() if isinstance(m, f8s.nn.Fp8Linear)}


class _Recorder:
    """Wraps a state's protocol: the weight codes each call consumed (quantized in the call,
    or adopted from the all-gather), and every gather's shard codes, by phase."""

    def __init__(self, state) -> None:
        self.protocol = protocol = state.protocol
        self.weights: dict[tuple, torch.Tensor] = {}  # (event, layer, phase) -> codes
        self.snapshots: dict[tuple, object] = {}
        self.gathers: list[tuple] = []  # (event, layer, in backward, shard codes)
        quantize, adopt, gather = protocol.quantize, protocol.adopt, protocol.gather_weight

        def on_quantize(record, role, x, phase, prologue=None):
            q, snap = quantize(record, role, x, phase, prologue)
            if role == "weight":
                self._keep(record, phase, q, snap)
            return q, snap

        def on_adopt(record, role, data, snap, phase):
            out = adopt(record, role, data, snap, phase)
            self._keep(record, phase, data, snap)
            return out

        def on_gather(layer, shard, group=None):
            q, snap = gather(layer, shard, group)
            backward = torch._C._current_graph_task_id() != -1
            self.gathers.append((protocol.event, layer, backward, q.clone()))
            return q, snap

        protocol.quantize, protocol.adopt, protocol.gather_weight = on_quantize, on_adopt, on_gather

    def _keep(self, record, phase: Phase, q, snap) -> None:
        key = (self.protocol.event, record.layer, phase.name)
        if isinstance(q, tuple):  # (codes, codes transposed, None): fp8_delayed's weight stage
            q = q[0]
        self.weights[key] = q.detach().clone()
        self.snapshots[key] = (snap.scale.clone(), snap.owner)


_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor")


class _CollectiveCounter:
    """Counts all-reduces and the bytes every all-gather sends from this rank, per event."""

    def __init__(self, state) -> None:
        self.state = state
        self.all_reduces: dict = {}
        self.gather_bytes: dict = {}
        # all_gather_single is newer than some torch releases FSDP2 runs on (2.11 has only
        # all_gather_into_tensor): wrap the entry points this torch has
        self._orig = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

        def all_reduce(tensor, *a, **k):
            self._add(self.all_reduces, 1)
            return self._orig["all_reduce"](tensor, *a, **k)

        def gather(name):
            def wrapped(output, input, *a, **k):
                self._add(self.gather_bytes, input.numel() * input.element_size())
                return self._orig[name](output, input, *a, **k)

            return wrapped

        for name in self._orig:
            setattr(dist, name, all_reduce if name == "all_reduce" else gather(name))

    def _add(self, table, n) -> None:
        event = self.state.event
        table[event] = table.get(event, 0) + n

    def close(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _model(
    state, device: torch.device, *, fsdp: bool, fp8_all_gather: bool = True, compiled: bool = False, mark: bool = True
):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = state.convert(make_stack(n=2, d=D, seed=0, ckpt=("torch", False)).to(device))
    if fsdp:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if fp8_all_gather:
            enable_fp8_all_gather(model)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mark:  # as fp8state_fsdp does
            assert mark_sharded(model) == sorted(_layers(model))
        state.enable_amax_reduction(group=mesh.get_group())
    if compiled:  # each block through torch.compile, after fully_shard (as torchtitan orders them)
        torch._dynamo.reset()
        for block in model.blocks:
            block.compile(backend="aot_eager")
    return model


def _held_weight_codes(state) -> int:
    """How many calls hold their weight's codes from the true forward for the recompute
    (``QuantConfig.weight_codes_once``): each holds a full (gathered) weight's bytes."""
    return sum("weight_codes" in r.derived for rs in state.protocol.stash._by_layer.values() for r in rs)


def _full_weights(model) -> dict:
    """Every converted layer's weight in high precision (a collective under FSDP2)."""
    out = {}
    for name, layer in _layers(model).items():
        w = plain_shard(layer.weight)
        out[name] = (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
    return out


def _train(
    rank: int,
    device: torch.device,
    *,
    fsdp: bool,
    loud: float = 1.0,
    fp8_all_gather: bool = True,
    sync_check_from: int | None = None,
    compiled: bool = False,
    mark: bool = True,
):
    """N_EVENTS steps of SGD; rank 1's inputs times ``loud``. Returns what the tests compare.

    ``sync_check_from``: from that event on (CUDA), each step (forward, backward, optimizer)
    runs under ``torch.cuda.set_sync_debug_mode("error")``: a host sync raises."""
    state = f8s.Fp8State(f8s.QuantConfig(), rank=rank)
    model = _model(state, device, fsdp=fsdp, fp8_all_gather=fp8_all_gather, compiled=compiled, mark=mark)
    recorder = _Recorder(state)
    counter = _CollectiveCounter(state) if fsdp else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, full_before, held_codes = [], [], []
    try:
        for i, x in enumerate(event_inputs(N_EVENTS, d=D, seed=11)):
            full_before.append(_full_weights(model))
            x = (x * (loud if rank == 1 else 1.0)).to(device)
            checked = sync_check_from is not None and i >= sync_check_from
            if checked:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with state.step(i):
                    loss = model(x).float().pow(2).mean()
                    state.commit_forward()
                    held_codes.append(_held_weight_codes(state))  # kept from the forward for the recompute
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach().clone())
            finally:
                if checked:
                    torch.cuda.set_sync_debug_mode(0)
    finally:
        if counter is not None:
            counter.close()
    bank = state.bank
    reducer = state.protocol.amax_reducer
    return {
        "losses": losses,
        "weights": recorder.weights,
        "snapshots": recorder.snapshots,
        "gathers": recorder.gathers,
        "full_before": full_before,
        "full_after": _full_weights(model),
        "owners": [o.as_list() for o in bank.owners],
        "by_owner": {
            (o.layer, o.role, o.site): (bank.scale[i].clone(), bank.amax_history[:, i].clone())
            for i, o in enumerate(bank.owners)
        },
        "commits": {
            e: sorted((o.layer, o.role, r.commits) for o, r in state.ledger.event(e).items())
            for e in state.ledger.events()
        },
        "violations": len(state.ledger.violations),
        "collectives": None if reducer is None else reducer.collectives,
        "all_reduces": None if counter is None else counter.all_reduces,
        "gather_bytes": None if counter is None else counter.gather_bytes,
        "weight_numel": sum(m.weight.numel() for m in _layers(model).values()),
        "bias_numel": sum(m.bias.numel() for m in _layers(model).values()),
        "bank_device": str(bank.device),
        "sync_checked": 0 if sync_check_from is None else N_EVENTS - sync_check_from,
        "held_weight_codes": held_codes,
    }


def _refusals(rank: int, device: torch.device) -> dict:
    """What is refused under FSDP2 with FP8 all-gather (each message, or None if it ran)."""
    out = {}
    state = f8s.Fp8State(f8s.QuantConfig(), rank=rank)
    model = _model(state, device, fsdp=True)
    layer = _layers(model)["blocks.0.fc1"]
    x = event_inputs(1, d=D)[0].to(device)
    # the gathered weight read outside Fp8Linear (it holds codes only)
    try:
        hook = layer.register_forward_pre_hook(lambda m, args: m.weight.sum())
        with torch.no_grad():
            model(x)
        out["outside_read"] = None
    except RuntimeError as exc:
        out["outside_read"] = str(exc)
    finally:
        hook.remove()
    # a layer called at two sites in one event: its one gathered weight cannot serve both
    # (a fresh model: the refused read above left block 0 unsharded with its weight gathered
    # outside any event, which the next training call would refuse as stale)
    state = f8s.Fp8State(f8s.QuantConfig(), rank=rank)
    model = _model(state, device, fsdp=True)
    try:
        with state.step(0):
            h = model.blocks[0](x)
            model.blocks[0](h).float().pow(2).mean().backward()
        out["two_sites"] = None
    except f8s.StateTransitionError as exc:
        out["two_sites"] = str(exc)
    state.abort_event()
    return out


def _worker(rank: int, port: int, out: str, device_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
        sync_check_from = 2  # the first events register owners and verify the registry (host reads)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=2)
        sync_check_from = None
    torch.manual_seed(0)
    results = {
        "same": _train(rank, device, fsdp=True, sync_check_from=sync_check_from),
        "loud": _train(rank, device, fsdp=True, loud=8.0, sync_check_from=sync_check_from),
        "loud_off": _train(rank, device, fsdp=True, loud=8.0, fp8_all_gather=False),
        "loud_off_unmarked": _train(rank, device, fsdp=True, loud=8.0, fp8_all_gather=False, mark=False),
        "loud_compiled": _train(rank, device, fsdp=True, loud=8.0, compiled=True),
        "loud_off_compiled": _train(rank, device, fsdp=True, loud=8.0, fp8_all_gather=False, compiled=True),
        "refusals": _refusals(rank, device),
        "cuda_kernels": device_type == "cuda" and f8s.ops.cuda.is_loaded(),
    }
    if rank == 0:  # the unsharded run: one process, the same model and data as each rank of "same"
        results["unsharded"] = _train(rank, device, fsdp=False)
    save_rank_results(out, rank, results)


def run_pair(out, device_type: str = "cpu", timeout: float = 300) -> list[dict]:
    """Run every scenario in two spawned ranks (gloo on the CPU, NCCL on two GPUs); what each saw."""
    return spawn_pair_results(_worker, out, device_type, timeout)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(tmp_path_factory.mktemp("fsdp"))


# -- FP8 all-gather: the bytes --------------------------------------------------------
def test_gathered_fp8_weight_is_the_full_weight_quantized_at_the_frozen_scale(ranks):
    """Every layer, every event, both ranks: the all-gathered codes equal quantizing the full
    high-precision weight (gathered separately) at the snapshot's scale. A shard quantized at
    any other scale (its own amax, the live scale after commit_forward) fails this."""
    for r, d in enumerate(ranks):
        for name in ("same", "loud"):
            run = d[name]
            checked = 0
            for (event, layer, phase), codes in run["weights"].items():
                full = run["full_before"][event[0]][layer]
                scale, owner = run["snapshots"][(event, layer, phase)]
                assert owner.rank == r and owner.role == "weight"
                want = ops.quantize_fp8(full, scale, torch.float8_e4m3fn)
                assert bitwise_equal(codes, want), (r, name, event, layer, phase)
                checked += 1
            assert checked == N_EVENTS * N_LAYERS * 2  # forward and recompute of every call


def test_sharded_run_equals_the_unsharded_run_bitwise(ranks):
    """Both ranks see the same data as the unsharded run: the gathered codes, losses, weights
    after every step and each owner's scale and history are bitwise the unsharded run's."""
    ref = ranks[0]["unsharded"]
    for d in ranks:
        run = d["same"]
        for key, codes in ref["weights"].items():
            assert bitwise_equal(run["weights"][key], codes), key
        assert all(bitwise_equal(a, b) for a, b in zip(run["losses"], ref["losses"], strict=True))
        for layer, w in ref["full_after"].items():
            assert bitwise_equal(run["full_after"][layer], w), layer
        assert set(run["by_owner"]) == set(ref["by_owner"])
        for key, (scale, history) in ref["by_owner"].items():
            assert bitwise_equal(run["by_owner"][key][0], scale), key
            assert bitwise_equal(run["by_owner"][key][1], history), key


def test_a_sharded_weight_holds_no_codes_between_forward_and_recompute(ranks):
    """FSDP2's peak stays bf16's because a resharded weight is not kept gathered. With the FP8
    all-gather the call adopts the gathered codes and holds none for the recompute (which
    gathers again). With the bf16 all-gather the call quantizes the gathered weight; marked
    sharded (``mark_sharded``, as fp8state_fsdp does) it holds those codes no longer than the
    call, and the run is bitwise the unmarked one, which holds a full weight's codes per call
    from the forward to the backward, as an unsharded run does."""
    for d in ranks:
        for name in ("same", "loud", "loud_compiled", "loud_off", "loud_off_compiled"):
            assert d[name]["held_weight_codes"] == [0] * N_EVENTS, name
        assert d["loud_off_unmarked"]["held_weight_codes"] == [N_LAYERS] * N_EVENTS
        marked, unmarked = d["loud_off"], d["loud_off_unmarked"]
        assert all(bitwise_equal(a, b) for a, b in zip(marked["losses"], unmarked["losses"], strict=True))
        for layer in marked["full_after"]:
            assert bitwise_equal(marked["full_after"][layer], unmarked["full_after"][layer]), layer
    assert ranks[0]["unsharded"]["held_weight_codes"] == [N_LAYERS] * N_EVENTS


def test_backward_regather_gives_the_forward_bytes(ranks):
    """FSDP2 reshards each block after its forward and all-gathers it again in the backward,
    where the checkpointed block's recompute reads it: the re-gathered shard codes equal the
    forward's, and the recompute consumes the forward's gathered weight bytes."""
    for d in ranks:
        for name in ("same", "loud"):
            run = d[name]
            forward = {(e, layer): q for e, layer, backward, q in run["gathers"] if not backward}
            backward = [(e, layer, q) for e, layer, backward, q in run["gathers"] if backward]
            assert len(forward) == N_EVENTS * N_LAYERS and len(backward) == N_EVENTS * N_LAYERS
            for e, layer, q in backward:
                assert bitwise_equal(q, forward[(e, layer)]), (e, layer)
            for (e, layer, phase), codes in run["weights"].items():
                if phase == "RECOMPUTE":
                    assert bitwise_equal(codes, run["weights"][(e, layer, "FORWARD")])


def test_all_gather_sends_one_byte_per_weight_element(ranks):
    """Counted at the collective (torch.distributed.all_gather_single / all_gather_into_tensor
    wrapped): per event, each block is gathered twice (forward, backward); with FP8 all-gather a
    weight element costs 1 byte (fp32: 4), biases stay fp32."""
    for d in ranks:
        on, off = d["loud"], d["loud_off"]
        w, b = on["weight_numel"], on["bias_numel"]
        events = [e for e in off["gather_bytes"] if e is not None]
        assert len(events) == N_EVENTS
        for event in events:
            assert off["gather_bytes"][event] == 2 * (4 * w + 4 * b) // 2, event
            assert on["gather_bytes"][event] == 2 * (1 * w + 4 * b) // 2, event


# -- the amax reduction, ownership, commits ---------------------------------------------
def test_one_all_reduce_per_event_and_the_same_weight_scale_on_every_rank(ranks):
    """Rank 1's data is 8x louder: input scales differ, weight scales agree (the shard amaxes
    MAX-reduced across the shard group). Steady events run exactly one all-reduce (the pending
    amaxes at commit_forward); the first adds one per weight owner (its first scale from the
    full weight's amax)."""
    a, b = ranks[0]["loud"], ranks[1]["loud"]
    assert a["collectives"] == b["collectives"] == N_EVENTS
    for d in (a, b):
        counts = d["all_reduces"]
        assert counts[(0, 0)] == 1 + N_LAYERS
        assert all(counts[(i, 0)] == 1 for i in range(1, N_EVENTS)), counts
    weights = {k: v for k, v in a["by_owner"].items() if k[1] == "weight"}
    assert len(weights) == N_LAYERS
    for key, (scale, history) in weights.items():
        assert bitwise_equal(b["by_owner"][key][0], scale) and bitwise_equal(b["by_owner"][key][1], history)
    inputs = [k for k in a["by_owner"] if k[1] == "input"]
    assert all(not torch.equal(a["by_owner"][k][0], b["by_owner"][k][0]) for k in inputs)


def test_ownership_per_rank_and_one_commit_per_owner_per_event(ranks):
    for r, d in enumerate(ranks):
        run = d["loud"]
        assert {o[2] for o in run["owners"]} == {r}  # the rank is part of every owner key
        assert len(run["owners"]) == N_LAYERS * 3
        assert run["violations"] == 0
        assert len(run["commits"]) == N_EVENTS
        for event, rows in run["commits"].items():
            assert len(rows) == N_LAYERS * 3 and all(c == 1 for _, _, c in rows), event


def test_compiled_blocks_train_as_the_eager_ones(ranks):
    """Each FSDP2-sharded block through torch.compile: with FP8 all-gather (the call runs
    eagerly, a graph break) and without (the call is one op in the block's graph), every loss
    and every owner's scale and history equal those of the same run eager, on both ranks."""
    for r in ranks:
        for compiled, eager in (("loud_compiled", "loud"), ("loud_off_compiled", "loud_off")):
            a, b = r[eager], r[compiled]
            assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)), compiled
            assert a["by_owner"].keys() == b["by_owner"].keys()
            for owner, (scale, history) in a["by_owner"].items():
                assert torch.equal(scale, b["by_owner"][owner][0]), (compiled, owner)
                assert torch.equal(history, b["by_owner"][owner][1]), (compiled, owner)
            assert b["violations"] == 0


def test_unsupported_uses_fail_closed(ranks):
    for d in ranks:
        ref = d["refusals"]
        assert ref["two_sites"] is not None and "fp8_all_gather=False" in ref["two_sites"]
        assert ref["outside_read"] is not None and "consumed by Fp8Linear" in ref["outside_read"]


def test_fp8_all_gather_refuses_configurations_it_cannot_serve():
    for config, match in (
        ({"amax_reduction": "none"}, "amax_reduction"),
        ({"ownership": "per_layer_rank_stream"}, "per_layer_rank_stream"),
        ({"mode": "naive", "strict": False}, "mode='naive'"),
    ):
        state = f8s.Fp8State(f8s.QuantConfig(**config))
        model = state.convert(make_stack(n=1, d=D))
        with pytest.raises(f8s.ConfigError, match=match):
            enable_fp8_all_gather(model)
    # the bf16 control quantizes nothing: nothing to gather in FP8, nothing changes
    state = f8s.Fp8State(f8s.QuantConfig(recipe="bf16"))
    assert enable_fp8_all_gather(state.convert(make_stack(n=1, d=D))) == []


def test_gathered_weight_carries_its_snapshot_and_parameter_dtype():
    codes = torch.zeros(4, 2, dtype=torch.float8_e4m3fn)
    w = Fp8GatheredWeight(codes, "snap", torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.shape == (4, 2) and w.fp8 is codes and w.snapshot == "snap"
    assert type(w.detach()) is Fp8GatheredWeight
    with pytest.raises(RuntimeError, match="consumed by Fp8Linear"):
        w + 1


def test_the_sharded_weight_wrapper_changes_nothing_without_fsdp():
    """enable_fp8_all_gather wraps each converted weight (idempotent); unsharded, the wrapped
    model trains bitwise like the unwrapped one (the wrapper is the plain shard to every op),
    and optimizer states stay plain tensors."""
    runs = []
    for wrap in (False, True):
        state = f8s.Fp8State(f8s.QuantConfig())
        model = state.convert(make_stack(n=2, d=D, seed=0, ckpt=("torch", False)))
        if wrap:
            names = enable_fp8_all_gather(model)
            assert names == enable_fp8_all_gather(model) == gathered_layers(model) == sorted(_layers(model))
            assert type(model.blocks[0].fc1.weight).__name__ == "Fp8ShardedWeight"
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        losses = []
        for i, x in enumerate(event_inputs(3, d=D)):
            with state.step(i):
                loss = model(x).float().pow(2).mean()
                state.commit_forward()
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())
        runs.append((losses, {k: plain_shard(v).detach().clone() for k, v in model.named_parameters()}))
    (la, pa), (lb, pb) = runs
    assert all(bitwise_equal(a, b) for a, b in zip(la, lb, strict=True))
    assert all(bitwise_equal(pa[k], pb[k].as_subclass(torch.Tensor)) for k in pa)
