"""The CLI's configuration loading and the audit command (no Lightning needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_fp8state.cli.config import CONFIGS_DIR, RECIPES_DIR, load_config, quant_config, validate
from lightning_fp8state.cli.main import main
from lightning_fp8state.errors import ConfigError

RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
# configs/gemm/ holds the measured GEMM table quant.policy reads: data, not a piece of a run config
PIECES = sorted(p for p in CONFIGS_DIR.rglob("*.yaml") if p.parent.name != "gemm")
FAST = ["model.d_model=32", "model.n_layers=2", "model.seq_len=16", "data.batch_size=4"]


def test_there_are_recipes_and_pieces():
    assert {p.stem for p in RECIPES} >= {
        "tiny_gpt_cpu",
        "gpt_124m_h200",
        "gpt_350m_h200x2_deepspeed",
        "gpt_1b_h200x2_fsdp",
        "multinode_template",
    }
    assert len(PIECES) >= 8


def test_the_shipped_gemm_table_reads_as_one():
    from lightning_fp8state.nn.policy import read_gemm_table, shipped_gemm_table

    assert isinstance(read_gemm_table(shipped_gemm_table()), dict)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads_and_validates(recipe):
    cfg = load_config(str(recipe))
    assert cfg.name and cfg.trainer.max_steps >= 1


@pytest.mark.parametrize("piece", PIECES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_config_piece_merges_and_validates(piece, tmp_path):
    recipe = tmp_path / "r.yaml"
    rel = piece.relative_to(CONFIGS_DIR).with_suffix("")
    recipe.write_text(f"base: [{rel.as_posix()}]\nname: piece\n")
    cfg = load_config(str(recipe))
    assert cfg.name == "piece"


def test_switching_the_recipe_on_the_command_line_brings_its_shipped_settings_under_the_users_own(tmp_path):
    """``quant.recipe=NAME`` takes ``configs/quant/NAME.yaml`` as a recipe's ``base:`` would:
    fp8_blockwise's E4M3 gradients (the schema's E5M2 sent its backward GEMMs to the float32
    emulation), back to per-tensor formats for fp8_delayed; a key the user sets wins in any order;
    the same recipe named again keeps the recipe file's own settings; no other name is a path."""
    rowwise = tmp_path / "rowwise.yaml"
    rowwise.write_text("base: [quant/fp8_rowwise]\nname: r\nquant: {margin: 2}\n")
    for overrides, want in (
        (["quant.recipe=fp8_blockwise"], ("fp8_blockwise", "e4m3", "e4m3", 0)),
        (["quant.backward_format=e5m2", "quant.recipe=fp8_blockwise"], ("fp8_blockwise", "e4m3", "e5m2", 0)),
        (["quant.recipe=fp8_rowwise", "quant.margin=1"], ("fp8_rowwise", "e4m3", "e4m3", 1)),
    ):
        q = load_config("tiny_gpt_cpu", overrides).quant
        assert (q.recipe, q.forward_format, q.backward_format, q.margin) == want, overrides
    q = load_config(str(rowwise), ["quant.recipe=fp8_delayed"]).quant
    assert (q.recipe, q.backward_format, q.margin, q.initial_scale) == ("fp8_delayed", "e5m2", 0, "calibrate")
    q = load_config(str(rowwise), ["quant.recipe=fp8_rowwise"]).quant
    assert (q.backward_format, q.margin) == ("e4m3", 2)  # the recipe file's own margin stays
    with pytest.raises(ConfigError, match="quant.recipe"):
        load_config("tiny_gpt_cpu", ["quant.recipe=../../recipes/tiny_gpt_cpu"])


