"""GraphedStep on the GPU: a training run replayed from a CUDA graph is bit-identical to the
same run stepped eagerly (losses, weights, the whole quantizer state), the ledger counts one
commit per owner per replayed event, a replay does not sync, and what would make a replay
disagree with its capture is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig
from tests.conftest import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=3, n_heads=4, checkpoint=True)
STEPS = 8


def batches(n, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), device="cuda", generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def build(mode="safe", capturable=True):
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=mode == "safe"))
    state.convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=capturable)
    return model, state, opt


def make_body(model, state):
    def body(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            state.commit_forward()
            loss.backward()
        return loss.detach()

    return body


def run_eager(data, mode="safe"):
    model, state, opt = build(mode)
    body = make_body(model, state)
    losses = []
    for n, (x, y) in enumerate(data):
        with state.step(n, 0):
            losses.append(body(x, y))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, state, torch.stack(losses)


def run_graphed(data, mode="safe", warmup=2):
    model, state, opt = build(mode)
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=warmup)
    losses = [graphed(n, x, y).clone() for n, (x, y) in enumerate(data)]
    return model, state, torch.stack(losses), graphed


def test_graphed_training_is_bit_identical_to_eager_and_counts_one_commit_per_owner():
    data = batches(STEPS)
    m_eager, s_eager, l_eager = run_eager(data)
    m_graph, s_graph, l_graph, graphed = run_graphed(data)
    assert graphed.replays == STEPS - 2 and graphed.eager_calls == 2
    assert bitwise_equal(l_eager, l_graph)
    for (name, p), q in zip(m_eager.named_parameters(), m_graph.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    a, b = s_eager.state_dict(), s_graph.state_dict()
    for key in ("amax_history", "scale", "descale", "amax_pending", "nonfinite_count"):
        assert bitwise_equal(a["bank"][key], b["bank"][key]), key
    assert a["clock"] == b["clock"] and a["ledger"]["commits"] == b["ledger"]["commits"]
    # the replays advanced every owner once per event, as the eager run did
    assert all(c == STEPS for c in b["ledger"]["commits"])
    for n in range(2, STEPS):
        records = s_graph.ledger.event((n, 0))
        assert records and all(r.commits == 1 for r in records.values())
    assert s_graph.ledger.ok
    # the history moved: a replay that skipped the commit would leave it as at the capture
    assert not bitwise_equal(b["bank"]["amax_history"][0], b["bank"]["amax_history"][1])


def test_graphed_naive_mode_still_differs_from_safe():
    """The capture records whatever the mode does: the seed's defect replays too."""
    data = batches(5)
    _, _, l_safe, _ = run_graphed(data, "safe")
    _, s_naive, l_naive, graphed = run_graphed(data, "naive")
    assert graphed.replays == 3
    assert not bitwise_equal(l_safe, l_naive)
    # the ledger counts the replayed defect too: second commits in every replayed event
    replayed = {v.event for v in s_naive.ledger.violations if v.kind == "second_commit"}
    assert {(2, 0), (3, 0), (4, 0)} <= replayed


def test_a_replay_does_not_sync():
    data = batches(4)
    model, state, opt = build()
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=1)
    graphed(0, *data[0])
    graphed(1, *data[1])  # the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphed(2, *data[2])
        graphed(3, *data[3])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_replays_refuse_what_would_disagree_with_the_capture():
    data = batches(4)
    model, state, opt = build()
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=1)
    graphed(0, *data[0])
    graphed(1, *data[1])
    saved = state.state_dict()
    state.load_state_dict(saved)  # reallocates the bank: the graph holds the old tensors
    with pytest.raises(f8s.StateTransitionError, match="reallocated"):
        graphed(2, *data[2])
    with pytest.raises(f8s.ConfigError, match=r"input 0: expected a tensor of shape \(4, 64\)"):
        f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=1)._load_inputs(
            (data[0][0][:2], data[0][1])
        )
    # events only move forward, replays included
    model, state, opt = build()
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=1)
    graphed(0, *data[0])
    graphed(1, *data[1])
    with pytest.raises(f8s.StateTransitionError, match="not after the last one"):
        graphed(1, *data[1])


def test_construction_refuses_auditors_and_non_capturable_optimizers():
    data = batches(1)
    model, state, opt = build(capturable=False)
    with pytest.raises(f8s.ConfigError, match="capturable=True"):
        f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt)
    model, state, opt = build()
    with f8s.RecomputeAuditor(state), pytest.raises(f8s.ConfigError, match="auditor"):
        f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt)


def test_capture_refuses_owners_first_seen_in_it():
    """An owner first seen at the capture would register (reallocating the bank) and calibrate
    on host decisions that a replay cannot repeat: the capture fails with the reason."""
    data = batches(2)
    model, state, opt = build()
    graphed = f8s.GraphedStep(state, make_body(model, state), *data[0], optimizer=opt, warmup=1)
    graphed.eager_calls = 1  # skip the warm-up: no owner is registered yet
    with pytest.raises(f8s.StateTransitionError, match="first seen during a CUDA graph capture"):
        graphed(0, *data[0])
    assert state.clock.event is None  # the event was aborted, nothing committed


def test_the_capture_survives_another_thread_allocating_pinned_memory():
    """A DataLoader's pin-memory thread allocates pinned host memory at any time (cudaHostAlloc,
    illegal during a capture in the default "global" mode, which then fails for every thread):
    the capture is thread-local, so a thread pinning fresh buffers throughout it does not
    invalidate it, and the run stays bitwise the eager one."""
    import threading  # noqa: PLC0415

    data = batches(5)
    _, _, l_eager = run_eager(data)
    stop = threading.Event()
    pinned = []

    def pin_forever():  # what the pin-memory thread does: pin a batch, copy it, let it go
        stream = torch.cuda.Stream()
        size = 1 << 16
        with torch.cuda.stream(stream):
            while not stop.is_set():
                size = size * 2 if size < (1 << 26) else 1 << 16  # new sizes: fresh cudaHostAlloc calls
                host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                pinned.append(host.to("cuda", non_blocking=True))  # reuse of its block queries an event
                del host
                if len(pinned) > 4:
                    pinned.pop(0)

    thread = threading.Thread(target=pin_forever, daemon=True)
    thread.start()
    try:
        model, state, l_graph, graphed = run_graphed(data)
    finally:
        stop.set()
        thread.join()
    assert graphed.replays == 3
    assert bitwise_equal(l_eager, l_graph)
