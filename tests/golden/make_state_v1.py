"""Writes tests/golden/state_v1.pt: a one-Linear model run for three events whose inputs
have amax 4, 2 and 8 (history_len 4). Rerun only when the state format version changes."""

from pathlib import Path

import torch
from torch import nn

import lightning_fp8state as f8s


def main() -> None:
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig(history_len=4))
    model = state.convert(nn.Sequential(nn.Linear(4, 4, bias=False)))
    for step, amax in enumerate((4.0, 2.0, 8.0)):
        x = torch.tensor([[amax, -0.5, 0.25, 1.0]])
        with state.step(step):
            model(x).sum().backward()
    torch.save(state.state_dict(), Path(__file__).with_name("state_v1.pt"))


if __name__ == "__main__":
    main()
