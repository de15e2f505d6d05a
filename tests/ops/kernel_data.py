"""Test data shared by the kernel tests (FP8 and FP4) on the GPU and in the host emulation."""

from __future__ import annotations

import torch

# Tensor scales from the smallest subnormal to near float32's maximum.
FULL_RANGE_SCALES = (2.0**-149, 2.0**-126, 1e-30, 2.0**-100, 1.0, 3.0, 1e30, 2.0**127, 3e38)


def full_range(shape, dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """Random signs and 3-bit mantissas (so that E2M1 ties occur as exact products); the
    binary exponents of row i lie in the 48 binades below a top that steps evenly from
    2^-149 (all subnormal) to 2^127 over the rows: block amaxes from every part of float32's
    range, and blocks holding elements that underflow or overflow once multiplied by the
    tensor scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = 1
    for d in shape[:-1]:
        rows *= d
    top = torch.linspace(-149, 127, rows, device=device).round().reshape(*shape[:-1], 1)
    e = (top - torch.randint(0, 48, shape, device=device, generator=g)).clamp(min=-149)
    m = 1.0 + torch.randint(0, 8, shape, device=device, generator=g).float() / 8
    sign = torch.where(torch.rand(shape, device=device, generator=g) < 0.5, -1.0, 1.0)
    return (sign * m * torch.exp2(e)).to(dtype)


def subnormal_tie_block() -> tuple[torch.Tensor, float]:
    """An MXFP4 block (float32) and tensor scale S where x * S rounds in float32's subnormal
    range onto an E2M1 tie: x = 699051 * 2^-149, S = 1.5, x * S = (2^20 + 0.5) * 2^-149 rounds
    to 2^-129 (ties to even), the block exponent clamps at -127 and the scaled value is exactly
    0.25, a tie that rounds to code 0; without the first rounding it would be 0.25 + 2^-23,
    code 1 (0.5). Returns (x of shape (1, 32), S)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 699051 * 2.0**-149
    x[0, 1] = -x[0, 0]
    return x, 1.5


# Bits of a negative quiet NaN, by input dtype (viewed as the signed integer of its width).
_NEG_NAN = {
    torch.float32: (torch.int32, -4194304),
    torch.bfloat16: (torch.int16, -64),
    torch.float16: (torch.int16, -512),
}


def put_negative_nan(block: torch.Tensor, index: int) -> None:
    """Write a NaN with its sign bit set (0xFFC00000 / 0xFFC0 / 0xFE00) at block[index]: the
    bit pattern exactly, since arithmetic may not keep a NaN's sign."""
    int_dtype, bits = _NEG_NAN[block.dtype]
    block.view(int_dtype)[index] = bits


def assert_beside_the_imported_package(src) -> None:
    """``src`` (the csrc/ the extension is built from) belongs to the imported package: inside it
    (an installed package) or at the root of the source checkout it sits in."""
    from pathlib import Path

    import lightning_fp8state

    package = Path(lightning_fp8state.__file__).resolve().parent
    checkout = package.parent / "csrc" if (package.parent / "pyproject.toml").is_file() else None
    assert src in (package / "csrc", checkout), (src, package)
