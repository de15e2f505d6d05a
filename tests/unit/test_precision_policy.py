"""quant.policy: selected layers kept in high precision by block position and by GEMM size, each
reported with its rule; the GEMM table and its interpolation; the rule of thumb without a
measurement; the config's checks and its CLI keys."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.config import PrecisionPolicy, QuantConfig
from lightning_fp8state.errors import ConfigError, ConversionWarning
from lightning_fp8state.models import GPT, GPTConfig, Llama, LlamaConfig
from lightning_fp8state.nn import Fp8Linear, policy

FAKE_GPU = "Fake GPU 80GB"


def convert(model, **policy_keys):
    state = f8s.Fp8State(QuantConfig(policy=policy_keys))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)  # a model whose every layer is kept converts nothing
        state.convert(model)
    return state, state.last_conversion


def kinds(model, names):
    return {n: type(model.get_submodule(n)) for n in names}


def test_keep_last_keeps_the_last_blocks_of_a_gpt_in_high_precision():
    model = GPT(GPTConfig(n_layers=4, checkpoint=False))
    _, report = convert(model, keep_last=2)
    layers = ("qkv", "proj", "fc", "out")
    kept = [f"blocks.{i}.{n}" for i in (2, 3) for n in layers]
    assert set(kinds(model, kept).values()) == {nn.Linear}
    assert set(kinds(model, [f"blocks.{i}.{n}" for i in (0, 1) for n in layers] + ["head"]).values()) == {Fp8Linear}
    assert sorted(report.skipped) == sorted(kept)
    assert report.skipped["blocks.3.fc"] == (
        "kept in high precision by quant.policy (position): blocks.3 is among the last 2 block(s) (keep_last=2)"
    )
    assert "skipped 8 (8 kept by quant.policy)" in report.summary()
    assert report.counts()["kept by quant.policy"] == 8


def test_keep_first_and_a_fraction_on_a_llama():
    model = Llama(LlamaConfig(n_layers=4))
    _, report = convert(model, keep_first=1, keep_last_fraction=0.25)
    kept = {n for n in report.skipped}
    assert {n.split(".")[1] for n in kept} == {"0", "3"} and len(kept) == 14
    assert all(
        isinstance(model.get_submodule(n), nn.Linear) and not isinstance(model.get_submodule(n), Fp8Linear)
        for n in kept
    )
    assert isinstance(model.layers[1].mlp.down_proj, Fp8Linear) and isinstance(model.lm_head, Fp8Linear)
    assert "first 1 block(s) (keep_first=1)" in report.skipped["layers.0.mlp.up_proj"]
    assert "last 1 of 4 blocks (keep_last_fraction=0.25)" in report.skipped["layers.3.self_attn.q_proj"]


def test_a_fraction_rounds_up_to_whole_blocks():
    model = GPT(GPTConfig(n_layers=6, checkpoint=False))
    _, report = convert(model, keep_last_fraction=0.25)  # 1.5 blocks: the last 2
    assert {n.split(".")[1] for n in report.skipped} == {"4", "5"}


def test_keep_last_on_a_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    _, report = convert(model, keep_last=1)
    assert sorted(report.skipped) == sorted(
        f"model.layers.2.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )  # fmt: skip
    assert "model.layers.2 is among the last 1 block(s)" in report.skipped["model.layers.2.mlp.down_proj"]
    assert type(model.model.layers[2].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear) and isinstance(model.lm_head, Fp8Linear)


def test_a_position_rule_without_a_block_list_is_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="keeps blocks by position, but Sequential has no block list"):
        convert(model, keep_last=1)
    assert type(model[0]) is nn.Linear  # refused before anything was swapped


def test_the_block_list_is_the_outer_stack_not_an_expert_list_and_ties_are_refused():
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 4)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(8))

    model = nn.Module()
    model.stack = nn.ModuleList(Block() for _ in range(3))
    assert policy.find_blocks(model)[0] == "stack"
    model.other = nn.ModuleList(Block() for _ in range(3))
    with pytest.raises(ConfigError, match=r"policy.blocks=''.*\['stack', 'other'\]"):
        policy.find_blocks(model)
    assert policy.find_blocks(model, "other")[0] == "other"


def write_table(path, device, shapes):
    path.write_text(
        json.dumps({"format": policy.GEMM_TABLE_FORMAT, "version": 1, "devices": {device: {"shapes": shapes}}})
    )
    return path


def three_gemms(tokens, k, n, bf16_ms, fp8_ms, cast_ms=0.0):
    """The forward, input-gradient and weight-gradient GEMMs of a k -> n Linear, each measured."""
    shapes = ((tokens, n, k), (tokens, k, n), (n, k, tokens))
    return [dict(m=m, n=nn_, k=kk, bf16_ms=bf16_ms, fp8_ms=fp8_ms, cast_ms=cast_ms) for m, nn_, kk in shapes]


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(policy, "DEVICE_NAME", lambda: FAKE_GPU)


def test_the_size_rule_keeps_what_the_device_table_predicts_to_lose(tmp_path, fake_gpu):
    # small: every GEMM 1 ms in bf16, 2 ms in FP8 -> gain 0.5; large: 3 ms vs 1 + 0.5 (casts) -> gain 2
    shapes = three_gemms(256, 64, 64, 1.0, 2.0) + three_gemms(256, 64, 512, 3.0, 1.0, 0.5)
    table = write_table(tmp_path / "table.json", FAKE_GPU, shapes)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 512))
    _, report = convert(model, by_size=str(table), tokens=256)
    assert type(model[0]) is nn.Linear and isinstance(model[1], Fp8Linear)
    assert report.skipped == {
        "0": f"kept in high precision by quant.policy (size): predicted FP8 gain 0.50x < min_gain 1.05 at 64x64 "
        f"(in x out), 256 tokens (GEMM table {table}, {FAKE_GPU})"
    }
    assert report.notes == [
        f"quant.policy.by_size: GEMM table {table} for {FAKE_GPU!r} at 256 tokens kept 1 of 2 layer(s) predicted "
        "to gain less than 1.05x"
    ]
    assert report.to_dict()["notes"] == report.notes and f"  note: {report.notes[0]}" in str(report)


def test_between_measured_shapes_the_gain_is_interpolated_in_log_space(tmp_path, fake_gpu):
    # 256^3 gains 0.25x, 1024^3 gains 4x; 512^3 is as far from each: the geometric mean, 1x
    shapes = [
        dict(m=256, n=256, k=256, bf16_ms=1.0, fp8_ms=4.0),
        dict(m=1024, n=1024, k=1024, bf16_ms=4.0, fp8_ms=1.0),
    ]
    table = write_table(tmp_path / "table.yaml", FAKE_GPU, shapes)
    measured = policy.read_gemm_table(table)[FAKE_GPU]
    assert policy.predicted_gain(measured, 512, 512, 512) == pytest.approx(1.0, rel=1e-12)
    assert policy.predicted_gain(measured, 256, 256, 256) == pytest.approx(0.25, rel=1e-12)
    model = nn.Sequential(nn.Linear(512, 512))
    _, report = convert(model, by_size=str(table), tokens=512, min_gain=0.95)
    assert isinstance(model[0], Fp8Linear) and not report.skipped
    model = nn.Sequential(nn.Linear(512, 512))
    _, report = convert(model, by_size=str(table), tokens=512, min_gain=1.05)
    assert "predicted FP8 gain 1.00x < min_gain 1.05" in report.skipped["0"]


def test_an_explicit_table_without_this_device_or_without_tokens_is_refused(tmp_path, fake_gpu):
    table = write_table(tmp_path / "t.json", "Another GPU", three_gemms(8, 8, 8, 1.0, 1.0))
    with pytest.raises(ConfigError, match=f"no measurement for device '{FAKE_GPU}' \\(it has \\['Another GPU'\\]\\)"):
        convert(nn.Sequential(nn.Linear(8, 8)), by_size=str(table), tokens=8)
    table = write_table(tmp_path / "u.json", FAKE_GPU, three_gemms(8, 8, 8, 1.0, 1.0))
    with pytest.raises(ConfigError, match="policy.tokens=0 is not allowed"):
        convert(nn.Sequential(nn.Linear(8, 8)), by_size=str(table))
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"format": policy.GEMM_TABLE_FORMAT, "version": 1, "devices": {FAKE_GPU: {"shapes": [{"m": 8}]}}})
    )
    with pytest.raises(ConfigError, match=r"shapes\[0\]\.n=None is not allowed: expected a positive integer"):
        policy.read_gemm_table(bad)


def meta_linears(*shapes):
    return {f"l{i}": nn.Linear(i_, o, device="meta") for i, (i_, o) in enumerate(shapes)}


def test_auto_without_a_measurement_uses_the_rule_of_thumb_and_says_so(tmp_path, monkeypatch, fake_gpu):
    monkeypatch.setattr(
        policy, "AUTO_TABLE", lambda: write_table(tmp_path / "t.yaml", "Another GPU", three_gemms(8, 8, 8, 1, 1))
    )
    candidates = meta_linears((1024, 4096), (4096, 1024), (2048, 4096), (8192, 8192))
    decision = policy.decide(nn.Module(), PrecisionPolicy(by_size="auto"), candidates, "fp8_delayed")
    assert sorted(decision.kept) == ["l0"]  # per tensor: out <= 4096 and in <= 1024
    assert "1024x4096 (in x out) is small for FP8 by the rule of thumb" in decision.kept["l0"]
    assert decision.notes == [
        f"quant.policy.by_size=auto: no GEMM measurement for device {FAKE_GPU!r} in {tmp_path / 't.yaml'}: the rule "
        "of thumb torchtitan uses kept the small layers (measure the device with benchmarks/gemm_table.py)"
    ]
    decision = policy.decide(nn.Module(), PrecisionPolicy(by_size="auto"), candidates, "fp8_rowwise")
    assert sorted(decision.kept) == ["l0", "l1", "l2"]  # row-wise: in <= 2048 | out <= 1024 | in <= 4096 & out <= 2048


def test_auto_reads_the_table_for_this_device_when_it_has_one(tmp_path, monkeypatch, fake_gpu):
    table = write_table(tmp_path / "t.json", FAKE_GPU, three_gemms(64, 1024, 4096, 1.0, 2.0))
    monkeypatch.setattr(policy, "AUTO_TABLE", lambda: table)
    decision = policy.decide(
        nn.Module(), PrecisionPolicy(by_size="auto", tokens=64), meta_linears((1024, 4096)), "fp8_delayed"
    )
    assert "predicted FP8 gain 0.50x < min_gain 1.05" in decision.kept["l0"]


def test_without_cuda_auto_keeps_nothing_by_size(monkeypatch):
    monkeypatch.setattr(policy, "DEVICE_NAME", lambda: None)
    decision = policy.decide(nn.Module(), PrecisionPolicy(by_size="auto"), meta_linears((64, 64)), "fp8_delayed")
    assert decision.kept == {}
    assert decision.notes == [
        "quant.policy.by_size=auto: no CUDA device, so no FP8 GEMM speed to compare: nothing kept by size"
    ]


def test_the_shipped_table_is_valid_and_holds_only_measured_entries():
    """Each device's entry as benchmarks/gemm_table.py writes it (never by hand): its torch, date
    and how the casts were timed, and the full grid of sizes it measured, every time positive."""
    import yaml

    tables = policy.read_gemm_table(policy.shipped_gemm_table())
    raw = yaml.safe_load(policy.shipped_gemm_table().read_text())["devices"]
    assert set(tables) == set(raw) and "NVIDIA H200" in tables
    for device, entry in raw.items():
        assert entry["torch"] and entry["measured"] and entry["casts"] == "fused quantize kernel", device
        sizes = sorted({r["m"] for r in entry["shapes"]})
        grid = {(r["m"], r["n"], r["k"]) for r in entry["shapes"]}
        assert grid == {(m, n, k) for m in sizes for n in sizes for k in sizes}, device
        assert all(r[key] > 0 for r in entry["shapes"] for key in ("bf16_ms", "fp8_ms", "cast_ms")), device


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"keep_last": -1}, r"policy.keep_last=-1 is not allowed: expected an integer >= 0"),
        ({"keep_first": 1.5}, r"policy.keep_first=1.5 is not allowed"),
        ({"keep_last_fraction": 1.5}, r"policy.keep_last_fraction=1.5 is not allowed: expected a finite number in \[0, 1\]"),
        ({"by_size": "atuo"}, r"policy.by_size='atuo' is not allowed: expected one of \['off', 'auto'\] or the path"),
        ({"min_gain": 0}, r"policy.min_gain=0 is not allowed: expected a finite number > 0"),
        ({"keep_lats": 1}, r"policy: unknown keys \['keep_lats'\]"),
    ],
)  # fmt: skip
def test_bad_policy_keys_are_refused_by_name(keys, message):
    with pytest.raises(ConfigError, match=message):
        QuantConfig(policy=keys)


def test_the_cli_keys_flow_into_the_policy():
    from lightning_fp8state.cli.config import load_config, quant_config

    cfg = load_config(None, ["quant.policy.keep_last=2", "quant.policy.by_size=off"])  # YAML reads `off` as false
    assert quant_config(cfg).policy == PrecisionPolicy(keep_last=2)
    cfg = load_config(None, ["quant.policy.by_size=auto", "data.batch_size=3", "model.seq_len=32"])
    assert quant_config(cfg).policy.tokens == 96  # the run's tokens per micro-batch
    with pytest.raises(ConfigError, match="quant.policy.keep_first=-1 is not allowed"):
        load_config(None, ["quant.policy.keep_first=-1"])
    with pytest.raises(ConfigError, match="unknown key .*quant.policy.keep_last"):
        load_config(None, ["quant.policy.keep_lst=1"])


def test_a_kept_layer_stays_linear_and_its_weight_trains_in_high_precision():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=2, checkpoint=False))
    state, _ = convert(model, keep_last=1)
    kept, converted = model.blocks[1].proj, model.blocks[0].proj
    assert type(kept) is nn.Linear and isinstance(converted, Fp8Linear)
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name, "x"] = args[0].detach()
            out.register_hook(lambda g: seen.__setitem__((name, "g"), g.detach()))

        return hook

    kept.register_forward_hook(record("kept"))
    converted.register_forward_hook(record("converted"))
    idx = torch.randint(0, 64, (2, 16))
    with state.step(0):
        model.loss(idx, idx).backward()
    for name, module in (("kept", kept), ("converted", converted)):
        x, g = seen[name, "x"].reshape(-1, 64), seen[name, "g"].reshape(-1, 64)
        exact = torch.allclose(module.weight.grad, g.T @ x, rtol=1e-5, atol=1e-7)
        assert exact == (name == "kept")  # the FP8 layer's gradient carries its quantization error
    owned = {o.layer for o in state._protocol.owners()}
    assert "blocks.0.proj" in owned and not any(layer.startswith("blocks.1.") for layer in owned)


def test_the_benchmark_writes_a_table_the_policy_reads(tmp_path, monkeypatch):
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    gemm_table = importlib.import_module("gemm_table")
    out = tmp_path / "tables.yaml"
    out.write_text((Path(policy.__file__).resolve().parents[2] / "configs/gemm/tables.yaml").read_text())
    rows = [dict(m=64, n=64, k=64, bf16_ms=1.0, fp8_ms=0.5, cast_ms=0.25)]
    gemm_table.write_table(out, "GPU A", rows)
    gemm_table.write_table(out, "GPU B", [dict(rows[0], fp8_ms=2.0)])
    gemm_table.write_table(out, "GPU A", [dict(rows[0], bf16_ms=3.0)])  # replaces A's entry, keeps B's
    table = policy.read_gemm_table(out)
    assert sorted(table) == ["GPU A", "GPU B", "NVIDIA H200"]  # the shipped entry kept
    assert table["GPU A"] == [policy.GemmMeasurement(64, 64, 64, 3.0, 0.5, 0.25)]
    assert policy.predicted_gain(table["GPU B"], 64, 64, 64) == pytest.approx(1.0 / 2.25)


def test_the_position_rule_keeps_attention_projections_and_expert_blocks_of_kept_blocks():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 3, enable_nested_tensor=False)
    _, report = convert(enc, keep_last=1)
    assert type(enc.layers[2].self_attn) is nn.MultiheadAttention and type(enc.layers[2].linear1) is nn.Linear
    assert isinstance(enc.layers[1].self_attn, f8s.nn.Fp8MultiheadAttention)
    assert {"layers.2.self_attn.in_proj", "layers.2.self_attn.out_proj"} <= set(report.skipped)
    assert "layers.2" not in report.rerouted and "layers.1" in report.rerouted
    moe = Llama(LlamaConfig(n_layers=2, moe_experts=4, moe_top_k=2))
    _, report = convert(moe, keep_last=1)
    assert type(moe.layers[1].mlp.experts) is f8s.nn.GroupedExperts
    assert isinstance(moe.layers[0].mlp.experts, f8s.nn.Fp8Experts)
    assert "layers.1 is among the last 1 block(s)" in report.skipped["layers.1.mlp.experts"]
