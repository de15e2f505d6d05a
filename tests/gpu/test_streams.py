"""Concurrent entry from two CUDA streams (written for H200s).

Two host threads, each bound to its own CUDA stream, run sub-batches through the same
Fp8Linear in the same logical events. With stream ownership each stream has its own state,
and the results equal, bitwise, running the sub-batches one after the other on separate
states; without it the second entry fails closed with ConcurrentEntryError.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (written for H200s)"),
]

N_EVENTS = 6
D = 64  # multiples of 16: torch._scaled_mm runs the FP8 GEMM on the GPU


def sub_batches(seed: int, loud: float):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, D, generator=g) * loud * (1.5**e)).cuda() for e in range(N_EVENTS)]


def make_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)).cuda()


def run_concurrently(state, model, xs):
    """One worker thread per stream; the main thread opens and closes each event."""
    streams = [torch.cuda.Stream() for _ in xs]
    outs = [[None] * N_EVENTS for _ in xs]
    errors: list[BaseException] = []
    start, done = threading.Barrier(len(xs) + 1), threading.Barrier(len(xs) + 1)

    def worker(i):
        streams[i].wait_stream(torch.cuda.default_stream())  # the inputs were made on the default stream
        with torch.cuda.stream(streams[i]):
            for e in range(N_EVENTS):
                try:
                    start.wait()
                except threading.BrokenBarrierError:  # the main thread raised a worker's error and ended the run
                    return
                try:
                    outs[i][e] = model(xs[i][e]).detach()
                except BaseException as exc:  # noqa: BLE001  (handed to the main thread)
                    errors.append(exc)
                torch.cuda.current_stream().synchronize()
                try:
                    done.wait()
                except threading.BrokenBarrierError:
                    return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    try:
        for e in range(N_EVENTS):
            with state.step(e):
                start.wait()
                done.wait()
                if errors:
                    raise errors[0]
    finally:
        start.abort()
        done.abort()
        for t in threads:
            t.join()
    torch.cuda.synchronize()
    return outs


def test_stream_ownership_equals_sequential_runs_on_separate_states_bitwise():
    xs = [sub_batches(1, 1.0), sub_batches(2, 8.0)]
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank_stream"))
    model = state.convert(make_layer())
    outs = run_concurrently(state, model, xs)
    assert state.ledger.ok
    streams = sorted({o.stream for o in state.bank.owners})
    assert len(streams) == 2
    solo_scales = []
    for i in range(2):
        solo = f8s.Fp8State(f8s.QuantConfig())
        solo_model = solo.convert(make_layer())
        for e in range(N_EVENTS):
            with solo.step(e):
                y = solo_model(xs[i][e]).detach()
            assert bitwise_equal(y, outs[i][e]), f"sub-batch {i} event {e}"
        solo_scales.append({(o.layer, o.role): solo.scale_of(o).cpu() for o in solo.bank.owners})
    # each stream's own state is, bitwise, the state of the solo run of its sub-batches
    # (which stream got which ordinal depends on which thread entered first)
    matched = []
    for stream in streams:
        mine = {(o.layer, o.role): state.scale_of(o).cpu() for o in state.bank.owners if o.stream == stream}
        hits = [i for i, solo in enumerate(solo_scales) if all(bitwise_equal(mine[k], solo[k]) for k in solo)]
        assert len(hits) == 1, f"stream {stream}: matches solo runs {hits}"
        matched += hits
    assert sorted(matched) == [0, 1]


def test_without_stream_ownership_the_second_stream_fails_closed():
    xs = [sub_batches(1, 1.0), sub_batches(2, 8.0)]
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank"))
    model = state.convert(make_layer())
    with pytest.raises(f8s.ConcurrentEntryError, match="per_layer_rank_stream"):
        run_concurrently(state, model, xs)
    assert state.event is None


def test_two_streams_with_backward_on_one_thread():
    """Sub-batches queued on two streams from one thread, then one backward: with stream
    ownership every owner (grad_output included) commits once per event."""
    state = f8s.Fp8State(f8s.QuantConfig(ownership="per_layer_rank_stream"))
    model = state.convert(make_layer())
    xs = [sub_batches(1, 1.0), sub_batches(2, 8.0)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for e in range(N_EVENTS):
        with state.step(e):
            ys = []
            for s, x in zip(streams, (xs[0][e], xs[1][e]), strict=True):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    ys.append(model(x.requires_grad_()))
            for s in streams:
                torch.cuda.current_stream().wait_stream(s)
            loss = sum(y.float().pow(2).mean() for y in ys)
            state.commit_forward()
            loss.backward()
    torch.cuda.synchronize()
    assert len(state.bank.owners) == 2 * 2 * 3
    for e in range(N_EVENTS):
        per_owner = state.ledger.event((e, 0))
        assert len(per_owner) == 12 and all(r.commits == 1 for r in per_owner.values())
    assert state.ledger.ok
