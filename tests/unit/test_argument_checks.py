"""Every argument check of the package is a ``config.require_*`` helper: a bad value raises
``ConfigError`` naming the key, what was found and what is allowed (Lightning's own
arguments: ``tests/lightning/test_argument_checks.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.config import (
    require_bool,
    require_callable,
    require_choice,
    require_int,
    require_name,
    require_number,
    require_strings,
    require_type,
)
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.nn import linear_after
from lightning_fp8state.protocol import QuantProtocol
from lightning_fp8state.shipped import shipped_dir
from lightning_fp8state.state import LogicalClock
from lightning_fp8state.telemetry import TrainingTelemetry, WandbSink
from lightning_fp8state.telemetry.metrics import clip_event, source_groups


# -- the helpers ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: require_choice("k", "c", ("a", "b")), r"k='c' is not allowed: expected one of \['a', 'b'\]$"),
        (lambda: require_choice("k", True, (1, "auto")), r"k=True is not allowed: expected one of \[1, 'auto'\]$"),
        (lambda: require_choice("k", 1, (True,)), r"k=1 is not allowed: expected one of \[True\]$"),
        (lambda: require_int("k", 0, 1), r"k=0 is not allowed: expected an integer >= 1$"),
        (lambda: require_int("k", True, 0), r"k=True is not allowed: expected an integer >= 0$"),
        (lambda: require_int("k", 5, 0, 4), r"k=5 is not allowed: expected an integer >= 0 and <= 4$"),
        (lambda: require_int("k", "3", 1, optional=True), r"k='3' is not allowed: expected an integer >= 1 or None$"),
        (lambda: require_number("k", float("nan"), 0), r"k=nan is not allowed: expected a finite number >= 0$"),
        (lambda: require_number("k", 0, 0, low_open=True, why="w"), r"k=0 is not allowed: .* > 0 \(w\)$"),
        (lambda: require_bool("k", "yes"), r"k='yes' is not allowed: expected true or false$"),
        (lambda: require_type("k", 3, str, "a string"), r"k=3 is not allowed: expected a string$"),
        (lambda: require_type("k", True, int, "an int"), r"k=True is not allowed: expected an int$"),
        (lambda: require_type("k", nn.Sequential(nn.Linear(1, 1)), str, "a str"), r"k=<Sequential> is not allowed"),
        (lambda: require_callable("k", 3, "a function of the batch"), r"k=3 is not allowed: expected a function of"),
        (lambda: require_strings("k", "a*"), r"k='a\*' is not allowed: expected a list of strings$"),
        (lambda: require_strings("k", ["a", 1]), r"k=\['a', 1\] is not allowed: expected a list of strings$"),
        (lambda: require_strings("k", 5, optional=True), r"k=5 is not allowed: expected a list of strings or None$"),
        (lambda: require_name("k", ""), r"k='' is not allowed: expected a non-empty string$"),
    ],
)
def test_each_helper_names_the_key_what_was_found_and_what_is_allowed(check, message):
    with pytest.raises(ConfigError, match=message):
        check()


def test_the_helpers_let_good_values_through_and_normalize_what_they_return():
    require_choice("k", True, (True,))
    require_choice("k", 1, (1, "auto"))
    require_int("k", None, 1, optional=True)
    assert require_number("k", 2, 0) == 2.0 and require_number("k", None, 0, optional=True) is None
    require_type("k", True, (bool, int), "a flag")
    require_callable("k", len)
    assert require_strings("k", ["a", "b"]) == ("a", "b") and require_strings("k", None, optional=True) is None
    assert require_strings("k", (p for p in "ab")) == ("a", "b")
    require_name("k", "x")


# -- the checks that were written inline (ValueError, TypeError, StateTransitionError) ---
def _linear():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = nn.ModuleDict({"lin": nn.Linear(16, 8), "norm": nn.LayerNorm(16)})
    state.convert(model)
    return state, model


def _telemetry(tmp_path, **kwargs):
    TrainingTelemetry(tmp_path, write=False, **kwargs)


CASES = {
    "Fp8State config": (lambda tmp: f8s.Fp8State({"margin": 1}), r"config=\{'margin': 1\} .*expected a QuantConfig"),
    "QuantProtocol config": (
        lambda tmp: QuantProtocol("fp8_delayed"),
        r"config='fp8_delayed' is not allowed: expected a QuantConfig",
    ),
    "linear_after both": (
        lambda tmp: linear_after(nn.Linear(4, 4), torch.ones(4), norm=nn.LayerNorm(4), activation="gelu"),
        r"activation='gelu' is not allowed: expected one of \[None\] \(linear_after takes norm or activation",
    ),
    "linear_after activation": (
        lambda tmp: linear_after(nn.Linear(4, 4), torch.ones(4), activation="relu"),
        r"activation='relu' is not allowed: expected one of \['gelu', 'swiglu'\]",
    ),
    "Fp8Linear prologue": (
        lambda tmp: _linear()[1]["lin"](torch.ones(2, 16), prologue="tanh"),
        r"prologue='tanh' is not allowed: expected one of \[None, 'layer_norm', 'rms_norm', 'gelu', 'swiglu'\]",
    ),
    "Fp8Linear norm": (
        lambda tmp: _linear()[1]["lin"](torch.ones(2, 16), prologue="layer_norm", norm=nn.Identity()),
        r"norm=Identity\(\) is not allowed: expected an nn.LayerNorm",
    ),
    "Fp4AttentionQuantizer layer_name": (
        lambda tmp: f8s.Fp4AttentionQuantizer().bind(f8s.Fp8State(), ""),
        r"layer_name='' is not allowed: expected a non-empty string naming the layer",
    ),
    "source_groups by": (
        lambda tmp: source_groups(["a"], by="x"),
        r"by='x' is not allowed: expected one of \['layer', 'parameter'\]",
    ),
    "clip_event algorithm": (
        lambda tmp: clip_event(torch.ones(()), None, 1.0, "l1"),
        r"algorithm='l1' is not allowed: expected one of \['norm', 'value'\]",
    ),
    "clip_event max_abs": (
        lambda tmp: clip_event(torch.ones(()), None, 1.0, "value"),
        r"max_abs=None is not allowed: expected a tensor \(value clipping",
    ),
    "TrainingTelemetry log_every": (lambda tmp: _telemetry(tmp, log_every=True), r"log_every=True is not allowed"),
    "TrainingTelemetry clip_algorithm": (
        lambda tmp: _telemetry(tmp, clip_algorithm="l1"),
        r"clip_algorithm='l1' is not allowed: expected one of \['norm', 'value'\]",
    ),
    "TrainingTelemetry dominant_by": (
        lambda tmp: _telemetry(tmp, dominant_by="module"),
        r"dominant_by='module' is not allowed: expected one of \['layer', 'parameter'\]",
    ),
    "TrainingTelemetry max_grad_norm": (
        lambda tmp: _telemetry(tmp, max_grad_norm=float("inf")),
        r"max_grad_norm=inf is not allowed: expected a finite number > 0 or None",
    ),
    "WandbSink mode": (
        lambda tmp: WandbSink(tmp, mode="cloud"),
        r"mode='cloud' is not allowed: expected one of \['offline', 'online', 'disabled'\]",
    ),
    "shipped_dir name": (
        lambda tmp: shipped_dir("docs"),
        r"name='docs' is not allowed: expected one of \['csrc', 'configs', 'recipes'\]",
    ),
    "LogicalClock step": (lambda tmp: LogicalClock().begin(-1, 0), r"step=-1 is not allowed: .* >= 0"),
    "LogicalClock microbatch": (
        lambda tmp: LogicalClock().begin(0, 1.0),
        r"microbatch=1.0 is not allowed: expected an integer >= 0",
    ),
    "Fp8State.step microbatch": (
        lambda tmp: f8s.Fp8State().begin_event(0, microbatch=-1),
        r"microbatch=-1 is not allowed: expected an integer >= 0",
    ),
    "GraphedBlocks warmup": (
        lambda tmp: f8s.GraphedBlocks([nn.Linear(2, 2)], warmup=0),
        r"warmup=0 is not allowed: expected an integer >= 1 \(owners register",
    ),
    "GraphedStep state": (
        lambda tmp: f8s.GraphedStep("state", lambda: None),
        r"state='state' is not allowed: expected an Fp8State or None",
    ),
    "QuantConfig include": (
        lambda tmp: f8s.QuantConfig(include=["*", 3]),
        r"include=\['\*', 3\] is not allowed: expected a list of patterns",
    ),
    "register_role phase": (
        lambda tmp: __import__("lightning_fp8state.state.owner").state.owner.register_role("r", "sideways"),
        r"phase='sideways' is not allowed: expected one of \['forward', 'backward'\] \(the phase of role 'r'\)",
    ),
    "checkpoint engine": (
        lambda tmp: f8s.checkpoint(lambda x: x, torch.ones(1), engine="jax"),
        r"engine='jax' is not allowed: expected one of",
    ),
    "make_dataset source": (
        lambda tmp: __import__("lightning_fp8state.models").models.make_dataset(
            "csv", vocab_size=8, seq_len=4, length=2, seed=0
        ),
        r"data.source='csv' is not allowed: expected one of \['markov', 'text', 'bin'\]",
    ),
    "QuantConfig exclude": (lambda tmp: f8s.QuantConfig(exclude=5), r"exclude=5 is not allowed: expected a list"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_argument_is_a_config_error_naming_the_key(case, tmp_path):
    call, message = CASES[case]
    with pytest.raises(ConfigError, match=message):
        call(tmp_path)
