"""The CLI schema is derived from the library's configurations, not restated, and every bad
value is refused by the section's own dataclass, naming the key and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

import lightning_fp8state as f8s
from lightning_fp8state.cli.config import load_config, quant_config
from lightning_fp8state.cli.main import main
from lightning_fp8state.cli.schema import QuantCfg, RunCfg
from lightning_fp8state.models import GPTConfig


def _section(name: str) -> type:
    return next(f.default_factory for f in dataclasses.fields(RunCfg) if f.name == name)


def test_the_quant_schema_has_quantconfigs_fields_in_order():
    assert _section("quant") is QuantCfg
    assert [f.name for f in dataclasses.fields(QuantCfg)] == f8s.QuantConfig.keys()
    assert not QuantCfg.__dataclass_params__.frozen  # omegaconf: a frozen node rejects merges


def test_the_quant_schema_defaults_are_quantconfigs():
    node = OmegaConf.structured(QuantCfg)
    assert f8s.QuantConfig.from_dict(OmegaConf.to_container(node)) == f8s.QuantConfig()


def test_the_model_schema_is_every_architectures_config_with_arch_and_init_from():
    from lightning_fp8state.models import LlamaConfig

    schema = {f.name: f.default for f in dataclasses.fields(_section("model"))}
    assert (schema.pop("arch"), schema.pop("init_from")) == ("gpt", "")
    for config in (GPTConfig, LlamaConfig):  # each architecture's keys, with its defaults
        assert {f.name: f.default for f in dataclasses.fields(config)}.items() <= schema.items()
    names = {f.name for cfg in (GPTConfig, LlamaConfig) for f in dataclasses.fields(cfg)}
    assert set(schema) == names


def test_a_recipe_states_the_defaults_it_wants_and_a_bare_one_gets_the_librarys(tmp_path):
    """Today's CLI behaviour (head excluded, violations counted) comes from the recipes' YAML."""
    for recipe in (
        "tiny_gpt_cpu",
        "gpt_124m_h200",
        "gpt_350m_h200x2_deepspeed",
        "gpt_1b_h200x2_fsdp",
        "multinode_template",
    ):
        q = quant_config(load_config(recipe))
        assert q.exclude == ("*head",) and q.strict is False, recipe
    bare = tmp_path / "bare.yaml"
    bare.write_text("base: [quant/fp8_delayed]\nname: bare\n")
    q = quant_config(load_config(str(bare)))
    assert q.exclude == f8s.QuantConfig().exclude and q.strict is f8s.QuantConfig().strict


def test_list_and_mapping_fields_merge_and_reach_quantconfig():
    """A mapping field (role -> mode) takes new keys; the sections stay closed to unknown ones."""
    cfg = load_config(
        None,
        ["quant.include=[blocks.*]", "quant.amax_reduction={input: data_parallel}", "quant.amax_reduction.attn_q=none"],
    )
    q = quant_config(cfg)
    assert q.include == ("blocks.*",)
    assert q.reduction_of("input") == "data_parallel" and q.reduction_of("weight") == "data_parallel"
    assert q.reduction_of("attn_q") == "none"
    with pytest.raises(f8s.ConfigError, match=r"override 'quant.bogus': unknown key"):
        load_config(None, ["quant.bogus=1"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("quant.margin=127", "quant.margin=127 is not allowed: expected an integer >= 0 and <= 126"),
        ("quant.attn_format=fp4", "quant.attn_format='fp4' is not allowed: expected one of ['nvfp4', 'mxfp4']"),
        ("quant.amax_reduction={input: all}", "quant.amax_reduction['input']='all' is not allowed"),
        (
            "model.checkpoint_engine=jax",
            "model.checkpoint_engine='jax' is not allowed: expected one of ['torch', 'deepspeed']",
        ),
        ("model.d_model=30", "model.d_model=30 is not allowed: expected a multiple of n_heads=4"),
        ("model.vocab_size=1", "model.vocab_size=1 is not allowed: expected an integer >= 2"),
        ("data.source=csv", "data.source='csv' is not allowed: expected one of ['markov', 'text', 'bin']"),
        ("data.num_workers=-1", "data.num_workers=-1 is not allowed: expected an integer >= 0"),
        (
            "telemetry.wandb=cloud",
            "telemetry.wandb='cloud' is not allowed: expected one of ['offline', 'online', 'disabled']",
        ),
        ("trainer.precision=fp8", "trainer.precision='fp8' is not allowed: expected one of"),
        ("trainer.lr=-0.1", "trainer.lr=-0.1 is not allowed: expected a finite number >= 0"),
        ("strategy.zero_stage=4", "strategy.zero_stage=4 is not allowed: expected an integer >= 1 and <= 3"),
    ],
)
def test_bad_values_exit_2_naming_the_key_and_the_allowed_values(override, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", override, f"out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
