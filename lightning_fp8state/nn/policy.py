"""The precision policy (``quant.policy``): which of the layers conversion selected stay in high
precision, by their block's position in the model's stack and by their GEMM shapes.

Position: ``keep_first`` / ``keep_last`` N blocks and the last ``ceil(keep_last_fraction x
n_blocks)`` blocks keep every selected layer inside them (Megatron keeps its first and last layers
in bf16 for the same reason: the ends of the stack are the most sensitive). The blocks are the
model's repeated block list: ``policy.blocks`` names it, or it is found as the longest
``nn.ModuleList`` whose items are all of one type holding modules of their own (``blocks`` of our
GPT, ``layers`` of our Llama, ``model.layers`` of a Hugging Face decoder, ``transformer.h`` of
GPT-2), not inside another such list (an MoE block's expert list is not the stack).

Size (``by_size``): a layer ``y = x W^T`` with ``K = in_features``, ``N = out_features`` runs three
GEMMs a step at ``M = tokens``: forward ``(M, N, K)``, input gradient ``(M, K, N)`` and weight
gradient ``(N, K, M)`` (as ``(m, n, k)``: output ``m x n``, contraction ``k``). From a GEMM table
measured on the device (``benchmarks/gemm_table.py`` writes it), each GEMM's bf16 and FP8 rates
are interpolated from the nearest measured shapes (inverse squared distance over ``log2`` of
``m, n, k``, averaging the log rates of the 4 nearest; an exact shape is its own measurement; the
FP8 time counts the measured casts of both operands where the table has them), and the layer is
kept when its predicted gain, the summed bf16 time over the summed FP8 time, is below
``min_gain``. ``auto`` reads the shipped table (``configs/gemm/tables.yaml``) for this device;
without a measurement for it, the rule of thumb torchtitan uses (torchao's auto filter) keeps the
small layers, and the report says no measurement was found. Without a CUDA device ``auto`` keeps
nothing by size: there is no FP8 GEMM speed to compare.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import TABLE_SUFFIXES, PrecisionPolicy, require_that
from ..errors import ConfigError

__all__ = [
    "GEMM_TABLE_FORMAT",
    "GemmMeasurement",
    "POLICY_WHY",
    "PolicyDecision",
    "cuda_device_name",
    "decide",
    "find_blocks",
    "linear_shape",
    "predicted_gain",
    "read_gemm_table",
    "shipped_gemm_table",
    "small_for_fp8",
]

GEMM_TABLE_FORMAT = "lightning_fp8state.gemm_table"
# every reason the policy gives starts with POLICY_WHY (the report counts them by it)
POLICY_WHY = "kept in high precision by quant.policy"
POSITION_WHY = f"{POLICY_WHY} (position): "
SIZE_WHY = f"{POLICY_WHY} (size): "
_NEAREST = 4  # measured shapes a prediction averages


@dataclass(frozen=True)
class GemmMeasurement:
    """One measured GEMM shape of a device: ``m x k`` times ``k x n``, best times in ms."""

    m: int
    n: int
    k: int
    bf16_ms: float
    fp8_ms: float
    cast_ms: float = 0.0  # quantizing both operands to FP8 (amax, scale, cast), where measured

    def rates(self) -> tuple[float, float]:
        """(bf16, FP8 with its casts) in FLOP per ms."""
        flops = 2.0 * self.m * self.n * self.k
        return flops / self.bf16_ms, flops / (self.fp8_ms + self.cast_ms)


@dataclass
class PolicyDecision:
    """What the policy keeps: layer name -> reason, and notes for the report (which rule and
    table were used, or why none was)."""

    kept: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def cuda_device_name() -> str | None:
    """The current CUDA device's name as the GEMM table keys it (``torch.cuda.get_device_name``),
    or None without CUDA."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def shipped_gemm_table() -> Path:
    """The GEMM table shipped with the package, which ``by_size=auto`` reads."""
    from ..shipped import shipped_dir  # noqa: PLC0415  (the shipped folders are looked up only when asked)

    return shipped_dir("configs") / "gemm" / "tables.yaml"


# Both injectable (tests, a run that knows better): the device the GEMMs run on and auto's table.
DEVICE_NAME: Callable[[], str | None] = cuda_device_name
AUTO_TABLE: Callable[[], Path] = shipped_gemm_table


