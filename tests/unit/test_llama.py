"""The Llama-family model and its Hugging Face loader (issue 43): the config's checks, logits
bitwise transformers' LlamaForCausalLM in float32 on the CPU (and in bfloat16/float16 loaded the
same way), the loader's refusals of folders it cannot trust or configs it cannot reproduce, and
FP8 training under activation checkpointing whose every recompute is bitwise its forward."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError, StateLoadError, UntrustedCheckpointError
from lightning_fp8state.models import Llama, LlamaConfig, llama_config_from_hf, load_hf_llama
from lightning_fp8state.models.llama import llama_ffn_hidden
from tests.conftest import bitwise_equal

TINY = dict(vocab_size=97, seq_len=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128)


# --- (a) the config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_heads=4, n_kv_heads=3), r"n_kv_heads=3 is not allowed: expected a divisor of n_heads=4"),
        (dict(n_kv_heads=0), r"n_kv_heads=0 is not allowed"),
        (dict(d_model=30, n_heads=4), r"d_model=30 is not allowed: expected a multiple of n_heads=4"),
        (dict(d_model=12, n_heads=4), r"d_model=12 is not allowed with n_heads=4: expected an even head size"),
        (dict(ffn_hidden=True), r"ffn_hidden=True is not allowed"),
        (dict(ffn_dim_multiplier=0), r"ffn_dim_multiplier=0 is not allowed"),
        (dict(multiple_of=0), r"multiple_of=0 is not allowed"),
        (dict(rope_theta=0), r"rope_theta=0 is not allowed"),
        (dict(norm_eps=float("nan")), r"norm_eps=nan is not allowed"),
        (dict(vocab_size=1), r"vocab_size=1 is not allowed"),
        (dict(tie_embeddings=1), r"tie_embeddings=1 is not allowed: expected true or false"),
        (dict(checkpoint_engine="jax"), r"checkpoint_engine='jax' is not allowed"),
        (dict(use_reentrant="no"), r"use_reentrant='no' is not allowed"),
    ],
)
def test_config_refuses_naming_the_key(kw, match):
    with pytest.raises(ConfigError, match=match):
        LlamaConfig(**kw)


def test_config_derives_the_kv_heads_and_the_swiglu_size_as_meta_does():
    cfg = LlamaConfig(d_model=4096, n_heads=32)
    assert cfg.n_kv_heads == 32 and cfg.head_dim == 128
    assert cfg.ffn_hidden == 11008  # Llama 2 7B
    assert LlamaConfig(d_model=4096, n_heads=32, multiple_of=1024, ffn_dim_multiplier=1.3).ffn_hidden == 14336
    assert llama_ffn_hidden(8192, 4096, 1.3) == 28672  # Llama 3 70B
    assert LlamaConfig(d_model=64, ffn_hidden=96).ffn_hidden == 96


def test_forward_refuses_more_positions_than_seq_len():
    model = Llama(LlamaConfig(**TINY))
    with pytest.raises(ConfigError, match=r"idx.shape\[1\]=33 is not allowed: expected an integer >= 1 and <= 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_module_names_are_transformers_and_the_rotary_tables_are_not_state():
    model = Llama(LlamaConfig(**TINY, tie_embeddings=True))
    names = set(model.state_dict())
    assert "layers.1.self_attn.q_proj.weight" in names and "layers.0.mlp.gate_proj.weight" in names
    assert "layers.0.input_layernorm.weight" in names and "norm.weight" in names
    assert not any("rotary" in n for n in names)
    assert not any("rotary" in n for n, _ in model.layers[0].named_modules())  # a reference, not a child
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.blocks is model.layers


# --- a checkpoint folder written by hand (the loader's refusals need no transformers) --------


def hf_config(cfg: LlamaConfig, **over) -> dict:
    """The config.json transformers 5 writes for ``cfg`` (with ``over`` laid on top)."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "max_position_embeddings": cfg.seq_len,
        "mlp_bias": False,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
        "dtype": "float32",
    }
    return out | over


