"""GraphedBlocks over FSDP2 layouts other than "each block a unit", on one gloo rank with the
graphs emulated (tests/graph_emulation.py): a unit whose MixedPrecisionPolicy casts its inputs
(the capture must see what FSDP2's pre-forward hands the block), blocks whose parameters an
outer unit gathers (the graphs would read freed memory: refused at the first replay), and a unit
inside a block (refused at the capture)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.spawn import spawn

EVENTS, WARMUP, D = 6, 2, 16


def _train(layout: str, graphed: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    import lightning_fp8state as f8s  # noqa: PLC0415
    from lightning_fp8state.graphs import GraphedBlocks  # noqa: PLC0415
    from tests.unit.test_block_graphs import Net, inputs  # noqa: PLC0415

    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(Net())
    if layout == "cast_inputs":  # every block a unit computing in bf16, fed float32 activations
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
    elif layout == "unit_hook":  # a hook of the user's on a unit (FSDP2's own are not named)
        for block in model.blocks:
            fully_shard(block)
            block.register_forward_pre_hook(_observe)
    elif layout == "fp8_gather":  # every block a unit, its weights gathered as FP8 codes
        from lightning_fp8state.nn.fsdp import enable_fp8_all_gather  # noqa: PLC0415

        enable_fp8_all_gather(model)
        for block in model.blocks:
            fully_shard(block)
    elif layout == "inner_units":
        for block in model.blocks:
            fully_shard(block.fc1)
    fully_shard(model)  # "outer_unit": the root alone gathers the blocks' parameters
    if graphed:
        from tests.graph_emulation import EmulatedGraphBackend  # noqa: PLC0415

        model.runner = GraphedBlocks(model.blocks, warmup=WARMUP, backend=EmulatedGraphBackend())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for i, x in enumerate(inputs(EVENTS)):
        with state.step(i):
            y = model(x)
            y.float().pow(2).mean().backward()
        outs.append(y.detach().float().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    if graphed:  # the units' static parameters: one set for the blocks of one layout
        first, *rest = model.runner.graphs
        weights["shared"] = torch.tensor(
            [all(g.aliases[n] is first.aliases[n] for n in first.aliases) for g in rest], dtype=torch.bool
        )
    return outs, weights


def _observe(module, args):
    return None


def _worker(rank: int, port: int, out: str, layout: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    import warnings  # noqa: PLC0415

    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if layout in ("cast_inputs", "fp8_gather"):
                result["eager"] = _train(layout, graphed=False)
            if layout == "fp8_gather":  # the dtypes of each batched copy of the static parameters
                from lightning_fp8state.graphs.replay import _BlockGraphs  # noqa: PLC0415

                copies, foreach_copy, load_params = [], torch._foreach_copy_, _BlockGraphs.load_params
                refreshing = [False]

                def recorded(dst, src, *a, **k):
                    if refreshing[0]:  # only the refresh's copies (the gradients' have their own)
                        copies.append(sorted({str(t.dtype) for t in src}))
                    return foreach_copy(dst, src, *a, **k)

                def watched(self, live):
                    refreshing[0] = True
                    try:
                        return load_params(self, live)
                    finally:
                        refreshing[0] = False

                torch._foreach_copy_, _BlockGraphs.load_params = recorded, watched
                try:
                    result["graphed"] = _train(layout, graphed=True)
                finally:
                    torch._foreach_copy_, _BlockGraphs.load_params = foreach_copy, load_params
                result["copies"] = copies
            else:
                result["graphed"] = _train(layout, graphed=True)
        except Exception as exc:  # noqa: BLE001  (the refusals are the result)
            result["error"] = (type(exc).__name__, str(exc))
    result["warnings"] = [str(w.message) for w in caught if "GraphedBlocks" in str(w.message)]
    torch.save(result, os.path.join(out, "result.pt"))
    dist.destroy_process_group()


def _run(tmp_path, layout: str) -> dict:
    spawn(_worker, (str(tmp_path), layout), nprocs=1, what="gloo worker")
    return torch.load(tmp_path / "result.pt", weights_only=False)


def test_a_unit_that_casts_its_inputs_is_captured_with_the_cast_input(tmp_path):
    r = _run(tmp_path, "cast_inputs")
    assert "error" not in r, r.get("error")
    (eager_out, eager_w), (graphed_out, graphed_w) = r["eager"], r["graphed"]
    assert all(torch.isfinite(y).all() for y in eager_out)
    for a, b in zip(eager_out, graphed_out, strict=True):
        assert torch.equal(a, b)
    assert graphed_w.pop("shared").all()
    assert r["warnings"] == []  # FSDP2's own hooks are not the user's
    for k in eager_w:
        assert torch.equal(eager_w[k], graphed_w[k]), k


def test_fp8_gathered_static_parameters_are_refreshed_one_dtype_per_copy(tmp_path):
    """Before each replay the unit's gathered parameters are copied into the graphs' static ones:
    FP8 codes (uint8), their snapshot's scales and the float32 biases and norms. torch's foreach
    copy takes its one-kernel route only when its sources share a dtype (a mixed list is copied
    tensor by tensor: 0.23 ms a call on the H200), so the refresh makes one batched copy per
    dtype. Trained bitwise like the eager FP8-gathered run."""
    r = _run(tmp_path, "fp8_gather")
    assert "error" not in r, r.get("error")
    (eager_out, eager_w), (graphed_out, graphed_w) = r["eager"], r["graphed"]
    for a, b in zip(eager_out, graphed_out, strict=True):
        assert torch.equal(a, b)
    graphed_w.pop("shared")  # an FP8-gathered weight keeps a static alias of its own (its layer's snapshot)
    for k in eager_w:
        assert torch.equal(eager_w[k], graphed_w[k]), k
    copies = r["copies"]
    assert copies and all(len(dtypes) == 1 for dtypes in copies), copies
    assert ["torch.uint8"] in copies and ["torch.float32"] in copies, copies  # both kinds were refreshed


@pytest.mark.parametrize(
    ("layout", "kind", "says"),
    [
        ("outer_unit", "StateTransitionError", r"moved since the capture"),
        ("inner_units", "ConfigError", r"Block\.fc1 is an FSDP2 unit inside a graphed block"),
    ],
)
def test_layouts_the_graphs_cannot_hold_are_refused_by_name(tmp_path, layout, kind, says):
    import re  # noqa: PLC0415

    r = _run(tmp_path, layout)
    assert "error" in r, "expected a refusal"
    assert r["error"][0] == kind and re.search(says, r["error"][1]), r["error"]


def test_a_forward_hook_of_the_users_on_a_unit_is_named_in_a_warning(tmp_path):
    r = _run(tmp_path, "unit_hook")
    assert "error" not in r, r.get("error")
    assert r["warnings"] and all("_observe" in w and "forward hooks of its own" in w for w in r["warnings"])
