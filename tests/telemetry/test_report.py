"""The report: non-empty PNG plots from a run's JSONL, the summary, the module entry point."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.telemetry import TrainingTelemetry, write_report
from lightning_fp8state.telemetry.__main__ import main
from tests.conftest import event_inputs, make_stack
from tests.telemetry.helpers import TinyNet, regression_batches

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fp8_run(run_dir, steps=12, nan_at=5):
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(n=2, ckpt=("torch", False)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tel = TrainingTelemetry(run_dir, model=model, state=state, log_every=4, max_grad_norm=1.0)
    for step, x in enumerate(event_inputs(steps, scale_growth=1.05)):
        with state.step(step):
            loss = model(x.requires_grad_(True)).float().pow(2).mean()
            loss.backward()
        if step == nan_at:
            model.blocks[1].fc2.weight.grad[0, 0] = float("nan")
        if tel.before_optimizer_step(opt, loss=loss, tokens=x.shape[0] * 16):
            opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    return state


def assert_real_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert float(pixels[..., :3].std()) > 0.01  # not a blank canvas


def test_report_writes_the_plots_and_the_summary(tmp_path, capsys):
    fp8_run(tmp_path)
    report = write_report(tmp_path)
    assert set(report.plots) == {"loss", "grad_norm", "scales", "throughput"}
    for path in report.plots.values():
        assert path.parent == tmp_path / "report"
        assert_real_png(path)
    s = report.summary
    assert (s["steps attempted"], s["steps applied"], s["steps skipped"]) == (12, 11, 1)
    assert s["non-finite gradient steps"] == 1
    assert s["quantizer owners"] == 2 * 2 * 3
    assert s["commits per event"] == "1 .. 1" and s["ledger violations"] == 0
    assert s["effective tokens/s"] < s["tokens/s"]
    assert s["dominant gradient source"]
    out = capsys.readouterr().out
    assert "steps skipped" in out and "scales.png" in out


def test_cli_entry_point(tmp_path, capsys):
    fp8_run(tmp_path / "run", steps=4, nan_at=1)
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "grad_norm.png",
        "loss.png",
        "scales.png",
        "throughput.png",
    ]
    assert "steps attempted" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nothing-here")]) == 2
    assert "no telemetry JSONL" in capsys.readouterr().err


def test_report_of_a_run_without_quantizer_state(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tel = TrainingTelemetry(tmp_path / "version_0", model=model, log_every=2)
    for x, y in regression_batches(4):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        tel.before_optimizer_step(opt, loss=loss)  # no tokens: throughput in steps/s
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    report = write_report(tmp_path, show=False)  # found below the run directory
    assert set(report.plots) == {"loss", "grad_norm", "throughput"}
    assert any("scales.png" in note for note in report.notes)
    assert "steps/s" in report.summary and "tokens/s" not in report.summary
    for path in report.plots.values():
        assert_real_png(path)


def test_missing_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no telemetry JSONL"):
        write_report(tmp_path)


def test_the_summary_prints_names_and_paths_as_text_not_rich_markup(tmp_path, capsys):
    """A run directory or a module name with brackets (a received run's JSONL is data): rich
    read "[/]" as a closing tag and raised MarkupError, and "[red]" vanished into a style."""
    pytest.importorskip("rich")
    import json

    run = tmp_path / "runs[/]" / "x[red]"
    run.mkdir(parents=True)
    rows = [{"step": i, "train/loss": 1.0 / (i + 1), "train/dominant_grad_source": "blocks[/]0"} for i in range(3)]
    (run / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(run)
    out = capsys.readouterr().out
    assert "blocks[/]0" in out and "runs[/]/x[red]/telemetry.jsonl" in "".join(out.split())


def test_names_with_dollar_signs_and_rows_without_effective_throughput_still_draw(tmp_path):
    """A JSONL from elsewhere (data): an owner or expert layer named with a ``$`` pair was parsed
    as mathtext and raised while drawing, and a row with raw throughput but no effective one
    raised in the throughput plot. Every plot is drawn, the names literally."""
    import json

    name = "h$\\frac$"
    rows = [
        {
            "step": i,
            "train/loss": 1.0 / (i + 1),
            "train/tokens_per_s": 100.0,
            "train/window_seconds": 1.0,
            **({"train/effective_tokens_per_s": 90.0} if i else {}),  # the first row without
            "fp8state/owners": 1.0,
            f"fp8state/scale/{name}.input": 2.0 + i,
            f"fp8state/amax/{name}.input": 1.0,
            **{f"fp8state/expert_tokens/{name}/{e}": 4.0 + e for e in range(2)},
            f"fp8state/experts_idle/{name}": 0.0,
            **{f"fp8state/expert_scale/{name}/w1.weight/{e}": 3.0 for e in range(2)},
        }
        for i in range(3)
    ]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path, show=False)
    assert {"loss", "scales", "throughput", "experts"} <= set(report.plots)
    for path in report.plots.values():
        assert_real_png(path)


def test_a_run_with_malformed_values_still_reports_and_names_what_it_dropped(tmp_path, capsys):
    """A received run's JSONL is data: values of the wrong type (a list, an object, null, a
    stray string), non-finite and oversized numbers, and keys without their companions made
    ``fp8state report`` raise (TypeError, KeyError, OverflowError). The report completes; each
    line with dropped values is named, once."""
    import json

    nan, inf = float("nan"), float("inf")
    rows = [
        {"step": 0, "train/loss": [1], "train/grad_norm": {"a": 1}, "fp8state/owners": None, "train/skipped": "x"},
        {"step": 1, "train/loss": 2.0, "train/window_seconds": 1.0, "fp8state/owners": 1.0, "fp8state/scale_min": 1.0},
        {"step": 2, "train/loss": 1.0, "train/clipped": 1.0, "fp8state/scale/a.input": 10**30},
        {"step": 3, "fp8state/expert_tokens/m/0": inf, "fp8state/expert_tokens/m/x": 3.0, "train/window_seconds": 2.0},
        {"step": 4, "fp8state/fallback/blocks.0": nan, "fp8state/fallback_layers": 1.0, "train/loss": 0.5},
        {"step": nan, "train/loss": 1.0},
    ]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path)
    assert report.summary["steps attempted"] == 5 and "loss" in report.plots
    dropped = [w for w in report.warnings if w.endswith("dropped")]
    assert len(dropped) == 1 and "line 1" in dropped[0] and "'train/loss' (list)" in dropped[0], report.warnings
    assert any("line 6" in w and "numeric 'step'" in w for w in report.warnings)
    assert "dropped" in capsys.readouterr().err
