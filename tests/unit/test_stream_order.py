"""StreamOrder's waits, with stand-in streams (the real thing needs CUDA: tests/gpu/test_streams.py)."""

from __future__ import annotations

import torch

from lightning_fp8state.state import StreamOrder


class FakeStream:
    def __init__(self, ptr: int) -> None:
        self.device_index, self.cuda_stream = 0, ptr
        self.waited: list[int] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other.cuda_stream)


class SharedTensor:
    is_cuda = True

    def __init__(self) -> None:
        self.streams: list[int] = []

    def record_stream(self, stream: FakeStream) -> None:
        self.streams.append(stream.cuda_stream)


CUDA = torch.device("cuda", 0)


def test_one_stream_orders_nothing_and_a_second_stream_waits_for_structural_changes(monkeypatch):
    main, a, b = FakeStream(1), FakeStream(2), FakeStream(3)
    current = [a]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    order = StreamOrder()
    shared = SharedTensor()
    # one stream: register, freeze, use: no waits at all (the usual, single-stream case)
    order.enter(CUDA)
    order.structural(CUDA)
    order.use(CUDA, shared)
    assert not order.active and a.waited == [] and shared.streams == []
    # a second stream enters and uses the bank: it waits for the last structural change (on a)
    current[0] = b
    order.enter(CUDA)
    assert order.active
    order.use(CUDA, shared)
    assert b.waited == [2] and shared.streams == [3]
    # the commit on the main stream waits for everything queued on a and b
    current[0] = main
    order.structural(CUDA)
    assert sorted(main.waited) == [2, 3]
    # the next event's first use on a waits for the commit on main
    current[0] = a
    order.use(CUDA, shared)
    assert a.waited == [1]


def test_cpu_devices_are_never_ordered(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(device))
    order = StreamOrder()
    cpu = torch.device("cpu")
    order.enter(cpu)
    order.structural(cpu)
    order.use(cpu)
    assert calls == [] and not order.active
