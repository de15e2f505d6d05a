"""Writes tests/golden/state_v3.pt: format 3 adds "fallback". An Fp8Linear "0" (4 -> 4, no bias,
weight = identity, history_len 4, QuantConfig(fallback=True)) runs four events on x = 1; before
event 2 its weight's [0, 0] is set to 1e37 and its input's feature 1 to 1e8. Event 2 records those
amaxes; in event 3 the descale product (1e37/448 * 1e8/448) overflows float32, the output is
non-finite from finite operands, and "0" moves to high precision (reason nonfinite, step 3).
Rerun only when the state format version changes."""

from pathlib import Path

import torch

import lightning_fp8state as f8s


def main() -> None:
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4, fallback=True))
    fc = state.convert(torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False)))[0]
    with torch.no_grad():
        fc.weight.copy_(torch.eye(4))
    x = torch.ones(2, 4)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                fc.weight[0, 0] = 1e37
                x[:, 1] = 1e8
        with state.step(step):
            fc(x).sum().backward()
    torch.save(state.state_dict(), Path(__file__).with_name("state_v3.pt"))


if __name__ == "__main__":
    main()
