"""A recipe, a received run's ``config.yaml`` and an override are data (issue 41): they read
neither the environment nor files outside the configs, stay small, UTF-8 and alias-free, and a
resume compares ``config.yaml`` with the configuration its checkpoint was trained with. Also the
bad inputs that gave a traceback or a wrong line: each is exit 2 and one line naming the key, the
argument or the file, with no directory left behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fp8state.cli.config import load_config
from lightning_fp8state.cli.main import main
from tests.cli.test_faults import COMMON, assert_one_clean_error, snapshot, train

SECRET = "s3cr3t-token-value"


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("FP8STATE_TEST_SECRET", SECRET)


def _nothing_written(root) -> None:
    assert not (root / "runs").exists()
    leaked = [p for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


def test_a_recipe_that_reads_the_environment_is_refused(run_root, secret_env, capsys):
    recipe = run_root / "mine.yaml"
    recipe.write_text("name: run\ntelemetry:\n  project: ${oc.env:FP8STATE_TEST_SECRET}\n")
    assert train(str(recipe), *COMMON, "out_dir=runs") == 2
    assert_one_clean_error(capsys.readouterr().err, str(recipe), "telemetry.project", "calls a resolver")
    _nothing_written(run_root)


def test_an_override_that_reads_the_environment_is_refused(run_root, secret_env, capsys):
    assert train(*COMMON, "out_dir=runs", "name=${oc.env:FP8STATE_TEST_SECRET}") == 2
    assert_one_clean_error(capsys.readouterr().err, "override", "calls a resolver")
    _nothing_written(run_root)


def test_a_received_config_yaml_that_reads_the_environment_is_refused(finished_run, secret_env, capsys):
    cfg = finished_run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("project: fp8state", "project: ${oc.env:FP8STATE_TEST_SECRET}"))
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(capsys.readouterr().err, "config.yaml", "telemetry.project", "calls a resolver")
    assert snapshot(finished_run) == before


def test_a_reference_to_another_key_still_works(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: run\ntrainer:\n  max_steps: 7\n  schedule_steps: ${trainer.max_steps}\n")
    assert load_config(str(recipe)).trainer.schedule_steps == 7


def test_base_pieces_stay_inside_the_configs_and_the_recipes_folder(run_root, capsys):
    outside = run_root / "outside.yaml"
    outside.write_text("trainer:\n  lr: 0.5\n")
    folder = run_root / "recipes"
    folder.mkdir()
    (folder / "piece.yaml").write_text("trainer:\n  lr: 0.25\n")
    (folder / "linked.yaml").symlink_to(outside)
    for piece, needle in ((str(outside), "not allowed"), ("../outside", "not allowed"), ("linked", "leads outside")):
        recipe = folder / "r.yaml"
        recipe.write_text(f"name: run\nbase: [{piece}]\n")
        assert train(str(recipe), *COMMON, "out_dir=runs") == 2
        assert_one_clean_error(capsys.readouterr().err, "base piece", needle)
    recipe.write_text("name: run\nbase: [piece]\n")  # the recipe's own folder
    assert load_config(str(recipe)).trainer.lr == 0.25


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        (b"name: run\ntrainer:\n  lr: 0.1 # caf\xe9\n", ["not UTF-8", "line 3"]),
        (b"a: &x [1, 1]\nb: &y [*x, *x]\nname: run\n", ["YAML alias", "not allowed"]),
        (b"name: run\n" + b"# padding\n" * 120_000, ["larger than 1024 KiB"]),
    ],
)
def test_a_recipe_too_large_not_utf8_or_with_aliases_is_refused(run_root, capsys, content, needles):
    recipe = run_root / "mine.yaml"
    recipe.write_bytes(content)
    for command in (["train", str(recipe), *COMMON, "out_dir=runs"], ["audit", str(recipe), "--steps", "1"]):
        assert main(command) == 2
        assert_one_clean_error(capsys.readouterr().err, str(recipe), *needles)
    assert not (run_root / "runs").exists()


def test_a_received_config_yaml_that_is_not_utf8_is_refused(finished_run, capsys):
    cfg = finished_run / "config.yaml"
    cfg.write_bytes(cfg.read_bytes() + b"# \xff\n")
    capsys.readouterr()
    assert train("--resume", str(finished_run)) == 2
    assert_one_clean_error(capsys.readouterr().err, "config.yaml", "not UTF-8")


# -- a resume compares config.yaml with the checkpoint's record ----------------------------
@pytest.mark.parametrize(
    ("edit", "key", "recorded", "edited"),
    [
        (("n_heads: 4", "n_heads: 2"), "model.n_heads", "4", "2"),
        (("seed: 0\n  num_workers", "seed: 5\n  num_workers"), "data.seed", "0", "5"),
        (("batch_size: 4", "batch_size: 8"), "data.batch_size", "4", "8"),
        (("warmup_steps: 10", "warmup_steps: 3"), "trainer.warmup_steps", "10", "3"),
        (("lr: 0.003", "lr: 0.1"), "trainer.lr", "0.003", "0.1"),
    ],
)
def test_a_hand_edit_of_config_yaml_is_refused_against_the_checkpoints_record(
    finished_run, capsys, edit, key, recorded, edited
):
    cfg = finished_run / "config.yaml"
    text = cfg.read_text()
    assert edit[0] in text, text
    cfg.write_text(text.replace(edit[0], edit[1], 1))
    before = snapshot(finished_run)
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30") == 2
    assert_one_clean_error(
        capsys.readouterr().err, "config.yaml", f"{key}={edited}", f"trained with {key}={recorded}", "edited"
    )
    assert snapshot(finished_run) == before


def test_the_checkpoint_records_its_configuration_loadable_weights_only(finished_run):
    ckpt = torch.load(finished_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["fp8state_run_config"]["trainer"]["max_steps"] == 20
    assert ckpt["fp8state_run_config"]["model"]["n_layers"] == 2


def test_cpu_threads_is_not_a_resumable_key(finished_run, capsys):
    capsys.readouterr()
    assert train("--resume", str(finished_run), "trainer.max_steps=30", "trainer.cpu_threads=2") == 2
    assert_one_clean_error(capsys.readouterr().err, "trainer.cpu_threads")


def test_the_resumable_keys_are_listed_in_train_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "may change only trainer.max_steps, trainer.gc" in out and "cpu_threads" not in out


# -- bad input that gave a traceback or the wrong line -------------------------------------
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["audit", "--steps", "99999999999999999999"], ["--steps", "<= 1000000"]),
        (["train", *COMMON, f"trainer.max_steps={10**23}"], ["trainer.max_steps", "<= 1000000000000"]),
        (["train", "--resume", "a", "--resume", "b"], ["--resume given twice"]),
        (["train", *COMMON, "name="], ["name needs a value"]),
        (["train", *COMMON, "out_dir="], ["out_dir needs a value"]),
        (["train", *COMMON, "data.num_samples=1"], ["data.num_samples=1", "batch_size=4"]),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_directory(run_root, capsys, args, needles):
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusals exit from the parser
        code = exc.code
    assert code == 2
    assert_one_clean_error(capsys.readouterr().err, *needles)
    assert not (run_root / "runs").exists() and not list(run_root.glob("tiny_gpt_cpu*"))


def test_a_name_with_a_control_character_is_refused(run_root, capsys):
    recipe = run_root / "mine.yaml"
    recipe.write_text('name: "a\\nb"\n')
    assert main(["train", str(recipe), *COMMON, "out_dir=runs"]) == 2
    assert_one_clean_error(capsys.readouterr().err, "name=", "control character")
    assert not (run_root / "runs").exists()


def test_a_directory_as_recipe_says_it_is_a_directory(run_root, capsys):
    (run_root / "recipes").mkdir()
    assert main(["train", "recipes"]) == 2
    assert_one_clean_error(capsys.readouterr().err, "'recipes' is a directory")


def test_a_bin_file_of_an_odd_byte_count_is_one_line(run_root, capsys):
    data = run_root / "tokens.bin"
    np.arange(400, dtype=np.uint16).tofile(data)
    data.write_bytes(data.read_bytes() + b"\x01")
    source = ["data.source=bin", f"data.path={data}", "model.vocab_size=512"]
    for command in (["train", *COMMON, *source, "out_dir=runs"], ["audit", *source, "--steps", "1"]):
        assert main(command) == 2
        assert_one_clean_error(capsys.readouterr().err, str(data), "801 bytes", "odd")
    assert not (run_root / "runs").exists()


def test_the_readme_lists_exactly_the_resumable_keys():
    import re
    from pathlib import Path

    from lightning_fp8state.cli.resume import RESUMABLE_KEYS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = re.search(r"The resumable keys, also listed by `fp8state train --help`:\s*(.+?)\. A", readme, re.S)
    assert listed is not None
    assert re.findall(r"`([\w.]+)`", listed.group(1)) == list(RESUMABLE_KEYS)
