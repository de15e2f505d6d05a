"""The telemetry's non-finite guard under FSDP2 (two gloo ranks): with a fused AdamW over DTensor
shards the step is skipped on the device (``found_inf``), as for plain parameters, so the
Lightning loop under ``fp8state_fsdp`` needs no host sync per step (it synchronized twice a step
before: the guard's decision and the shard mask of the gradient norms, on the H200)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from lightning_fp8state.telemetry import read_jsonl
from tests.distributed.spawn import save_rank_results, spawn_pair_results

STEPS, BAD = 6, 3


def _worker(rank: int, port: int, out: str, device_type: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from lightning_fp8state.telemetry import (
        TrainingTelemetry,  # noqa: PLC0415
        metrics,  # noqa: PLC0415
    )
    from lightning_fp8state.telemetry.tracker import skips_on_device  # noqa: PLC0415
    from tests.telemetry.helpers import TinyNet, regression_batches  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TinyNet()
    for layer in model.children():
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    tel = TrainingTelemetry(os.path.join(out, f"tel{rank}"), model=model, log_every=STEPS, write=rank == 0)
    params = list(model.parameters())
    results: dict = {"device_skip": skips_on_device(opt, params), "applies": [], "unchanged": None}
    masks = []
    for step, (x, y) in enumerate(regression_batches(STEPS, seed=rank)):
        (model(x) - y).pow(2).mean().backward()
        if step == BAD and rank == 0:
            params[0].grad.to_local().view(-1)[0] = float("nan")  # one element of one shard
        if step == BAD:
            before = [p.detach().full_tensor().clone() for p in params]
            moments = [opt.state[p]["exp_avg"].full_tensor().clone() for p in params]
        results["applies"].append(tel.before_optimizer_step(opt, loss=None, tokens=8))
        masks.append(metrics._SHARD_MASKS.copy())
        opt.step()
        if step == BAD:
            after = [p.detach().full_tensor() for p in params]
            moments_after = [opt.state[p]["exp_avg"].full_tensor() for p in params]
            results["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True)) and all(
                torch.equal(a, b) for a, b in zip(moments, moments_after, strict=True)
            )
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    results["counts"] = (tel.attempted, tel.applied, tel.skipped)
    results["changed_later"] = not all(
        torch.equal(a, p.detach().full_tensor()) for a, p in zip(before, params, strict=True)
    )
    # the shard mask was built at the first step and reused (no host-to-device copy per step)
    results["one_mask"] = all(m.keys() == masks[0].keys() and all(m[k] is masks[0][k] for k in m) for m in masks)
    save_rank_results(out, rank, results)


def test_fused_adamw_over_fsdp2_shards_skips_a_nonfinite_step_on_the_device(tmp_path):
    for r in spawn_pair_results(_worker, tmp_path):
        assert r["device_skip"] is True
        # the decision is the device's: before_optimizer_step returns True on every step
        assert r["applies"] == [True] * STEPS
        assert r["unchanged"] is True  # the flagged step left parameters and moments alone, on both ranks
        assert r["changed_later"] is True  # and the later steps applied
        assert r["counts"] == (STEPS, STEPS - 1, 1)
        assert r["one_mask"] is True
    rows = read_jsonl(tmp_path / "tel0" / "telemetry.jsonl")
    assert [row["train/skipped"] for row in rows] == [0.0] * BAD + [1.0] + [0.0] * (STEPS - BAD - 1)
    assert torch.tensor([row["train/grad_finite"] for row in rows]).eq(0).nonzero().flatten().tolist() == [BAD]


def _clip_worker(rank: int, port: int, out: str, device_type: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from lightning_fp8state.telemetry import TrainingTelemetry  # noqa: PLC0415
    from tests.telemetry.helpers import TinyNet, regression_batches  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for algo in ("norm", "value"):
        torch.manual_seed(0)
        model = TinyNet()
        for layer in model.children():
            fully_shard(layer)
        fully_shard(model)
        params = list(model.parameters())
        x, y = regression_batches(1, seed=rank)[0]
        (model(x) - y).pow(2).mean().backward()
        pre = [p.grad.detach().clone() for p in params]  # DTensors, before any clip
        raw = [g.to_local().clone() for g in pre]
        limit = 0.05  # below the norm and the largest element: both clips act
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        tel = TrainingTelemetry(
            os.path.join(out, f"clip{rank}{algo}"), model=model, log_every=1, write=False,
            max_grad_norm=limit, clip_algorithm=algo,
        )  # fmt: skip
        seen = []
        name = "_foreach_mul_" if algo == "norm" else "_foreach_clamp_min_"
        real = getattr(torch, name)

        def recording(tensors, *a, real=real, seen=seen, **k):
            seen.append(sorted({type(t).__name__ for t in tensors}))
            return real(tensors, *a, **k)

        setattr(torch, name, recording)
        try:
            tel.before_optimizer_step(opt, loss=None, tokens=8)
        finally:
            setattr(torch, name, real)
        norm = tel._pending.device["train/grad_norm"].float()  # the norm the telemetry clipped with
        tel.close()
        # the peer: torch's own clip of the DTensor gradients, through DTensor's dispatch
        holders = [SimpleNamespace(grad=g) for g in pre]  # what torch's clips read of a parameter
        if algo == "norm":
            torch.nn.utils.clip_grads_with_norm_(holders, limit, norm)
        else:
            torch.nn.utils.clip_grad_value_(holders, limit)
        results[algo] = {
            "equal": all(torch.equal(p.grad.to_local(), g.to_local()) for p, g in zip(params, pre, strict=True)),
            "acted": any(not torch.equal(p.grad.to_local(), r) for p, r in zip(params, raw, strict=True)),
            "seen": seen,
        }
    save_rank_results(out, rank, results)


def test_the_telemetry_clips_fsdp2_gradients_on_their_local_shards_bitwise_torchs_clip(tmp_path):
    """Clipping DTensor gradients through DTensor's dispatch placed the scalar coefficient on
    the mesh once per tensor, every step; the telemetry clips the local shards with torch's own
    functions: bitwise torch's clip of the DTensors (norm and value), on both ranks."""
    for r in spawn_pair_results(_clip_worker, tmp_path):
        for algo in ("norm", "value"):
            assert r[algo]["acted"] is True, algo  # the limit is below the norm and the largest element
            assert r[algo]["equal"] is True, algo
            assert r[algo]["seen"] == [["Tensor"]], (algo, r[algo]["seen"])  # the local tensors, one call