def write_folder(path, *, tie=False, config=None, drop=(), add=None, seed=0):
    """A Hugging Face layout of a random :class:`Llama`: config.json and model.safetensors."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**TINY, tie_embeddings=tie))
    tensors = {
        (n if n == "lm_head.weight" else f"model.{n}"): t.detach().clone()
        for n, t in model.state_dict().items()
        if not (tie and n == "lm_head.weight")
    }
    for name in drop:
        del tensors[name]
    tensors |= add or {}
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(model.cfg) | (config or {})))
    return model


def edit_config(path, **over):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | over))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_folder_round_trips_bitwise(tmp_path, tie):
    model = write_folder(tmp_path, tie=tie)
    loaded, cfg = load_hf_llama(tmp_path)
    assert cfg.tie_embeddings is tie and (loaded.lm_head.weight is loaded.embed_tokens.weight) is tie
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert bitwise_equal(loaded(idx), model(idx))
    assert all(p.requires_grad and p.device.type == "cpu" for p in loaded.parameters())


def test_dtype_casts_the_weights(tmp_path):
    write_folder(tmp_path)
    loaded, _ = load_hf_llama(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded(torch.randint(0, 97, (1, 8))).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"dtype=torch.int8 is not allowed"):
        load_hf_llama(tmp_path, dtype=torch.int8)


def test_a_symbolic_link_in_the_folder_is_refused(tmp_path):
    folder, outside = tmp_path / "ckpt", tmp_path / "elsewhere"
    write_folder(folder)
    outside.mkdir()
    os.replace(folder / "model.safetensors", outside / "model.safetensors")
    os.symlink(outside / "model.safetensors", folder / "model.safetensors")
    with pytest.raises(UntrustedCheckpointError, match=r"model.safetensors.*a symbolic link"):
        load_hf_llama(folder)
    os.replace(folder / "config.json", outside / "config.json")
    os.symlink(outside / "config.json", folder / "config.json")
    with pytest.raises(UntrustedCheckpointError, match=r"config.json.*a symbolic link"):
        load_hf_llama(folder)


def test_a_missing_or_unexpected_tensor_is_named(tmp_path):
    write_folder(tmp_path, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(StateLoadError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight; nothing was loaded"):
        load_hf_llama(tmp_path)
    write_folder(tmp_path, add={"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(StateLoadError, match=r"unexpected model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf_llama(tmp_path)
    # old checkpoints stored the rotary frequencies: derived here, so ignored
    write_folder(tmp_path, add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    load_hf_llama(tmp_path)


def test_a_misshapen_tensor_is_named(tmp_path):
    write_folder(tmp_path, config={"intermediate_size": 96})
    with pytest.raises(StateLoadError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\]"):
        load_hf_llama(tmp_path)


def test_a_tied_checkpoint_holding_another_head_is_refused(tmp_path):
    write_folder(tmp_path, tie=True, add={"lm_head.weight": torch.zeros(97, 64)})
    with pytest.raises(StateLoadError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        load_hf_llama(tmp_path)


# Llama 3.1's rope scaling as its config.json holds it (a short original context: the tiny
# model's frequencies fall on all three sides of the blend)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None},
            r"rope_scaling of rope_type='llama3' lacks \['high_freq_factor', 'low_freq_factor', "
            r"'original_max_position_embeddings'\]",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": None},
            r"rope_scaling\.rope_type='dynamic' is not allowed",
        ),
        (
            {"rope_scaling": {"rope_type": "llama3", **LLAMA3}, "rope_parameters": {"rope_type": "default"}},
            r"rope_scaling and rope_parameters are both set",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", **LLAMA3, "high_freq_factor": 0.5}},
            r"rope_high_freq_factor=0.5 is not allowed: expected more than rope_low_freq_factor=1.0",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters\.rope_type='linear'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            r"rope_parameters keys \['partial_rotary_factor'\]",
        ),
        ({"attention_bias": True}, r"attention_bias=True is not allowed: expected one of \[False\]"),
        ({"mlp_bias": True}, r"mlp_bias=True is not allowed"),
        ({"model_type": "gpt2"}, r"model_type='gpt2' is not allowed: expected one of \['llama', 'mistral'\]"),
        ({"model_type": "mistral", "sliding_window": 4096}, r"sliding_window=4096 is not allowed"),
        ({"head_dim": 32}, r"head_dim=32 is not allowed: expected one of \[16\]"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not allowed"),
        (
            {"num_key_value_heads": 3},
            r"num_key_value_heads=3 is not allowed: expected a divisor of num_attention_heads=4",
        ),
        ({"hidden_size": "64"}, r"hidden_size='64' is not allowed"),
        ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings='yes' is not allowed"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_key(tmp_path, over, match):
    write_folder(tmp_path)
    edit_config(tmp_path, **over)
    with pytest.raises(ConfigError, match=match):
        load_hf_llama(tmp_path)


def test_config_keys_map_to_the_model_config():
    cfg = LlamaConfig(**TINY, rope_theta=500000.0, norm_eps=1e-5)
    hf = hf_config(cfg)
    assert llama_config_from_hf(hf) == cfg
    # transformers 4's keys: rope_theta beside a null rope_scaling; no head_dim, no kv heads
    old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "head_dim", "num_key_value_heads")}
    assert llama_config_from_hf(old | {"rope_theta": 500000.0, "rope_scaling": None}).n_kv_heads == 4
    mistral = llama_config_from_hf(hf | {"model_type": "mistral", "sliding_window": None})
    assert mistral == cfg
    # Llama 3.1's scaling, as transformers 5 (rope_parameters) and 4 (rope_scaling, "type") write it
    scaled = LlamaConfig(**TINY, rope_theta=500000.0, norm_eps=1e-5, rope_type="llama3", rope_factor=32.0,
                         rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_positions=8192)  # fmt: skip
    llama3 = {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192}
    five = hf | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}}
    four = old | {"num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **llama3}}
    assert llama_config_from_hf(five) == scaled == llama_config_from_hf(four)
    with pytest.raises(ConfigError, match=r"max_position_embeddings is missing"):
        llama_config_from_hf({k: v for k, v in hf.items() if k != "max_position_embeddings"})


def test_untrusted_files_are_refused(tmp_path):
    write_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(LlamaConfig(**TINY))) + " " * (1 << 20))
    with pytest.raises(StateLoadError, match=r"config.json: larger than 1048576 bytes"):
        load_hf_llama(tmp_path)
    write_folder(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../model.safetensors"}})
    )
    with pytest.raises(UntrustedCheckpointError, match=r"'\.\./model\.safetensors' \(a path, not a file name"):
        load_hf_llama(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(StateLoadError, match=r"not a readable safetensors file"):
        load_hf_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(StateLoadError, match=r"model.safetensors: not found"):
        load_hf_llama(tmp_path)
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(UntrustedCheckpointError, match=r"model.safetensors.*a special file"):
        load_hf_llama(tmp_path)


def test_a_config_claiming_more_layers_than_the_files_hold_builds_nothing(tmp_path):
    write_folder(tmp_path)
    edit_config(tmp_path, num_hidden_layers=10**9)
    with pytest.raises(
        StateLoadError, match=r"num_hidden_layers=1000000000, but the weight files hold only 21 tensors"
    ):
        load_hf_llama(tmp_path)


def test_shards_must_be_where_the_index_says(tmp_path):
    write_folder(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    names = sorted(tensors)
    (tmp_path / "model.safetensors").unlink()
    first, second = names[:10], names[10:]
    save_file({n: tensors[n] for n in first}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in second}, str(tmp_path / "b.safetensors"))
    weight_map = {n: "a.safetensors" for n in first} | {n: "b.safetensors" for n in second}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    load_hf_llama(tmp_path)
    index.write_text(json.dumps({"weight_map": weight_map | {first[0]: "b.safetensors"}}))
    with pytest.raises(
        StateLoadError, match=rf"holds tensor '{first[0]}', which model.safetensors.index.json puts in 'b"
    ):
        load_hf_llama(tmp_path)


# --- (b) transformers' logits -----------------------------------------------------------------


def hf_model(tmp_path, tie: bool, rope_scaling=None, **save_kw):
    """A random transformers LlamaForCausalLM (norms perturbed off one), saved to ``tmp_path``."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the integration extra)")
    config = transformers.LlamaConfig(
        rope_scaling=rope_scaling,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True, **save_kw)
    return transformers, model


