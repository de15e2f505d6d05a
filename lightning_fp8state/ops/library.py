"""The ``fp8state`` torch.library: op schemas, input checks, reference and fake kernels.

Schemas live here in Python. Every op returns a new contiguous tensor, whatever the
input's layout (the fake kernels say so too, for torch.compile). The reference implementation is registered as
``CompositeExplicitAutograd`` so it serves every device until a backend kernel (the CUDA
one from ``csrc/``, registered with ``TORCH_LIBRARY_IMPL(fp8state, CUDA, m)``) overrides it.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from ..config import AMAX_ALGOS, MARGIN_MAX, require_that
from ..formats import FP8_FORMATS
from . import reference as ref

__all__ = [
    "LIB",
    "SATURATION_ARG",
    "check_quantize_args",
    "check_update_args",
    "count_clips",
    "encode_record",
    "define_from",
    "register_fake_from",
]

LIB = torch.library.Library("fp8state", "DEF")


def define_from(name: str, signature, *, mutates_args=(), returns: str | None = None, tags=()) -> None:
    """Define the op ``fp8state::<name>`` with the schema read from the Python function
    ``signature``'s annotated arguments: the one place they are written (the CUDA kernel that
    ``csrc/`` registers for the op takes the same arguments in order). ``returns`` names the
    results where annotations cannot (optional tensors)."""
    prototype = inspect.signature(signature, eval_str=True)
    if returns is not None:  # infer the arguments only, then name the results
        prototype = prototype.replace(return_annotation=None)

    def carrier(*args, **kwargs):  # holds the resolved signature for torch's inference
        raise NotImplementedError

    carrier.__signature__ = prototype
    schema = torch.library.infer_schema(carrier, mutates_args=mutates_args)
    if returns is not None:
        schema = schema.rsplit(" -> ", 1)[0] + f" -> {returns}"
    # a Python int is inferred as SymInt; the kernels take plain integers (no symbolic shapes)
    schema = schema.replace("SymInt", "int")
    LIB.define(name + schema, tags=tags)


def register_fake_from(name: str, signature):
    """Register the decorated function as the fake (meta) kernel of ``fp8state::<name>``,
    defined from ``signature`` (:func:`define_from`): it receives the call's arguments bound by
    name, defaults applied, as one namespace, so the op's argument list is not written again."""
    bind = inspect.signature(signature).bind

    def register(fake):
        def run(*args, **kwargs):
            bound = bind(*args, **kwargs)
            bound.apply_defaults()
            return fake(SimpleNamespace(**bound.arguments))

        torch.library.register_fake(f"fp8state::{name}")(run)
        return fake

    return register


# The recording quantize ops' last argument: the owners' saturation counter ``int64 [2, owners]``
# (row 0: elements clipped, ``|float32(x) * scale| > fmax``, an infinity included, NaN not; row 1:
# elements quantized), whose column ``slot`` the op adds to in place, on the device, as it
# records the amax: no host sync, so a CUDA graph replays it (bank.saturation; telemetry reads it).
SATURATION_ARG = "Tensor(b!)? saturation=None"

LIB.define("quantize_fp8(Tensor x, Tensor scale, ScalarType dtype) -> Tensor")
LIB.define(
    "quantize_fp8_record_amax(Tensor x, Tensor scale, Tensor(a!) amax_pending, int slot, ScalarType dtype, "
    f"{SATURATION_ARG}) -> Tensor"
)
LIB.define("dequantize_fp8(Tensor q, Tensor descale, ScalarType dtype) -> Tensor")
# the batched scale update: its arguments are the CPU reference's (one signature, read from it)
UPDATE_SCALES_STATE = ("amax_history", "scale", "descale", "amax_pending", "nonfinite_count")
define_from("update_scales", ref.update_scales_reference, mutates_args=UPDATE_SCALES_STATE)

LIB.define("transpose_fp8(Tensor q) -> Tensor")
LIB.define(
    "quantize_fp8_t_record_amax(Tensor x, Tensor scale, Tensor(a!) amax_pending, int slot, ScalarType dtype, "
    f"bool column_sum, {SATURATION_ARG}) -> (Tensor, Tensor, Tensor)"
)

