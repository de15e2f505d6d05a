"""The shape of the package, read from its source with ``ast`` and text (nothing is imported):
measured timings live in docs/PERFORMANCE.md, not in the code; every op's argument list is
written once (its schema is read from its Python signature)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fp8state"
SOURCES = sorted(PACKAGE.rglob("*.py"))

# a measured duration or bandwidth, or a measured speed ratio ("0.52x"), anywhere in the source
TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|us|µs|GB/s|TB/s|milliseconds|microseconds)\b|\b\d\.\d+x\b", re.IGNORECASE)


def test_no_measured_timings_in_the_code():
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if TIMING.search(line)
    ]
    assert not found, "timings belong in docs/PERFORMANCE.md:\n" + "\n".join(found)


def test_the_timing_pattern_finds_what_it_is_for():
    for line in ("# about 13 us a call", "took 440-610 ms", "trained at 0.52x bf16's speed", "3.2 TB/s"):
        assert TIMING.search(line), line
    for line in ("x.reshape(-1, k)", "E4M3 and 1x128 tiles", "# 2 ranks, 128 rows"):
        assert not TIMING.search(line), line


def _literal_schemas(path: Path) -> list[str]:
    """The op schemas written out as string literals passed to ``LIB.define`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "define" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) or isinstance(arg, ast.BinOp):
                out.append(ast.unparse(arg))
    return out


def test_the_linear_and_update_ops_are_declared_from_one_signature():
    # the fused linear's forward and backward, and the batched scale update: no schema text of
    # their own, only the Python signature define_from reads (the fake binds the same one)
    linear = _literal_schemas(PACKAGE / "nn" / "linear_call.py")
    assert linear == [], linear
    library = " ".join(_literal_schemas(PACKAGE / "ops" / "library.py"))
    assert "update_scales" not in library
