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


# -- sizes: a room a reader can hold ---------------------------------------------------------
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def _definitions():
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node, node.end_lineno - node.lineno + 1


def test_no_class_over_400_lines_and_no_function_over_80():
    too_big = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines"
        for path, node, lines in _definitions()
        if lines > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES)
    ]
    assert not too_big, "split these by concern:\n" + "\n".join(too_big)


# -- one argument-check style ------------------------------------------------------------------
# A bad argument raises ConfigError through config.require_* (one message: "key=value is not
# allowed: expected ..."). A bare ValueError or TypeError is raised only where it is not an
# argument check: a class defined wrongly (TypeError at class creation), or a local signal caught
# in the same function. Lightning's MisconfigurationException only in lightning/, where
# Lightning's own contract (a Strategy or Callback refusing its setup) asks for it.
BARE_RAISES_ALLOWED = {
    ("quant_recipes/base.py", "__init_subclass__"),  # a recipe class defined wrongly
    ("cli/schema.py", "schema_twin"),  # a config dataclass defined wrongly
    # why a checkpoint cannot serve a resume: a reason the resume plan catches, records and falls
    # back past (cli/resume.py: plan_resume), not an argument check
    ("cli/resume.py", "_read_checkpoint"),
}


def _bare_raises():
    for path in SOURCES:
        rel = str(path.relative_to(PACKAGE))
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                    name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                    yield rel, func.name, name, node.lineno


def test_argument_checks_raise_through_require_in_one_message():
    found = [
        f"{rel}:{line} in {func}: raise {name}(...)"
        for rel, func, name, line in _bare_raises()
        if name in ("ValueError", "TypeError")
        and (rel, func) not in BARE_RAISES_ALLOWED
        and not _caught_locally(rel, func)
    ]
    assert not found, "use config.require_* (or require_that):\n" + "\n".join(found)
    lightning_only = [
        f"{rel}:{line}"
        for rel, _, name, line in _bare_raises()
        if name == "MisconfigurationException" and not rel.startswith("lightning/")
    ]
    assert not lightning_only, lightning_only


def _caught_locally(rel: str, func_name: str) -> bool:
    """Whether ``func_name`` in ``rel`` catches, in a try of its own, what it raises bare."""
    tree = ast.parse((PACKAGE / rel).read_text())
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and func.name == func_name:
            for node in ast.walk(func):
                if isinstance(node, ast.Try) and any(
                    isinstance(h.type, (ast.Name, ast.Tuple)) and "ValueError" in ast.unparse(h.type)
                    for h in node.handlers
                ):
                    return True
    return False


def test_the_ops_check_their_arguments_in_the_one_message():
    import torch

    from lightning_fp8state import ops
    from lightning_fp8state.errors import ConfigError

    x = torch.randn(4, 8)
    try:
        ops.quantize_fp8(x.double(), torch.ones(1), torch.float8_e4m3fn)
    except ConfigError as exc:
        assert str(exc).startswith("x.dtype=torch.float64 is not allowed: expected one of [torch.float32")
    else:
        raise AssertionError("a float64 input was accepted")