_FP8_DTYPES = tuple(f.dtype for f in FP8_FORMATS.values())
_IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_scalar(name: str, t: torch.Tensor, device: torch.device) -> None:
    require_that(t.dtype == torch.float32, f"{name}.dtype", t.dtype, "torch.float32")
    require_that(t.numel() == 1, f"{name}.numel()", t.numel(), "1")
    require_that(t.device == device, f"{name}.device", t.device, str(device))


def check_quantize_args(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """Validate the arguments shared by the quantize ops."""
    require_that(x.dtype in _IN_DTYPES, "x.dtype", x.dtype, f"one of {list(_IN_DTYPES)}")
    require_that(dtype in _FP8_DTYPES, "dtype", dtype, f"one of {list(_FP8_DTYPES)}")
    _check_scalar("scale", scale, x.device)


def _check_pending(amax_pending: torch.Tensor, slot: int, device: torch.device) -> None:
    require_that(amax_pending.dtype == torch.float32, "amax_pending.dtype", amax_pending.dtype, "torch.float32")
    require_that(amax_pending.dim() == 1, "amax_pending.dim()", amax_pending.dim(), "1")
    require_that(amax_pending.device == device, "amax_pending.device", amax_pending.device, str(device))
    require_that(0 <= slot < amax_pending.numel(), "slot", slot, f"0 <= slot < {amax_pending.numel()}")


def _check_saturation(saturation: torch.Tensor | None, amax_pending: torch.Tensor, device: torch.device) -> None:
    if saturation is None:
        return
    want = (2, amax_pending.numel())
    require_that(saturation.dtype == torch.int64, "saturation.dtype", saturation.dtype, "torch.int64")
    require_that(saturation.dim() == 2, "saturation.dim()", saturation.dim(), "2")
    require_that(tuple(saturation.shape) == want, "saturation.shape", tuple(saturation.shape), str(want))
    require_that(saturation.device == device, "saturation.device", saturation.device, str(device))


def count_clips(
    saturation: torch.Tensor | None, slot: int, y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> None:
    """Add the encode of ``y`` (the values the op quantizes) to column ``slot`` of the
    ``saturation`` counter: its clipped elements (:func:`~.reference.clip_count_reference`) to
    row 0, its element count to row 1. Nothing without a counter."""
    if saturation is None:
        return
    counts = torch.stack([ref.clip_count_reference(y, scale, dtype), torch.tensor(y.numel(), device=y.device)])
    saturation[:, slot].add_(counts.to(saturation.device))


def encode_record(y, scale, dtype, amax_pending, slot: int, saturation) -> torch.Tensor:
    """A recording quantize op's reference on the values it encodes, ``y`` (a prologue op's: its
    prologue's output): the codes, ``max|y|`` folded into ``amax_pending[slot]`` (NaN sticks),
    the clips counted into ``saturation``."""
    cell = amax_pending.narrow(0, slot, 1)
    cell.copy_(ref.canonical_nan(torch.maximum(cell, ref.amax_reference(y).reshape(1))))
    count_clips(saturation, slot, y, scale, dtype)
    return ref.quantize_fp8_reference(y, scale, dtype).contiguous()


_UPDATE_SIGNATURE = inspect.signature(ref.update_scales_reference)
# the state tensors (one column per owner) and the dtype each must have
_UPDATE_TENSORS = (
    ("amax_history", torch.float32),
    ("scale", torch.float32),
    ("descale", torch.float32),
    ("amax_pending", torch.float32),
    ("nonfinite_count", torch.int32),
    ("commit_mask", torch.bool),
    ("fmax", torch.float32),
)


def check_update_args(*args, **kwargs) -> None:
    """Validate the batched scale update's arguments (shapes, dtypes, devices, values), bound by
    name to the signature of its CPU reference (where the arguments are written once)."""
    a = _UPDATE_SIGNATURE.bind(*args, **kwargs).arguments
    history = a["amax_history"]
    require_that(history.dim() == 2, "amax_history.dim()", history.dim(), "2 ([history_len, owners])")
    n, device = history.shape[1], history.device
    for name, dtype in _UPDATE_TENSORS:
        t = a[name]
        require_that(t.dtype == dtype, f"{name}.dtype", t.dtype, str(dtype))
        require_that(t.device == device, f"{name}.device", t.device, str(device))
        if name != "amax_history":
            require_that(tuple(t.shape) == (n,), f"{name}.shape", tuple(t.shape), f"({n},)")
    require_that(a["amax_algo"] in AMAX_ALGOS, "amax_algo", repr(a["amax_algo"]), f"one of {list(AMAX_ALGOS)}")
    require_that(0 <= a["margin"] <= MARGIN_MAX, "margin", a["margin"], f"an integer >= 0 and <= {MARGIN_MAX}")


@torch.library.impl(LIB, "quantize_fp8", "CompositeExplicitAutograd")
def _quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    check_quantize_args(x, scale, dtype)
    return ref.quantize_fp8_reference(x, scale, dtype).contiguous()


@torch.library.impl(LIB, "quantize_fp8_record_amax", "CompositeExplicitAutograd")
def _quantize_fp8_record_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_pending: torch.Tensor,
    slot: int,
    dtype: torch.dtype,
    saturation: torch.Tensor | None = None,
) -> torch.Tensor:
    check_quantize_args(x, scale, dtype)
    _check_pending(amax_pending, slot, x.device)
    _check_saturation(saturation, amax_pending, x.device)
    return encode_record(x, scale, dtype, amax_pending, slot, saturation)


@torch.library.impl(LIB, "dequantize_fp8", "CompositeExplicitAutograd")
def _dequantize_fp8(q: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    require_that(q.dtype in _FP8_DTYPES, "q.dtype", q.dtype, f"one of {list(_FP8_DTYPES)}")
    require_that(dtype in _IN_DTYPES, "dtype", dtype, f"one of {list(_IN_DTYPES)}")
    _check_scalar("descale", descale, q.device)
    return ref.dequantize_fp8_reference(q, descale, dtype).contiguous()


@torch.library.impl(LIB, "update_scales", "CompositeExplicitAutograd")
def _update_scales(*args) -> None:
    check_update_args(*args)
    ref.update_scales_reference(*args)


def check_transpose_args(q: torch.Tensor) -> None:
    """Validate ``transpose_fp8``'s argument: a 2-D FP8 tensor."""
    require_that(q.dtype in _FP8_DTYPES, "q.dtype", q.dtype, f"one of {list(_FP8_DTYPES)}")
    require_that(q.dim() == 2, "q.dim()", q.dim(), "2")


@torch.library.impl(LIB, "transpose_fp8", "CompositeExplicitAutograd")
def _transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    check_transpose_args(q)
    return ref.transpose_fp8_reference(q)


@torch.library.impl(LIB, "quantize_fp8_t_record_amax", "CompositeExplicitAutograd")
def _quantize_fp8_t_record_amax(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax_pending: torch.Tensor,
    slot: int,
    dtype: torch.dtype,
    column_sum: bool,
    saturation: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_that(x.dim() == 2, "x.dim()", x.dim(), "2")
    q = _quantize_fp8_record_amax(x, scale, amax_pending, slot, dtype, saturation)
    sums = ref.column_sum_reference(x) if column_sum else x.new_empty((0,), dtype=torch.float32)
    return q, ref.transpose_fp8_reference(q), sums


@torch.library.register_fake("fp8state::quantize_fp8_t_record_amax")
def _quantize_fp8_t_record_amax_fake(x, scale, amax_pending, slot, dtype, column_sum, saturation=None):
    require_that(x.dim() == 2, "x.dim()", x.dim(), "2")
    rows, cols = x.shape
    sums = x.new_empty((cols if column_sum else 0,), dtype=torch.float32)
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty((cols, rows), dtype=dtype), sums


@torch.library.register_fake("fp8state::transpose_fp8")
def _transpose_fp8_fake(q):
    check_transpose_args(q)
    return q.new_empty((q.shape[1], q.shape[0]))


@torch.library.register_fake("fp8state::quantize_fp8")
def _quantize_fp8_fake(x, scale, dtype):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("fp8state::quantize_fp8_record_amax")
def _quantize_fp8_record_amax_fake(x, scale, amax_pending, slot, dtype, saturation=None):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("fp8state::dequantize_fp8")
def _dequantize_fp8_fake(q, descale, dtype):
    return torch.empty_like(q, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.register_fake("fp8state::update_scales")
def _update_scales_fake(*args):
    return None
