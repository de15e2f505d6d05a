"""One source for each config rule: QuantConfig / GPTConfig, the op checks and the CUDA
kernels' checks read the same bounds and choices (CPU; the kernels' checks are read from
their source)."""

from __future__ import annotations

import re

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state import ops
from lightning_fp8state.config import (
    AMAX_ALGOS,
    CENTER_MOMENTUM_MAX,
    FP4_LAYOUT_NAMES,
    FP8_NAMES,
    MARGIN_MAX,
)
from lightning_fp8state.formats import FP4_LAYOUTS, FP8_FORMATS
from lightning_fp8state.models import GPTConfig
from lightning_fp8state.recompute import ENGINES


def _source(name: str) -> str:
    return (ops.cuda.source_dir() / name).read_text()


def _update_args(margin: int) -> list:
    scale = torch.tensor([1.0, 2.0])
    return [
        torch.tensor([[4.0, 8.0]]),
        scale,
        1.0 / scale,
        torch.tensor([4.0, 8.0]),
        torch.zeros(2, dtype=torch.int32),
        torch.tensor([True, True]),
        torch.full((2,), 448.0),
        "max",
        margin,
    ]


def test_the_kernels_margin_bound_is_the_configs():
    """Before: margin=127 passed QuantConfig and the reference op, and failed in the kernel."""
    found = re.findall(r"FP8S_CHECK\(margin >= 0 && margin < (\d+),", _source("fp8_ops.cu"))
    assert found == [str(MARGIN_MAX + 1)]
    assert f8s.QuantConfig(margin=MARGIN_MAX).margin == MARGIN_MAX
    with pytest.raises(
        f8s.ConfigError, match=rf"margin={MARGIN_MAX + 1} is not allowed: expected an integer >= 0 and <= {MARGIN_MAX}"
    ):
        f8s.QuantConfig(margin=MARGIN_MAX + 1)
    args = _update_args(MARGIN_MAX)
    ops.update_scales(*args)  # the largest margin: 2**126 is a normal float32
    assert torch.isfinite(args[1]).all() and (args[1] > 0).all()
    with pytest.raises(
        ValueError, match=rf"margin={MARGIN_MAX + 1} is not allowed: expected an integer >= 0 and <= {MARGIN_MAX}"
    ):
        ops.update_scales(*_update_args(MARGIN_MAX + 1))


def test_the_kernels_momentum_bound_is_the_configs():
    found = re.findall(r"FP4S_CHECK\(momentum > 0\.0 && momentum <= ([0-9.]+),", _source("fp4_ops.cu"))
    assert [float(v) for v in found] == [CENTER_MOMENTUM_MAX]
    with pytest.raises(
        f8s.ConfigError, match=r"attn_center_momentum=1.5 is not allowed: expected a finite number in \(0, 1\]"
    ):
        f8s.QuantConfig(attn_center_momentum=1.5)
    center = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="momentum=1.5 is not allowed: expected 0 < momentum <= 1"):
        ops.update_centers(center, center.clone(), center.clone(), torch.tensor([True, False]), 1.5)


def test_the_kernels_amax_algorithms_are_the_configs():
    check = re.search(r'FP8S_CHECK\((amax_algo == .*?), "amax_algo"', _source("fp8_ops.cu"), re.S).group(1)
    assert tuple(re.findall(r'amax_algo == "(\w+)"', check)) == AMAX_ALGOS


def test_format_choices_are_the_formats_module():
    assert FP8_NAMES == tuple(FP8_FORMATS) == ("e4m3", "e5m2")
    assert FP4_LAYOUT_NAMES == tuple(FP4_LAYOUTS) == ("nvfp4", "mxfp4")
    with pytest.raises(
        f8s.ConfigError, match=r"backward_format='e3m4' is not allowed: expected one of \['e4m3', 'e5m2', 'auto'\]"
    ):
        f8s.QuantConfig(backward_format="e3m4")


def test_the_model_config_checks_its_choices_and_bounds_with_the_wrapper_s_engines():
    with pytest.raises(
        f8s.ConfigError, match=r"checkpoint_engine='jax' is not allowed: expected one of \['torch', 'deepspeed'\]"
    ):
        GPTConfig(checkpoint_engine="jax")
    with pytest.raises(f8s.ConfigError, match=r"engine='jax' is not allowed: expected one of \['torch', 'deepspeed'\]"):
        f8s.checkpoint(lambda t: t, torch.ones(1), engine="jax")
    assert ENGINES == ("torch", "deepspeed")
    with pytest.raises(f8s.ConfigError, match=r"d_model=30 is not allowed: expected a multiple of n_heads=4"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(f8s.ConfigError, match=r"vocab_size=1 is not allowed: expected an integer >= 2"):
        GPTConfig(vocab_size=1)
    with pytest.raises(f8s.ConfigError, match=r"n_layers=True is not allowed"):
        GPTConfig(n_layers=True)
    with pytest.raises(f8s.ConfigError, match=r"checkpoint='yes' is not allowed: expected true or false"):
        GPTConfig(checkpoint="yes")
