"""The optimizer step on the local shards of FSDP2 parameters (``nn.fsdp.step_on_local_shards``),
two gloo ranks: every step bitwise the same optimizer stepping through DTensor's dispatch (the
FP8-gathered weights' wrapper included), for fused and foreach AdamW and Adam, with a device-side
skip (``found_inf``); the state dict stays DTensors; other optimizers are left alone."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import lightning_fp8state as f8s
from lightning_fp8state.nn.fsdp import Fp8ShardedWeight, enable_fp8_all_gather, step_on_local_shards
from tests.conftest import bitwise_equal, event_inputs, make_stack
from tests.distributed.spawn import save_rank_results, spawn_pair_results

D, STEPS, BAD = 16, 5, 3
VARIANTS = {  # name: (optimizer class, its keyword arguments)
    "adamw_fused": (torch.optim.AdamW, {"fused": True, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"foreach": True, "weight_decay": 0.1}),
    "adam_fused_amsgrad": (torch.optim.Adam, {"fused": True, "amsgrad": True}),
}


def _recording_adam():
    """Wrap torch's functional ``adam`` (Adam's and AdamW's step both call it): the type of the
    tensors each step hands it, so a test sees which path ran."""
    import torch.optim.adam as adam_module  # noqa: PLC0415

    seen: list[str] = []
    real = adam_module.adam

    def adam(params, *args, **kwargs):
        seen.append(type(params[0]).__name__)
        return real(params, *args, **kwargs)

    adam_module.adam = adam
    return seen, lambda: setattr(adam_module, "adam", real)


def _run(rank: int, cls, kwargs: dict, local: bool, compiled: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    state = f8s.Fp8State(f8s.QuantConfig(), rank=rank)
    model = state.convert(make_stack(n=2, d=D, seed=0, ckpt=("torch", False)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    enable_fp8_all_gather(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state.enable_amax_reduction(group=mesh.get_group())
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    applied = step_on_local_shards(opt) if local else None
    params = list(model.parameters())
    wrapped = sum(isinstance(p.to_local(), Fp8ShardedWeight) for p in params)
    found_inf = torch.zeros(())
    step = opt.step
    if compiled:  # the step traced by dynamo (eager backend): the DTensor lists, every step's gradients
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="eager")
    seen, restore = _recording_adam()
    for i, x in enumerate(event_inputs(STEPS, d=D, seed=11 + rank)):
        with state.step(i):
            loss = model(x).float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        if kwargs.get("fused"):  # the device-side skip the telemetry's guard hands a fused optimizer
            found_inf.fill_(1.0 if i == BAD else 0.0)
            opt.found_inf = found_inf
        step()
        opt.zero_grad(set_to_none=True)
    restore()
    sd = opt.state_dict()["state"]
    return {
        "seen": seen,
        "applied": applied,
        "wrapped": wrapped,
        "params": [
            p.detach().to_local().clone()
            if not isinstance(p.to_local(), Fp8ShardedWeight)
            else p.to_local()._tensor.clone()
            for p in params
        ],
        "states": [
            {k: (v.to_local().clone() if hasattr(v, "to_local") else v.clone()) for k, v in s.items()}
            for s in (opt.state[p] for p in params)
        ],
        "state_kinds": sorted({type(v).__name__ for s in sd.values() for k, v in s.items() if k != "step"}),
        "state_keys": len(opt.state),
    }


def _worker(rank: int, port: int, out: str, device_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for name, (cls, kwargs) in VARIANTS.items():
        torch.manual_seed(0)
        results[name] = (_run(rank, cls, kwargs, local=False), _run(rank, cls, kwargs, local=True))
    cls, kwargs = VARIANTS["adamw_foreach"]
    results["compiled"] = (
        _run(rank, cls, kwargs, local=False, compiled=True),
        _run(rank, cls, kwargs, local=True, compiled=True),
    )
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    results["sgd"] = step_on_local_shards(sgd)  # stores momentum back by parameter: left alone
    results["kept"] = _kept_lists()
    save_rank_results(out, rank, results)


def _kept_lists() -> dict:
    """What ``_init_group`` hands the step where the local update would not be DTensor's."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import DTensor, Partial, Shard  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for case in ("sharded", "partial_grad", "differentiable"):
        p = torch.nn.Parameter(DTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)]))
        if case == "partial_grad":  # each rank's full-size addend: DTensor would sum them first
            p.grad = DTensor.from_local(torch.randn(6, 4), mesh, [Partial()])
        else:
            p.grad = DTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)])
        opt = torch.optim.AdamW([p], lr=0.1, differentiable=case == "differentiable")
        step_on_local_shards(opt)
        lists: tuple = ([], [], [], [], [], [])
        opt._init_group(opt.param_groups[0], *lists)
        out[case] = type(lists[0][0]).__name__, type(lists[1][0]).__name__
    return out


def test_the_step_on_local_shards_is_bitwise_the_dtensor_step(tmp_path):
    for r in spawn_pair_results(_worker, tmp_path):
        assert r["sgd"] is False
        # the local shards reach the step only where DTensor would update them as they are
        assert r["kept"] == {
            "sharded": ("Tensor", "Tensor"),
            "partial_grad": ("DTensor", "DTensor"),  # DTensor would reduce the gradient first
            "differentiable": ("DTensor", "DTensor"),  # autograd through the update needs them
        }
        # traced by dynamo: the DTensor lists (local tensors would be constants of the graph)
        ref, local = r["compiled"]
        assert ref["seen"] == local["seen"] == ["DTensor"] * STEPS
        for i, (a, b) in enumerate(zip(ref["params"], local["params"], strict=True)):
            assert bitwise_equal(a, b), ("compiled", i)
        for name in VARIANTS:
            ref, local = r[name]
            assert local["applied"] is True, name
            assert ref["seen"] == ["DTensor"] * STEPS and local["seen"] == ["Tensor"] * STEPS, name
            assert ref["wrapped"] == local["wrapped"] == 4  # the FP8-gathered weights' wrapper is in the path
            assert ref["state_keys"] == local["state_keys"] == len(ref["params"])  # no state keyed by a shard
            assert ref["state_kinds"] == local["state_kinds"] == ["DTensor"], name  # the state dict unchanged
            for i, (a, b) in enumerate(zip(ref["params"], local["params"], strict=True)):
                assert bitwise_equal(a, b), (name, i)
            for i, (a, b) in enumerate(zip(ref["states"], local["states"], strict=True)):
                assert a.keys() == b.keys(), (name, i)
                for k in a:
                    assert bitwise_equal(a[k], b[k]), (name, i, k)
            # fused: the flagged step was skipped (both runs), and the others applied: the step count
            steps = {float(s["step"]) for s in local["states"]}
            assert steps == {STEPS - 1.0 if "fused" in name else float(STEPS)}, (name, steps)


def test_fsdp2_reads_the_fp8_pre_all_gather_signature_without_rebuilding_it(monkeypatch):
    """FSDP2 calls ``inspect.signature`` on the hook before every gather: the signature kept on
    the function is served as it is (rebuilding it from the code was ~13 us a gather)."""
    import inspect  # noqa: PLC0415

    w = Fp8ShardedWeight(torch.ones(2, 2))

    def rebuilt(*args, **kwargs):
        raise AssertionError("the signature was rebuilt from the function's code")

    monkeypatch.setattr(inspect, "_signature_from_function", rebuilt)
    sig = inspect.signature(w.fsdp_pre_all_gather)
    # FSDP2 takes the five-argument form by this count
    assert list(sig.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
