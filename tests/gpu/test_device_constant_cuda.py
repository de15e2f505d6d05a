"""``state.bank.device_constant`` inside a CUDA graph capture, on the GPU.

A step captured again after a fallback move meets an owner set no eager event has seen; the
bank then makes that set's mask during the capture, where CUDA refuses a pageable host copy
(this failed the graphed fallback test on the H200). Made by captured fills, the constant holds
its host value from the first replay on, for every dtype the bank and the reduction use.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fp8state.state.bank import device_constant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "host",
    [
        torch.tensor([False, True, True, False, True, False, False, False, True]),
        torch.tensor([True] * 5),
        torch.randn(13),  # every element its own run
        torch.tensor([3.0, 3.0, -1.5, -1.5, -1.5, 7.0]),
        torch.tensor([], dtype=torch.bool),
    ],
)
def test_a_constant_made_during_a_capture_holds_its_value_after_replay(host):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = device_constant(host, "cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert out.dtype == host.dtype and out.shape == host.shape
    assert torch.equal(out.cpu(), host)
    assert torch.equal(device_constant(host, "cuda").cpu(), host)  # outside a capture: a copy
