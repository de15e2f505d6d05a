"""Shared pieces of the telemetry tests: tiny models, state snapshots, a W&B offline-run reader."""

from __future__ import annotations

import copy
import json
import struct
import time
import zlib
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn


class TinyNet(nn.Module):
    """Three named layers, so the dominant gradient source has names to choose from."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(d, 32)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(torch.relu(self.embed(x)))))


def regression_batches(n: int, batch: int = 8, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)]


class TinyModule(pl.LightningModule):
    """A BoringModel-like regression module.

    ``nan_at``: optimizer steps (0-based ``global_step``) whose gradients get a NaN after
    backward. ``boost``: a layer whose gradient is multiplied (a gradient hook). Every loss
    it computes is kept in ``losses`` (the test's own record, independent of telemetry).
    ``state``: an Fp8State; the module converts its layers and opens one logical event per
    batch (what the Lightning Fp8StateCallback does). ``fused``: a fused AdamW.
    """

    def __init__(
        self,
        *,
        nan_at=(),
        boost: tuple[str, float] | None = None,
        state=None,
        n_batches: int = 16,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused  # AdamW(fused=True): the guard's skip is decided on the device
        torch.manual_seed(0)
        self.net = TinyNet()
        self.nan_at = set(nan_at)
        self.losses: list[float] = []
        self.state = state
        self.n_batches = n_batches
        if state is not None:
            state.convert(self.net)
        if boost is not None:
            layer, factor = boost
            for p in getattr(self.net, layer).parameters():
                p.register_hook(lambda g, f=factor: g * f)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.state is not None:
            self.state.begin_event(self.global_step, 0)

    def on_after_backward(self):
        if self.state is not None:
            self.state.end_event()
        if self.global_step in self.nan_at:
            self.net.hidden.weight.grad[0, 0] = float("nan")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=self.fused)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(regression_batches(self.n_batches), batch_size=None)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included); 0-d tensors too."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    )


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Deep copies of every parameter and every optimizer state tensor/value."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optim": copy.deepcopy(optimizer.state_dict()),
    }


def assert_bitwise_same(before: dict, after: dict) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, t in before["params"].items():
        assert bitwise_equal(t, after["params"][name]), f"parameter {name} changed"
    a, b = before["optim"], after["optim"]
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for idx, state in a["state"].items():
        assert state.keys() == b["state"][idx].keys()
        for key, value in state.items():
            other = b["state"][idx][key]
            if isinstance(value, torch.Tensor):
                assert bitwise_equal(value, other), f"optimizer state {idx}.{key} changed"
            else:
                assert value == other, f"optimizer state {idx}.{key} changed"


class _FakeFp16Optimizer:
    def __init__(self):
        self.cur_scale = 65536.0
        self.overflow = False


class FakeDeepSpeedEngine:
    """What the reader relies on in a DeepSpeed engine: skipped_steps, optimizer.cur_scale /
    overflow, get_global_grad_norm()."""

    def __init__(self):
        self.skipped_steps = 0
        self.optimizer = _FakeFp16Optimizer()
        self._norm = None

    def get_global_grad_norm(self):
        return self._norm

    def step(self, overflow: bool, norm=1.0):
        self.optimizer.overflow = overflow
        if overflow:
            self.skipped_steps += 1
            self.optimizer.cur_scale /= 2
        self._norm = norm


# -- W&B offline runs: the transaction log (.wandb) that `wandb sync` uploads ------------------
# wandb >= 0.18 writes runs from its Go core and ships no Python reader, so this reads the
# format directly: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
# records [crc32 (4), length (2), type (1), data], type FULL=1, FIRST=2, MIDDLE=3, LAST=4,
# where crc32 covers type + data. Each record is a wandb_internal_pb2.Record.
_BLOCK = 32768


def _wandb_chunks(data: bytes):
    if data[:4] != b":W&B" or struct.unpack("<HB", data[4:7]) != (0xBEE1, 0):
        raise ValueError("not a W&B transaction log")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        end = pos + 7 + length
        if end > len(data):
            return  # the writer is still writing this record: the caller reads again
        chunk = data[pos + 7 : end]
        pos = end
        if kind == 0 and length == 0:
            continue
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            if not any(data[end:]):
                return  # the last record, not fully on disk yet (seen in CI): read again
            raise ValueError(f"corrupt W&B record at byte {pos}")
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def wandb_history(run_file: Path, timeout: float = 60.0) -> list[dict]:
    """The history rows (``run.log`` calls) stored in an offline run's ``.wandb`` file.

    W&B's core process may still be writing after ``finish()`` returns, so this waits for
    the run's ``exit`` record (the last one written) before it answers.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        rows, finished = [], False
        for raw in _wandb_chunks(Path(run_file).read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append(
                    {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in record.history.item}
                )
            finished = finished or kind == "exit"
        if finished:
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_file} has no exit record after {timeout} s: the W&B run did not finish")
        time.sleep(0.1)