def decide(model: nn.Module, policy: PrecisionPolicy, candidates: dict[str, nn.Module], recipe: str) -> PolicyDecision:
    """Which of ``candidates`` (the modules conversion is about to swap, by name) the policy keeps.

    Args:
        model: the model being converted (its block list is looked up in it).
        policy: ``QuantConfig.policy``.
        candidates: name -> module; the size rule judges ``nn.Linear`` and Conv1D-like modules
            (2-D ``weight``), the position rule every candidate.
        recipe: the quantization recipe (the rule of thumb differs for row-wise scaling).

    Raises:
        ConfigError: a position rule with no block list found (or an ambiguous one), a table
            that cannot be read, lacks this device (an explicit table) or a size rule without
            ``policy.tokens``.
    """
    decision = PolicyDecision()
    if policy.is_off() or not candidates:
        return decision
    if policy.keeps_by_position():
        decision.kept.update(_kept_by_position(model, policy, candidates))
    if policy.by_size != "off":
        sized = {n: s for n, m in candidates.items() if n not in decision.kept and (s := linear_shape(m))}
        _keep_by_size(policy, sized, recipe, decision)
    return decision


# -- position ----------------------------------------------------------------------------------


def find_blocks(model: nn.Module, path: str = "") -> tuple[str, nn.ModuleList]:
    """``(name, list)`` of the model's repeated block list: ``path`` (a module path, also found
    as the one module whose name ends with ``.path``: a LightningModule's attribute may prefix
    it) or the longest ``nn.ModuleList`` of one block type not inside another.

    Raises:
        ConfigError: no such list (or ``path`` names none), or several of the same length.
    """
    lists = {n: m for n, m in model.named_modules() if isinstance(m, nn.ModuleList)}
    if path:
        found = [n for n in lists if n == path] or [n for n in lists if n.endswith(f".{path}")]
        require_that(
            len(found) == 1, "policy.blocks", repr(path), f"the path of one nn.ModuleList of {type(model).__name__}"
        )
        return found[0], lists[found[0]]
    stacks = {n: m for n, m in lists.items() if _is_block_stack(m)}
    outer = {n: m for n, m in stacks.items() if not any(n.startswith(f"{o}.") for o in stacks if o != n)}
    if not outer:
        raise ConfigError(
            f"quant.policy keeps blocks by position, but {type(model).__name__} has no block list: expected an "
            "nn.ModuleList of one block type (GPT: blocks, Llama: layers, Hugging Face: model.layers); name it "
            "with quant.policy.blocks, or drop keep_first/keep_last/keep_last_fraction"
        )
    longest = max(len(m) for m in outer.values())
    tied = [n for n, m in outer.items() if len(m) == longest]
    require_that(
        len(tied) == 1, "policy.blocks", "''", f"the path of one of the block lists {tied} (several, equally long)"
    )
    return tied[0], outer[tied[0]]


def _is_block_stack(modules: nn.ModuleList) -> bool:
    items = list(modules)
    return bool(items) and len({type(m) for m in items}) == 1 and next(items[0].children(), None) is not None


def _block_rules(policy: PrecisionPolicy, n: int) -> dict[int, list[str]]:
    """Block index -> the rules keeping it (words for the report)."""
    rules: dict[int, list[str]] = {}
    first, last = min(policy.keep_first, n), min(policy.keep_last, n)
    # ceil, less a rounding hair: 0.1 x 30 blocks is 3, not 4
    fraction = min(n, math.ceil(policy.keep_last_fraction * n - 1e-9)) if policy.keep_last_fraction else 0
    for i in range(first):
        rules.setdefault(i, []).append(f"first {policy.keep_first} block(s) (keep_first={policy.keep_first})")
    for i in range(n - last, n):
        rules.setdefault(i, []).append(f"last {policy.keep_last} block(s) (keep_last={policy.keep_last})")
    for i in range(n - fraction, n):
        rules.setdefault(i, []).append(
            f"last {fraction} of {n} blocks (keep_last_fraction={policy.keep_last_fraction:g})"
        )
    return rules


def _kept_by_position(model: nn.Module, policy: PrecisionPolicy, candidates: dict[str, nn.Module]) -> dict[str, str]:
    path, blocks = find_blocks(model, policy.blocks)
    rules = _block_rules(policy, len(blocks))
    kept = {}
    for name in candidates:
        head, _, rest = name.partition(f"{path}.") if path else ("", "", name)
        index = rest.split(".")[0]
        if head or not rest or not index.isdigit() or int(index) not in rules:
            continue
        block = f"{path}.{index}" if path else index
        kept[name] = f"{POSITION_WHY}{block} is among the {' and '.join(rules[int(index)])}"
    return kept


