"""FSDP2 with FP8 all-gather under ``quant.recipe=fp8_blockwise``, two gloo processes, no Lightning.

Each rank encodes its own rows of a weight in 128x128 blocks and sends the codes with the
blocks' scales (``Recipe.shard_scales``): where every shard holds a multiple of 128 rows its
blocks are the full weight's, so what is gathered is bitwise the full weight's encode. The
model has one weight of each kind: ``fc1`` [512, 512] (256 rows a rank: FP8), ``fc2``
[192, 512] (96 rows a rank: high precision, warned about) and ``fc3`` [131, 192] (an uneven
split, 66 and 65 rows: high precision, warned about). Every layer is an FSDP2 unit run through
``lightning_fp8state.checkpoint`` (torch non-reentrant): FSDP2 re-gathers in the backward, the
recompute reads the re-gather. Each sharded run is compared with the single-process
fp8_blockwise run of the same model and data.

``run_pair`` is shared with ``tests/gpu/test_fsdp_blockwise.py`` (two GPUs, NCCL, the CUDA
block kernels; fc1's forward and input-gradient GEMMs are shaped for the block-scaled
``torch._scaled_mm``: K a multiple of 512, N of 128, M of 16).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn.fsdp import Fp8ShardedWeight, enable_fp8_all_gather, gathered_layers
from tests.conftest import bitwise_equal
from tests.distributed.spawn import save_rank_results, spawn_pair_results
from tests.distributed.test_fsdp import _full_weights, _Recorder

N_EVENTS = 3
LAYERS = ("fc1", "fc2", "fc3")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(512, 512), nn.Linear(512, 192), nn.Linear(192, 131)

    def forward(self, x):
        for i, fc in enumerate((self.fc1, self.fc2, self.fc3)):
            x = f8s.checkpoint(fc, x, engine="torch", use_reentrant=False)
            x = torch.nn.functional.gelu(x) if i < 2 else x
        return x


class _PreGatherLog:
    """Records what each Fp8ShardedWeight's pre-all-gather hands FSDP2 to send: per layer, the
    dtypes, shapes and bytes of the inputs of every gather."""

    def __init__(self) -> None:
        self.sent: dict[str, list] = {}
        self._orig = orig = Fp8ShardedWeight.fsdp_pre_all_gather

        def pre(shard, mesh, outer_size, outer_stride, module, mp_policy):
            inputs, meta = orig(shard, mesh, outer_size, outer_stride, module, mp_policy)
            row = [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in inputs]
            self.sent.setdefault(module.layer_name, []).append(row)
            return inputs, meta

        Fp8ShardedWeight.fsdp_pre_all_gather = pre

    def close(self) -> None:
        Fp8ShardedWeight.fsdp_pre_all_gather = self._orig


def _full_grads(model) -> dict:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }


def _train(rank: int, device: torch.device, *, fsdp: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_blockwise"), rank=rank)
    model = state.convert(_Net().to(device))
    log = _PreGatherLog() if fsdp else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fsdp:
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            enable_fp8_all_gather(model)
            for name in LAYERS:
                fully_shard(getattr(model, name), mesh=mesh)
            fully_shard(model, mesh=mesh)
        recorder = _Recorder(state)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(5)
        losses, grads, full_before = [], [], []
        try:
            with f8s.RecomputeAuditor(state) as auditor:
                for i in range(N_EVENTS):
                    full_before.append(_full_weights(model))
                    x = (torch.randn(32, 512, generator=g) * (2.0**i)).to(device)
                    with state.step(i):
                        loss = model(x).float().pow(2).mean()
                        state.commit_forward()
                        loss.backward()
                    losses.append(loss.detach().clone())
                    grads.append(_full_grads(model))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # evaluation: no event, each shard's blocks encoded as in training
                evaluated = model((torch.randn(32, 512, generator=g)).to(device)).clone()
        finally:
            if log is not None:
                log.close()
    report = auditor.report()
    return {
        "losses": losses,
        "evaluated": evaluated,
        "grads": grads,
        "full_before": full_before,
        "full_after": _full_weights(model),
        "weights": recorder.weights,
        "snapshots": {k: v[0] for k, v in recorder.snapshots.items()},
        "gathers": [(e, layer, backward, q) for e, layer, backward, q in recorder.gathers],
        "sent": None if log is None else log.sent,
        "gathered_layers": gathered_layers(model) if fsdp else None,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, f8s.ConversionWarning)],
        "audit": (report.ok, report.recomputed, len(report.mismatches)),
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
    results = {"sharded": _train(rank, device, fsdp=True)}
    if rank == 0:  # the single-process run: the same model and data
        results["single"] = _train(rank, device, fsdp=False)
    results["cuda_kernels"] = device_type == "cuda" and f8s.ops.cuda.is_loaded()
    save_rank_results(out, rank, results)


def run_pair(out, device_type: str = "cpu", timeout: float = 300) -> list[dict]:
    """Both runs in two spawned ranks (gloo on the CPU, NCCL on two GPUs); what each saw."""
    return spawn_pair_results(_worker, out, device_type, timeout)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(tmp_path_factory.mktemp("fsdp_blockwise"))


def _equal_trees(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def test_sharded_run_trains_bitwise_as_the_single_process(ranks):
    """Losses, every parameter's gradient and the parameters after every step, an evaluation
    forward after training, and the weight codes and block scales every call consumed (forward,
    recompute, evaluation; fc1's from the FP8 gather): bitwise the single-process fp8_blockwise
    run's, on both ranks."""
    ref = ranks[0]["single"]
    for d in ranks:
        run = d["sharded"]
        assert all(bitwise_equal(a, b) for a, b in zip(run["losses"], ref["losses"], strict=True))
        assert all(_equal_trees(a, b) for a, b in zip(run["grads"], ref["grads"], strict=True))
        assert all(_equal_trees(a, b) for a, b in zip(run["full_before"], ref["full_before"], strict=True))
        assert _equal_trees(run["full_after"], ref["full_after"])
        assert bitwise_equal(run["evaluated"], ref["evaluated"])
        # forward and recompute of every call, and the evaluation's (no event)
        assert run["weights"].keys() == ref["weights"].keys() and len(ref["weights"]) == N_EVENTS * 3 * 2 + 3
        for key, codes in ref["weights"].items():
            assert bitwise_equal(run["weights"][key], codes), key
            assert bitwise_equal(run["snapshots"][key], ref["snapshots"][key]), key
        ok, recomputed, mismatches = run["audit"]
        assert ok and mismatches == 0 and recomputed == N_EVENTS * 3, run["audit"]


def test_aligned_shards_send_fp8_codes_with_their_block_scales(ranks):
    """fc1 (256 rows a rank) sends 1 byte an element and its [2, 3, 4] float32 block scales,
    descales and amaxes, in the forward and the backward's re-gather; the re-gather's shard codes
    are the forward's, which are the shard's rows of the full weight's block encode."""
    for r, d in enumerate(ranks):
        run = d["sharded"]
        sent = run["sent"]["fc1"]
        assert len(sent) == 2 * N_EVENTS + 1  # forward and backward of each event, the evaluation
        assert all(row == [(torch.uint8, (256, 512), 256 * 512), (torch.float32, (2, 3, 4), 96)] for row in sent)
        gathers = [(e, backward, q) for e, layer, backward, q in run["gathers"] if layer == "fc1"]
        assert {layer for _, layer, _, _ in run["gathers"]} == {"fc1"} and len(gathers) == 2 * N_EVENTS + 1
        forward = {e: q for e, backward, q in gathers if not backward}
        for e, _, q in gathers:
            if e is None:  # the evaluation's: checked against the single process in the test above
                continue
            assert q.dtype == torch.float8_e4m3fn and bitwise_equal(q, forward[e])
            full_codes = run["weights"][(e, "fc1", "FORWARD")]
            assert bitwise_equal(q, full_codes[r * 256 : (r + 1) * 256]), (r, e)
        assert run["gathered_layers"] == ["fc1"]


def test_unaligned_shards_gather_in_high_precision_and_say_so_once(ranks):
    """fc2 (96 rows a rank) and fc3 (66 and 65 rows) send their float32 rows (fc3 padded to 66)
    and are warned about once each, naming the layer, the shards' rows and the 128 rule."""
    for d in ranks:
        run = d["sharded"]
        for layer, rows, width in (("fc2", 96, 512), ("fc3", 66, 192)):
            sent = run["sent"][layer]
            assert len(sent) == 2 * N_EVENTS + 1
            assert all(row == [(torch.float32, (rows, width), rows * width * 4)] for row in sent), layer
        warned = run["warnings"]
        assert len(warned) == 2, warned
        fc2, fc3 = sorted(warned)
        assert "'fc2'" in fc2 and "[96, 96]" in fc2 and "multiple of 128" in fc2 and "high precision" in fc2
        assert "'fc3'" in fc3 and "[66, 65]" in fc3 and "multiple of 128" in fc3
        assert ranks[0]["single"]["warnings"] == []
