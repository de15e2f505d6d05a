"""Diagnostic (issue 27, GPU): is T5's non-reentrant checkpointed gradient on CUDA bitwise the plain
run's, with the library off, with the bf16 control and with FP8? Prints the differing counts."""

from __future__ import annotations

import sys

sys.path.insert(0, ".")
from tests.integration.common import differing  # noqa: E402
from tests.integration.test_families import run  # noqa: E402

kw = {"device": "cuda", "autocast": True}
off_a = run("t5", None, library=False, **kw)[1]
off_b = run("t5", None, library=False, **kw)[1]
off_nr = run("t5", False, library=False, **kw)[1]
ctl_nr = run("t5", False, recipe="bf16", **kw)[1]
fp8 = run("t5", None, **kw)[1]
fp8_nr = run("t5", False, **kw)[1]
print("off plain vs off plain (determinism):", len(differing(off_a, off_b)))
print("off plain vs off non-reentrant:", len(differing(off_a, off_nr)))
print("bf16 control non-reentrant vs off non-reentrant:", len(differing(off_nr, ctl_nr)))
print("fp8 plain vs fp8 non-reentrant:", len(differing(fp8, fp8_nr)))
worst = max((float((off_a[s][n] - off_nr[s][n]).abs().max()) for s, n in differing(off_a, off_nr)), default=0.0)
print("worst off-vs-off-nonreentrant abs diff:", worst)
