"""``fp8state train`` on the Llama family (issue 43, target 1): ``model.arch=llama`` trains on the
CPU and resumes; ``model.init_from`` starts from a local Hugging Face checkpoint folder, whose
``config.json`` sets the run's model shape (recorded in ``config.yaml``), with the weights
loaded bitwise; keys of the other architecture, disagreeing shapes and a too-long ``seq_len``
are refused with one line naming the key."""

from __future__ import annotations

import pytest
import torch
import yaml

from lightning_fp8state.cli.config import load_config
from lightning_fp8state.cli.main import main
from lightning_fp8state.cli.models import build_model
from lightning_fp8state.models import Llama
from lightning_fp8state.telemetry.sinks import read_jsonl

TINY = [
    "model.arch=llama",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=64",
    "model.seq_len=16",
    "data.batch_size=4",
    "data.num_samples=400",
]


@pytest.fixture
def run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf_llama")
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, {k.removeprefix("model."): v.detach().clone() for k, v in model.state_dict().items()}


def test_a_llama_trains_and_resumes_through_the_cli(run_root):
    out = f"out_dir={run_root / 'runs'}"
    assert main(["train", *TINY, "trainer.max_steps=30", "trainer.checkpoint_every_n_steps=15", out]) == 0
    run = run_root / "runs" / "tiny_gpt_cpu"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["arch"] == "llama" and saved["model"]["n_kv_heads"] == 2
    rows = read_jsonl(run / "telemetry.jsonl")
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns
    assert main(["train", "--resume", str(run), "trainer.max_steps=40"]) == 0
    assert read_jsonl(run / "telemetry.jsonl")[-1]["step"] == 40


def test_init_from_takes_the_checkpoints_shape_and_weights(run_root, hf_folder):
    folder, weights = hf_folder
    cfg = load_config(None, ["model.arch=llama", f"model.init_from={folder}", "model.seq_len=32"])
    assert (cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_kv_heads, cfg.model.ffn_hidden) == (97, 32, 2, 64)
    model = build_model(cfg)
    assert isinstance(model, Llama) and model.cfg.seq_len == 32
    ours = model.state_dict()
    for name, value in weights.items():
        assert torch.equal(ours[name], value), name
    out = f"out_dir={run_root / 'runs'}"
    args = ["train", "model.arch=llama", f"model.init_from={folder}", "model.seq_len=32", "data.batch_size=2"]
    assert main([*args, "data.num_samples=40", "trainer.max_steps=3", out]) == 0
    saved = yaml.safe_load((run_root / "runs" / "tiny_gpt_cpu" / "config.yaml").read_text())
    assert saved["model"]["vocab_size"] == 97 and saved["model"]["init_from"] == str(folder)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.n_kv_heads=2"], "model.n_kv_heads=2 is not allowed: expected its default None with arch='gpt'"),
        (["model.arch=llama", "model.mlp_ratio=2"], "model.mlp_ratio=2 is not allowed"),
        (["model.arch=transformer"], "model.arch='transformer' is not allowed: expected one of ['gpt', 'llama']"),
    ],
)
def test_keys_of_another_architecture_are_refused_naming_them(run_root, capsys, extra, message):
    assert main(["train", *extra, "trainer.max_steps=1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["model.d_model=48"], "model.d_model=48 is not allowed: expected 32, the value of model.init_from"),
        (["model.seq_len=128"], "model.seq_len=128 is not allowed: expected at most 64"),
    ],
)
def test_init_from_refuses_a_run_that_disagrees_with_the_checkpoint(run_root, capsys, hf_folder, extra, message):
    folder, _ = hf_folder
    assert main(["train", "model.arch=llama", f"model.init_from={folder}", *extra, "trainer.max_steps=1"]) == 2
    assert message in capsys.readouterr().err


def test_init_from_needs_a_llama(run_root, capsys, hf_folder):
    folder, _ = hf_folder
    assert main(["train", f"model.init_from={folder}", "trainer.max_steps=1"]) == 2
    assert "model.init_from=" in capsys.readouterr().err