@pytest.mark.parametrize("rope", [None, "llama3"], ids=["plain-rope", "llama3-rope"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_are_bitwise_transformers_in_float32(tmp_path, tie, rope):
    """At every length, checkpointed or not. ``llama3``: Llama 3.1 / 3.2 checkpoints scale their
    rotary frequencies (such a folder was refused); the plain frequencies give other logits
    there, so the comparison can fail."""
    _, reference = hf_model(tmp_path, tie, rope_scaling=None if rope is None else {"rope_type": rope, **LLAMA3})
    model, cfg = load_hf_llama(tmp_path)
    assert cfg.tie_embeddings is tie and cfg.n_kv_heads == 2 and cfg.rope_theta == 5000.0
    assert (cfg.rope_type, cfg.rope_original_positions) == ((rope, 32) if rope else ("default", 8192))
    plain = None
    if rope is not None:
        edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
        plain, _ = load_hf_llama(tmp_path)
    g = torch.Generator().manual_seed(1)
    for length in (1, 7, 24, 64):
        idx = torch.randint(0, 97, (2, length), generator=g)
        with torch.no_grad():
            expected = reference(idx).logits
            assert bitwise_equal(model(idx), expected), f"length {length}"
            if plain is not None and length > 1:
                assert not bitwise_equal(plain(idx), expected), f"length {length}"
        assert bitwise_equal(model(idx).detach(), expected), f"length {length}, checkpointed"  # grad on: checkpoint


def test_sharded_checkpoint_and_half_precisions_are_bitwise_transformers(tmp_path):
    transformers, reference = hf_model(tmp_path, False, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    idx = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_hf_llama(tmp_path, dtype=dtype)
        # from_pretrained keeps the rotary frequencies in float32 (a .to(dtype) would round them)
        expected = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
        with torch.no_grad():
            assert bitwise_equal(model(idx), expected(idx).logits), dtype


# --- (d) FP8 training under activation checkpointing ------------------------------------------


def fp8_run(mode: str, steps: int = 3, **model_kw):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY, **model_kw))
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False, exclude=["*lm_head"]))
    state.convert(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(steps):
            idx = torch.randint(0, 97, (2, 16), generator=g)
            with state.step(step):
                loss = model.loss(idx, idx.roll(-1, dims=1))
                state.commit_forward()
                loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return state, auditor.report(), losses, grads


@pytest.mark.parametrize(
    "engine, reentrant",
    [("torch", False), ("torch", True), ("deepspeed", False)],
    ids=["torch-nonreentrant", "torch-reentrant", "deepspeed"],
)
def test_fp8_training_recomputes_bitwise_and_equals_the_uncheckpointed_run(engine, reentrant):
    state, report, losses, grads = fp8_run("safe", checkpoint_engine=engine, use_reentrant=reentrant)
    converted = state.last_conversion.converted
    assert len(converted) == 2 * 7 and "layers.0.self_attn.q_proj" in converted and "lm_head" not in converted
    assert report.recomputed >= 3 * 2 * 7  # every layer of every step
    assert report.ok, report.format_table()
    _, _, losses_plain, grads_plain = fp8_run("safe", checkpoint=False)
    for step, (a, b) in enumerate(zip(losses, losses_plain, strict=True)):
        assert bitwise_equal(a, b), f"loss of step {step}"
    for step, (ga, gb) in enumerate(zip(grads, grads_plain, strict=True)):
        for name in ga:
            assert bitwise_equal(ga[name], gb[name]), f"step {step}: grad of {name}"


def test_fp8_naive_mode_is_caught_by_the_auditor():
    _, report, _, _ = fp8_run("naive")
    assert not report.ok
    assert report.mismatches and any(r.max_abs_diff > 0 for r in report.mismatches)