# -- size --------------------------------------------------------------------------------------


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a Linear-like module, or None (not judged by size)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])  # transformers Conv1D: [in, out]
    return None


def small_for_fp8(in_features: int, out_features: int, recipe: str) -> str | None:
    """Why the rule of thumb keeps a ``in_features -> out_features`` layer, or None.

    This is the rule torchtitan uses (its ``auto_filter_small_kn`` calls torchao's float8 auto
    filter, measured on H100): with per-tensor scales a layer is kept when ``out <= 4096`` and
    ``in <= 1024``; with row-wise scales when ``in <= 2048``, ``out <= 1024``, or ``in <= 4096``
    and ``out <= 2048``. (torchao unpacks ``weight.shape`` as ``K, N``: its ``K`` is our
    ``out_features``, its ``N`` our ``in_features``.)
    """
    i, o = in_features, out_features
    if recipe.startswith("fp8_rowwise"):
        if i <= 2048 or o <= 1024 or (i <= 4096 and o <= 2048):
            return "row-wise scaling: in <= 2048, out <= 1024, or in <= 4096 and out <= 2048"
        return None
    if o <= 4096 and i <= 1024:
        return "per-tensor scaling: out <= 4096 and in <= 1024"
    return None


def _keep_by_size(
    policy: PrecisionPolicy, sized: dict[str, tuple[int, int]], recipe: str, decision: PolicyDecision
) -> None:
    device = DEVICE_NAME()
    if device is None:
        decision.notes.append(
            f"quant.policy.by_size={policy.by_size}: no CUDA device, so no FP8 GEMM speed to compare: nothing "
            "kept by size"
        )
        return
    table_path = AUTO_TABLE() if policy.by_size == "auto" else Path(policy.by_size)
    table = read_gemm_table(table_path) if policy.by_size != "auto" or table_path.is_file() else {}
    measured = table.get(device)
    if measured is None and policy.by_size != "auto":
        raise ConfigError(
            f"quant.policy.by_size={policy.by_size!r}: the GEMM table has no measurement for device {device!r} "
            f"(it has {sorted(table)}); measure it with benchmarks/gemm_table.py, or use by_size=auto"
        )
    if measured is None:
        decision.notes.append(
            f"quant.policy.by_size=auto: no GEMM measurement for device {device!r} in {table_path}: the rule "
            "of thumb torchtitan uses kept the small layers (measure the device with benchmarks/gemm_table.py)"
        )
        for name, (i, o) in sized.items():
            why = small_for_fp8(i, o, recipe)
            if why is not None:
                decision.kept[name] = f"{SIZE_WHY}{i}x{o} (in x out) is small for FP8 by the rule of thumb ({why})"
        return
    require_that(
        policy.tokens > 0, "policy.tokens", policy.tokens, "the GEMMs' M (batch x sequence length per rank) > 0",
        why="the GEMM table rule predicts each layer's gain at the run's token count",
    )  # fmt: skip
    kept = 0
    for name, (i, o) in sized.items():
        gain = predicted_gain(measured, policy.tokens, i, o)
        if gain < policy.min_gain:
            kept += 1
            decision.kept[name] = (
                f"{SIZE_WHY}predicted FP8 gain {gain:.2f}x < min_gain {policy.min_gain:g} at {i}x{o} (in x out), "
                f"{policy.tokens} tokens (GEMM table {table_path}, {device})"
            )
    decision.notes.append(
        f"quant.policy.by_size: GEMM table {table_path} for {device!r} at {policy.tokens} tokens kept {kept} of "
        f"{len(sized)} layer(s) predicted to gain less than {policy.min_gain:g}x"
    )


def predicted_gain(measured: list[GemmMeasurement], tokens: int, in_features: int, out_features: int) -> float:
    """The predicted speed-up of FP8 over bf16 for one Linear's three GEMMs a step (forward,
    input gradient, weight gradient) at ``tokens`` rows: summed bf16 time / summed FP8 time."""
    m, k, n = tokens, in_features, out_features
    bf16 = fp8 = 0.0
    for shape in ((m, n, k), (m, k, n), (n, k, m)):
        flops = 2.0 * shape[0] * shape[1] * shape[2]
        rate_bf16, rate_fp8 = _interpolated_rates(measured, shape)
        bf16 += flops / rate_bf16
        fp8 += flops / rate_fp8
    return bf16 / fp8


