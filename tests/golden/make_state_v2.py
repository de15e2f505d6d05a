"""Writes tests/golden/state_v2.pt: a centered NVFP4 attention quantizer (history_len 4) run for
three events on constant operands q = 1, 3, 2 and k = 4, 8, 2 (every channel equal). Rerun only
when the state format version changes."""

from pathlib import Path

import torch

import lightning_fp8state as f8s


def main() -> None:
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4, attn_centered=True, attn_center_momentum=0.5))
    quant = f8s.Fp4AttentionQuantizer(protocol=state, layer_name="attn")
    for step, (q, k) in enumerate(((1.0, 4.0), (3.0, 8.0), (2.0, 2.0))):
        with state.step(step):
            quant(torch.full((1, 32), q), torch.full((1, 32), k))
    torch.save(state.state_dict(), Path(__file__).with_name("state_v2.pt"))


if __name__ == "__main__":
    main()
