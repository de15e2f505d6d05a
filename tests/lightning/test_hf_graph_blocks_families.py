"""graph_decoder_layers on tiny transformers Qwen2 and Mistral models whose decoder layers are
FSDP2 units computing in bf16 (a MixedPrecisionPolicy that casts the layers' inputs: the hidden
state coming from the float32 embedding, the rotary cos/sin, the mask), on one gloo rank with
the graphs emulated (tests/graph_emulation.py). Each layer is captured inside its unit's call,
from transformers' own loop, with its inputs as the hook cast them: losses, gradients and
scales bitwise the eager run with the layers checkpointed, one commit per owner per event."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import bitwise_equal
from tests.distributed.spawn import spawn

pytest.importorskip("transformers")

EVENTS, WARMUP = 4, 2
FAMILIES = ("qwen2", "mistral")


def _model(family: str):
    import transformers  # noqa: PLC0415

    from tests.unit.test_hf_decoder_graphs import VOCAB  # noqa: PLC0415

    torch.manual_seed(0)
    kinds = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_class, model_class = kinds[family]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",  # the mask reaches the layers as a tensor
    )
    return model_class(config)


def _train(family: str, graphed: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    import lightning_fp8state as f8s  # noqa: PLC0415
    from lightning_fp8state.graphs import graph_decoder_layers  # noqa: PLC0415
    from tests.graph_emulation import EmulatedGraphBackend  # noqa: PLC0415
    from tests.unit.test_hf_decoder_graphs import batches, checkpoint_layers  # noqa: PLC0415

    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(_model(family))
    model.train()
    if not graphed:
        checkpoint_layers(model)  # inside each unit's call, as the graphed runner's checkpoint
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model)
    runner = graph_decoder_layers(model, warmup=WARMUP, backend=EmulatedGraphBackend()) if graphed else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for i, ids in enumerate(batches(EVENTS)):
        with state.step(i):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            state.commit_forward()
            loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "grads": grads,
        "scales": state.bank.scales.clone(),
        "commits": sorted({r.commits for e in state.ledger.events() for r in state.ledger.event(e).values()}),
        "ok": state.ledger.ok,
        "replays": None if runner is None else runner.replays,
        "unit_copies": None if runner is None else all(g.copy_params for g in runner.graphs),
        # what the graphs read: the hidden state and the side inputs as the units' hooks cast them
        "static_dtypes": None
        if runner is None
        else sorted(
            {str(g.static_in.dtype) for g in runner.graphs}
            | {str(s.buffer.dtype) for g in runner.graphs for s in g.sides if s.buffer.is_floating_point()}
        ),
        "n_sides": None if runner is None else [len(g.sides) for g in runner.graphs],
    }


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    results = {}
    for family in FAMILIES:
        for graphed in (False, True):
            try:
                results[family, graphed] = _train(family, graphed)
            except Exception as exc:  # noqa: BLE001  (reported by the test)
                results[family, graphed] = {"error": (type(exc).__name__, str(exc))}
    torch.save(results, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_families_fsdp")
    spawn(_worker, (str(out),), nprocs=1, what="gloo worker")
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_decoder_layers_of_fsdp2_units_train_bitwise_the_eager_run(results, family):
    eager, graphed = results[family, False], results[family, True]
    assert "error" not in eager, eager.get("error")
    assert "error" not in graphed, graphed.get("error")
    assert graphed["replays"] == EVENTS - WARMUP and graphed["unit_copies"]
    # captured inside the units' calls: the float32 hidden state, cos and sin as their hooks cast them
    assert graphed["static_dtypes"] == ["torch.bfloat16"]
    assert not bitwise_equal(eager["losses"][0], eager["losses"][-1])  # the weights moved
    for i, (a, b) in enumerate(zip(eager["losses"], graphed["losses"], strict=True)):
        assert bitwise_equal(a, b), f"event {i}: loss differs ({a.item()} vs {b.item()})"
    for i, (ga, gb) in enumerate(zip(eager["grads"], graphed["grads"], strict=True)):
        assert set(ga) == set(gb) and any(".layers." in n for n in ga)
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {i}: grad of {name} differs"
    assert bitwise_equal(eager["scales"], graphed["scales"])
    assert graphed["ok"] and graphed["commits"] == [1]