def test_a_recipe_file_that_names_only_its_recipe_gets_that_recipes_formats(tmp_path):
    """The schema's formats are ``auto``: a user's YAML with ``quant: {recipe: fp8_rowwise}`` and
    no ``base:`` piece runs E4M3 gradients (the schema's E5M2 sent the backward GEMMs to the
    float32 emulation), and the per-tensor recipes keep E5M2."""
    for recipe, want in (("fp8_rowwise", "e4m3"), ("fp8_blockwise", "e4m3"), ("fp8_current", "e5m2")):
        path = tmp_path / f"{recipe}.yaml"
        path.write_text(f"name: mine\nquant: {{recipe: {recipe}}}\n")
        cfg = load_config(str(path))
        validate(cfg)
        q = quant_config(cfg)
        assert (q.forward_format, q.backward_format) == ("e4m3", want), recipe


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trainer.max_stepz=3"], "trainer.max_stepz"),
        (["trainer.max_steps=abc"], "trainer.max_steps"),
        (["trainer.max_steps=0"], "trainer.max_steps=0"),
        (["quant.mode=careful"], "quant.mode='careful'"),
        (["quant.history_len=0"], "history_len"),
        (["strategy.name=horovod"], "strategy.name='horovod'"),
        (["data.source=text"], "data.path"),
        (["data.source=bin", "data.path=/no/such/file.bin"], "data.path='/no/such/file.bin'"),
        (["bogus"], "recipe 'bogus'"),
        (["tiny_gpt_cpu", "bogus"], "expected key=value"),
    ],
)
def test_bad_input_exits_2_naming_the_key_and_writes_nothing(argv, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(["train", *argv, f"out_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_audit_steps_below_one_exits_2_naming_the_argument(capsys):
    assert main(["audit", "--steps", "0"]) == 2
    assert "--steps=0 is not allowed: expected an integer >= 1" in capsys.readouterr().err


def test_missing_recipe_file_exits_2(capsys):
    assert main(["audit", "no_such_recipe.yaml"]) == 2
    assert "no_such_recipe.yaml" in capsys.readouterr().err


def test_bad_yaml_key_in_a_recipe_names_the_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_steps: 5\n  learning_rate: 0.1\n")
    assert main(["audit", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "learning_rate" in err and "bad.yaml" in err


def test_command_line_usage_errors_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_fp8state", "audit", "--mode", "sloppy"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "sloppy" in proc.stderr and "Traceback" not in proc.stderr


def test_audit_safe_exits_0_and_naive_exits_1(capsys):
    assert main(["audit", "--mode", "safe", "--steps", "3", *FAST]) == 0
    out = capsys.readouterr().out
    assert "OK: forward and recompute bit-identical" in out
    assert main(["audit", "--mode", "naive", "--steps", "3", *FAST]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "mismatch in" in out


def test_audit_bf16_control_exits_0(capsys):
    assert main(["audit", "--mode", "bf16", "--steps", "2", *FAST]) == 0


def test_audit_compare_prints_the_seed_table(capsys):
    assert main(["audit", "--compare", "--steps", "3", *FAST]) == 0  # judged on safe
    out = capsys.readouterr().out
    table = out[out.index("mode   |") :]
    assert "naive  | mismatch in" in table
    assert "safe   | bit-identical at all 3 events" in table
    assert "bf16   | bit-identical at all 3 events" in table


def test_config_error_is_a_value_error():
    with pytest.raises(ConfigError):
        load_config(None, ["quant.amax_algo=mean"])
    assert issubclass(ConfigError, ValueError)
    assert Path(RECIPES_DIR).is_dir()


def test_audit_runs_on_a_users_text_file_and_token_bin(tmp_path, capsys):
    import numpy as np

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    common = [*FAST, "model.vocab_size=256", "--steps", "2", "--mode", "safe"]
    assert main(["audit", "data.source=text", f"data.path={text}", *common]) == 0
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint16).tofile(tokens)
    assert main(["audit", "data.source=bin", f"data.path={tokens}", *common]) == 0
    # a token id beyond the vocabulary is refused naming the key
    np.full(100, 300, dtype=np.uint16).tofile(tokens)
    assert main(["audit", "data.source=bin", f"data.path={tokens}", *common]) == 2
    assert "vocab_size" in capsys.readouterr().err
