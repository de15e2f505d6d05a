"""The benchmark scripts import and parse their arguments on a machine without a GPU (CPU).

They run on the device only, so nothing else in CI would notice a script broken by a
refactor of what it imports. ``--help`` exits before any CUDA work."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text())


def test_the_benchmarks_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"quantize.py", "quantize_fp4.py", "train_step.py", "linear_stack.py", "scaling.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports_and_parses_help(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their shared timing module
    monkeypatch.setattr("sys.argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
