"""Device-side smoke check of the kernels' argument checks (run by hand on a GPU)."""

import torch

from lightning_fp8state import ops

ops.cuda.ensure_loaded()
x = torch.randn(8, device="cuda")
for args in [
    (x, torch.ones(1, device="cuda"), torch.zeros(2, device="cuda"), 2, torch.float8_e4m3fn),
    (x, torch.ones(1, device="cuda"), torch.zeros(2, device="cuda"), -1, torch.float8_e4m3fn),
]:
    try:
        ops.quantize_fp8_record_amax(*args)
    except ValueError as exc:
        print("ValueError:", exc)
