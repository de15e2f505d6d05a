"""The plain-PyTorch sinks: W&B offline (read back from the run's files) and the fan-out."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fp8state.telemetry import FanOut, JsonlSink, TrainingTelemetry, WandbSink, read_jsonl
from tests.telemetry.helpers import TinyNet, regression_batches, wandb_history


def test_wandb_sink_runs_offline_and_holds_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sink = WandbSink(tmp_path, project="sink-test")
    tel = TrainingTelemetry(tmp_path, model=model, log_every=2, sinks=[sink])
    losses = []
    for step, (x, y) in enumerate(regression_batches(4)):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if step == 1:
            model.head.weight.grad[0, 0] = float("inf")
        losses.append(float(loss.detach()))
        if tel.before_optimizer_step(opt, loss=loss, tokens=8):
            opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()  # finishes the W&B run
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = wandb_history(runs[0])
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert [h["train/loss"] for h in history] == losses
    assert [h["train/skipped"] for h in history] == [0, 1, 0, 0]
    assert math.isinf(history[1]["train/grad_norm"]) and history[1]["train/dominant_grad_source"] == "head"
    assert len(read_jsonl(tmp_path / "telemetry.jsonl")) == 4  # the JSONL next to it, always


def test_wandb_sink_rejects_unknown_modes(tmp_path):
    from lightning_fp8state.errors import ConfigError

    with pytest.raises(ConfigError, match="mode='cloud'"):
        WandbSink(tmp_path, mode="cloud")


class Broken:
    def write(self, rows):
        raise OSError("disk full")

    def close(self):
        pass


def test_a_broken_sink_warns_and_the_jsonl_is_still_written(tmp_path):
    fan = FanOut([Broken(), JsonlSink(tmp_path / "t.jsonl")])
    with pytest.warns(RuntimeWarning, match="Broken failed"):
        fan.write([{"step": 1}])
    with pytest.warns(RuntimeWarning, match="Broken failed to write steps 2..2"):
        fan.write([{"step": 2}])  # warned at every failure (issue 16: a full disk must not go quiet)
    fan.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "t.jsonl")] == [1, 2]


def test_the_wandb_log_reader_waits_for_a_record_still_being_written_and_refuses_a_corrupt_one():
    """The test helper that reads W&B's offline log: a last record not (fully) on disk yet
    ends the read (the caller reads again until the run's exit record); a bad record with
    more data after it is corruption."""
    import struct
    import zlib

    from tests.telemetry.helpers import _wandb_chunks

    def record(payload: bytes, kind: int = 1, crc: int | None = None) -> bytes:
        crc = zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF if crc is None else crc
        return struct.pack("<IHB", crc, len(payload), kind) + payload

    header = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    first, second = record(b"first"), record(b"second")
    assert list(_wandb_chunks(header + first + second)) == [b"first", b"second"]
    assert list(_wandb_chunks(header + first + second[:-3])) == [b"first"]  # still being written
    assert list(_wandb_chunks(header + first + second[:-3] + b"\0\0\0")) == [b"first"]  # zero-filled tail
    with pytest.raises(ValueError, match="corrupt W&B record"):
        list(_wandb_chunks(header + record(b"first", crc=1) + second))
