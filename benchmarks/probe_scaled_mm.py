"""Probe: does torch._scaled_mm accept FP8 scale pointers at 4-byte vs 16-byte offsets?

Found on the H200 (2026-11-30): a 4-byte offset fails with CUBLAS_STATUS_NOT_SUPPORTED, 16 runs.
"""

import torch

a = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(512, 256, device="cuda").to(torch.float8_e4m3fn).t()
buf = torch.ones(64, device="cuda")
for off in (0, 1, 4):
    try:
        torch._scaled_mm(a, b, scale_a=buf[off], scale_b=buf[off + 8], out_dtype=torch.bfloat16)
        print("offset", off, "ok")
    except RuntimeError as e:
        print("offset", off, "FAIL", str(e)[:80])
