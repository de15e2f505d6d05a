"""benchmarks/evidence.py on the tiny preset: the audit tells safe from naive, the JSON holds the series."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "evidence.py"
STEPS = 3
LAYERS = 2


def _load():
    spec = importlib.util.spec_from_file_location("evidence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    module = _load()
    path = tmp_path_factory.mktemp("evidence") / "evidence.json"
    doc = module.main(
        ["--steps", str(STEPS), "--device", "cpu", "--threads", "1", "--json", str(path), "model.n_layers=2"]
    )
    return module, doc, json.loads(path.read_text())


def test_every_run_ran_on_both_audits_and_they_agree(evidence):
    module, doc, _ = evidence
    assert list(doc["runs"]) == list(module.RUNS)  # bf16 first: the baseline
    assert doc["audit"] == "both"
    for name, run in doc["runs"].items():
        assert run["summary"]["audits_agree"] is True, name
        # full recompute: every checkpointed call (4 linears a block, + the FP4 operands) was compared
        per_block = 5 if name.startswith("fp4") else 4
        assert run["summary"]["recomputed_calls"] == STEPS * LAYERS * per_block, name


@pytest.mark.parametrize(
    "name",
    [
        "bf16",
        "fp8_safe",
        "fp8_naive_snapshot",
        "fp4_safe",
        "fp4c_safe",
        "fp8_current",
        "fp8_rowwise",
        "fp8_rowwise_gw_hp",
    ],
)
def test_safe_runs_and_the_control_recompute_bit_identically(evidence, name):
    run = evidence[1]["runs"][name]
    assert run["summary"]["mismatching_calls"] == 0
    assert run["summary"]["ledger_violations"] == 0
    assert run["series"]["mismatching_calls"] == [0] * STEPS


@pytest.mark.parametrize("name", ["fp8_naive", "fp4_naive", "fp4c_naive"])
def test_naive_runs_mismatch_and_violate_the_ledger(evidence, name):
    run = evidence[1]["runs"][name]
    assert run["summary"]["mismatching_calls"] > 0
    assert run["summary"]["events_affected"] == STEPS
    assert run["summary"]["ledger_violations"] > 0


def test_json_has_the_per_step_series(evidence):
    _, doc, written = evidence
    assert written["steps"] == STEPS and written["runs"].keys() == doc["runs"].keys()
    for name, run in written["runs"].items():
        series = run["series"]
        for key in ("loss", "grad_norm", "skipped", "mismatching_calls", "recomputed_calls", "ledger_violations"):
            assert len(series[key]) == STEPS, (name, key)
        assert all(math.isfinite(v) for v in series["loss"])
        assert run["summary"]["skipped_steps"] == sum(series["skipped"])
        assert math.isfinite(run["summary"]["eval_loss"]), name
    safe, base = written["runs"]["fp8_safe"]["series"], written["runs"]["bf16"]["series"]
    assert safe["loss"][0] == pytest.approx(base["loss"][0], rel=0.05)  # same weights and data


def test_table_lists_every_run(evidence, capsys):
    module, doc, _ = evidence
    results = []
    for name, run in doc["runs"].items():
        r = module.RunResult(name, run["overrides"], run["summary"]["seconds"], run["series"])
        r.audits_agree = run["summary"]["audits_agree"]
        r.eval_loss = run["summary"]["eval_loss"]
        results.append(r)
    table = module.format_table(results)
    assert table.splitlines()[0].startswith("| run | steps | fwd-vs-recompute mismatching calls")
    assert f"| fp8_safe | {STEPS} | 0 of " in table
    assert "| bf16 |" in table and "+0.0000 (+0.0%)" in table
    assert table.splitlines()[0].endswith("| held-out loss | held-out vs bf16 |")
    assert table.splitlines()[2].endswith("| +0.0000 (+0.0%) |")  # bf16 against itself, held out
    assert module._exit_code(doc) == 0


def test_held_out_batches_follow_the_training_batches():
    """The held-out batches are the data's next items: disjoint from the training ones, the
    same for every run."""
    from lightning_fp8state.cli.config import load_config

    module = _load()
    cfg = load_config(*module.PRESETS["tiny"])
    x, y = module._batches(cfg, 5, torch.device("cpu"))
    hx, hy = module._batches(cfg, 2, torch.device("cpu"), skip=3)
    assert torch.equal(hx, x[3:]) and torch.equal(hy, y[3:])
    tx, _ = module._batches(cfg, 3, torch.device("cpu"))
    assert not any(torch.equal(h, t) for h in hx for t in tx)


def test_eval_loss_reads_no_state_and_matches_the_training_loss_of_the_same_weights():
    """A no-grad evaluation of an FP8 model outside any event is allowed, records nothing and
    gives the loss that the model's forward computes on those batches."""
    from lightning_fp8state import Fp8State
    from lightning_fp8state.cli.config import load_config

    module = _load()
    cfg = load_config(module.PRESETS["tiny"][0], [*module.PRESETS["tiny"][1], "model.n_layers=1"])
    x, y = module._batches(cfg, 2, torch.device("cpu"))
    torch.manual_seed(0)
    state = Fp8State(module.quant_config(cfg))
    model = state.convert(module.build_model(cfg))
    with state.step(0):  # one training step, so the bank holds state to be left alone
        loss = model.loss(x[0], y[0])
        state.commit_forward()
        loss.backward()
    before = state.bank.state_dict()
    value = module.eval_loss(model, x, y, autocast=False)
    with torch.no_grad():
        expected = torch.stack([model.loss(a, b) for a, b in zip(x, y, strict=True)]).mean().item()
    assert value == pytest.approx(expected, rel=1e-6) and math.isfinite(value)
    after = state.bank.state_dict()
    assert before.keys() == after.keys()
    for key, val in before.items():
        if isinstance(val, torch.Tensor):
            assert torch.equal(val, after[key]), key


def test_every_preset_gives_a_valid_config_for_every_run():
    """The GPU presets never run in CI: their recipes and overrides must at least compose and
    validate (a wrong key fails here, not after a device machine has started)."""
    from lightning_fp8state.cli.config import load_config
    from lightning_fp8state.errors import ConfigError

    module = _load()
    for preset, (recipe, overrides) in module.PRESETS.items():
        arch = load_config(recipe, overrides).model.arch
        for run, extra in module.RUNS.items():
            if run in module.runs_for(arch):
                cfg = load_config(recipe, [*overrides, *extra])
                assert cfg.model.d_model > 0, (preset, run)
            else:  # the packed-FP4 attention runs are the GPT's: refused by name for a Llama
                with pytest.raises(ConfigError, match="fp4_attention=True is not allowed"):
                    load_config(recipe, [*overrides, *extra])
    big = load_config(*module.PRESETS["gpu_1b"])
    assert (big.model.d_model, big.model.n_layers, big.model.seq_len) == (2048, 20, 2048)
    llama = load_config(*module.PRESETS["gpu_llama_1b"])
    assert (llama.model.arch, llama.model.d_model, llama.model.n_layers, llama.model.n_kv_heads) == (
        "llama",
        2048,
        16,
        8,
    )
    assert module.runs_for("llama") == [r for r in module.RUNS if not r.startswith("fp4")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps=0: expected an integer >= 1"),
        (["--eval-batches", "-1"], "--eval-batches=-1: expected an integer >= 0"),
    ],
)
def test_bad_counts_are_refused_with_the_argument_named(argv, message):
    module = _load()
    with pytest.raises(SystemExit, match=message):
        module.main([*argv, "--device", "cpu"])