def _interpolated_rates(measured: list[GemmMeasurement], shape: tuple[int, int, int]) -> tuple[float, float]:
    """(bf16, FP8) rates at ``shape``: the log rates of the nearest measured shapes, weighted by
    inverse squared distance in ``log2`` space (an exact match is its own rate)."""
    point = [math.log2(s) for s in shape]
    distances = [
        (sum((math.log2(s) - p) ** 2 for s, p in zip((g.m, g.n, g.k), point, strict=True)), g) for g in measured
    ]
    near = sorted(distances, key=lambda pair: pair[0])[:_NEAREST]
    if near[0][0] == 0.0:
        return near[0][1].rates()
    weights = [1.0 / d for d, _ in near]
    logs = [[math.log(r) for r in g.rates()] for _, g in near]
    total = sum(weights)
    return tuple(math.exp(sum(w * lr[j] for w, lr in zip(weights, logs, strict=True)) / total) for j in (0, 1))


def read_gemm_table(path: Path | str) -> dict[str, list[GemmMeasurement]]:
    """The GEMM table file at ``path`` (YAML or JSON): device name -> its measured shapes.

    The file holds ``format: lightning_fp8state.gemm_table``, ``version: 1`` and ``devices``, a
    mapping from the device name (as ``torch.cuda.get_device_name()`` gives it) to a mapping with
    ``shapes``: a list of ``{m, n, k, bf16_ms, fp8_ms[, cast_ms]}``. Other keys (``torch``,
    ``measured``, a top-level ``example``) are notes, not read.

    Raises:
        ConfigError: the file is missing, unreadable or not of this format, naming what is wrong.
    """
    path = Path(path)
    require_that(path.is_file(), "policy.by_size", repr(str(path)), "a GEMM table file that exists")
    require_that(str(path).endswith(TABLE_SUFFIXES), "policy.by_size", repr(str(path)), f"a {TABLE_SUFFIXES} file")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else _yaml_load(text)
    except ValueError as exc:  # JSON's parse error (YAML's is turned into a ConfigError by _yaml_load)
        raise ConfigError(f"GEMM table {path}: cannot parse it ({exc})") from exc
    where = f"GEMM table {path}"
    require_that(isinstance(data, dict), where, type(data).__name__, "a mapping")
    require_that(
        data.get("format") == GEMM_TABLE_FORMAT, f"{where}: format", repr(data.get("format")), repr(GEMM_TABLE_FORMAT)
    )
    require_that(data.get("version") == 1, f"{where}: version", repr(data.get("version")), "1")
    devices = data.get("devices") or {}
    require_that(isinstance(devices, dict), f"{where}: devices", type(devices).__name__, "a mapping device -> shapes")
    return {str(name): _device_shapes(f"{where}: devices[{name!r}]", entry) for name, entry in devices.items()}


def _yaml_load(text: str):
    import yaml  # noqa: PLC0415  (PyYAML comes with omegaconf; read only when a table is)

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"a GEMM table cannot be parsed as YAML ({exc})") from exc


def _device_shapes(where: str, entry: object) -> list[GemmMeasurement]:
    shapes = entry.get("shapes") if isinstance(entry, dict) else None
    require_that(isinstance(shapes, list) and bool(shapes), f"{where}.shapes", repr(shapes), "a non-empty list")
    out = []
    for i, row in enumerate(shapes):
        key = f"{where}.shapes[{i}]"
        require_that(isinstance(row, dict), key, repr(row), "a mapping of m, n, k, bf16_ms, fp8_ms[, cast_ms]")
        for dim in ("m", "n", "k"):
            value = row.get(dim)
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            require_that(ok, f"{key}.{dim}", repr(value), "a positive integer")
        for time in ("bf16_ms", "fp8_ms", "cast_ms"):
            value = row.get(time, 0.0 if time == "cast_ms" else None)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (value >= 0 if time == "cast_ms" else value > 0)
            require_that(
                ok, f"{key}.{time}", repr(value), "a finite time in ms" + (" >= 0" if time == "cast_ms" else " > 0")
            )
        out.append(
            GemmMeasurement(row["m"], row["n"], row["k"], row["bf16_ms"], row["fp8_ms"], row.get("cast_ms", 0.0))
        )
    return out
