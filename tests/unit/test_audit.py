"""The auditor compares every recomputed call, also those whose output an early-stopped recompute
never produces (torch non-reentrant checkpoint's default), at their quantized operands; and it
reports module state that a recompute changes (BatchNorm's running statistics, an attribute
written in forward), naming module and buffer.

Before issue 17 the auditor compared outputs only: the last Linear of every checkpointed block
was "recomp 0 / OK" under early stop, and a defect there went unseen
(test_early_stopped_layer_is_compared, test_defect_in_an_early_stopped_layer_is_caught fail on
that auditor; it had no module-state report at all).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal, event_inputs, make_stack, run_events

N_EVENTS = 4
NONREENTRANT = [("torch", False), ("plain", False)]


@pytest.mark.parametrize("ckpt", NONREENTRANT, ids=["wrapper", "plain"])
def test_early_stopped_layer_is_compared(ckpt):
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(ckpt=ckpt))
    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, model, event_inputs(N_EVENTS))
    report = auditor.report()
    assert len(report.rows) == 4 * 2 * N_EVENTS
    # every call of every event was recomputed and compared ...
    assert all(r.recomputed for r in report.rows), report.format_table()
    # ... fc2 (the block's last Linear) through its operands only: early stop ended the
    # recompute inside its forward, before its output existed
    early = {r.layer for r in report.rows if not r.output_recomputed}
    assert early == {f"blocks.{i}.fc2" for i in range(4)}
    assert report.early_stopped == 4 * N_EVENTS
    assert all(r.operands_compared == 2 for r in report.rows)  # input and weight
    assert report.ok, report.format_table()


def test_early_stop_off_compares_outputs_of_every_layer():
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack())
    model.run_block = lambda block, x: torch_checkpoint(block, x, use_reentrant=False, early_stop=False)
    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, model, event_inputs(2))
    report = auditor.report()
    assert all(r.output_recomputed for r in report.rows) and report.early_stopped == 0
    assert report.ok


class DriftingBlock(nn.Module):
    """fc2's input is scaled by an attribute that forward increments: user code whose recompute
    differs from its forward (the last Linear's input only)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(x)) * (1.0 + 0.5 * self.calls))


def test_defect_in_an_early_stopped_layer_is_caught():
    torch.manual_seed(0)
    model = nn.Sequential(DriftingBlock(), DriftingBlock())
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)

    class Ckpt(nn.Module):
        def forward(self, x):
            for block in model:
                x = f8s.checkpoint(block, x)
            return x

    with f8s.RecomputeAuditor(state) as auditor:
        run_events(state, Ckpt(), event_inputs(2))
    report = auditor.report()
    assert not report.ok, report.format_table()  # the output-only auditor said OK here
    bad = {(r.layer, tuple(r.operand_mismatches)) for r in report.mismatches}
    assert bad == {("0.fc2", ("input",)), ("1.fc2", ("input",))}, report.format_table()
    assert all(not r.output_recomputed for r in report.mismatches)  # only the operands saw it
    assert all(r.max_abs_diff > 0 for r in report.mismatches)


class NormBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.bn(self.fc(x))))


@pytest.mark.parametrize("engine", ["wrapper", "plain", "reentrant", "sac", "compiled"])
def test_recompute_changing_module_state_is_reported(engine):
    torch.manual_seed(0)
    blocks = nn.ModuleList([NormBlock(), DriftingBlock()])
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(blocks)
    if engine == "compiled":  # the auditor's hooks run eagerly around the compiled blocks' ops
        torch._dynamo.reset()
        for block in blocks:
            block.compile(backend="aot_eager")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = blocks

        def forward(self, x):
            for block in self.blocks:
                # (the wrapper's restore_buffers off: the recompute's buffer updates then last)
                if engine in ("wrapper", "compiled"):
                    x = f8s.checkpoint(block, x, restore_buffers=False)
                elif engine == "sac":  # the auditor's copies stay out of SAC's op sequence
                    x = f8s.checkpoint(block, x, context_fn=f8s.selective_checkpoint_context(), restore_buffers=False)
                else:
                    x = torch_checkpoint(block, x, use_reentrant=engine == "reentrant")
            return x

    model = Model()
    with f8s.RecomputeAuditor(state, model=model) as auditor:
        run_events(state, model, event_inputs(2))
    report = auditor.report()
    where = {(c.event, c.module, c.name, c.kind) for c in report.state_changes}
    for event in [(0, 0), (1, 0)]:
        assert (event, "blocks.0.bn", "running_mean", "buffer") in where
        assert (event, "blocks.0.bn", "running_var", "buffer") in where
        assert (event, "blocks.0.bn", "num_batches_tracked", "buffer") in where
        assert (event, "blocks.1", "calls", "attribute") in where
    assert {c.module for c in report.state_changes} == {"blocks.0.bn", "blocks.1"}
    assert not report.ok
    assert "recompute changed buffer blocks.0.bn.running_mean" in report.format_table()


def test_no_state_change_without_recompute_or_with_stateless_modules():
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(NormBlock(), DriftingBlock()))
    with f8s.RecomputeAuditor(state, model=model) as auditor:  # not checkpointed: forward only
        run_events(state, model, event_inputs(2))
    assert auditor.report().state_changes == []
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(make_stack(ckpt=("torch", False)))
    with f8s.RecomputeAuditor(state, model=model) as auditor:
        run_events(state, model, event_inputs(2))
    report = auditor.report()
    assert report.state_changes == [] and report.ok


def test_engine_bookkeeping_attributes_are_not_model_state():
    """DeepSpeed ZeRO-3 counts ``ds_grads_remaining`` on each module per forward call by design
    (found on the H200: every recompute "changed" it): an engine's ``ds_*`` attributes are not
    reported, while the model's own attribute next to it still is."""

    class EngineDriven(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.ds_grads_remaining = 0  # what ZeRO-3's pre-forward hook keeps on a module
            self.calls = 0

        def forward(self, x):
            self.ds_grads_remaining += 1
            self.calls += 1
            return x + self.fc(x)

    torch.manual_seed(0)
    block = EngineDriven()
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(block)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return f8s.checkpoint(self.block, x)

    model = Model()
    with f8s.RecomputeAuditor(state, model=model) as auditor:
        run_events(state, model, event_inputs(2))
    names = {c.name for c in auditor.report().state_changes}
    assert names == {"calls"}


def test_auditing_a_model_leaves_its_fused_norms_fused():
    """RecomputeAuditor(model=...) hooks the model's modules; a hook on a norm would make the next
    Fp8Linear run the norm unfused (its fused prologue refuses a norm with hooks), so the audited
    run computed something else than the run it audits (gradients differed in the last bits)."""
    from lightning_fp8state.models import Llama, LlamaConfig

    def run(audit: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Llama(
            LlamaConfig(
                vocab_size=97,
                seq_len=16,
                d_model=64,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                ffn_hidden=128,
                fused_projections=True,
            )
        )
        state = f8s.Fp8State(f8s.QuantConfig(strict=False, exclude=["*lm_head"]))
        state.convert(model)
        idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        auditor = f8s.RecomputeAuditor(state, model=model) if audit else contextlib.nullcontext()
        with auditor, state.step(0):
            loss = model.loss(idx, idx.roll(-1, dims=1))
            state.commit_forward()
            loss.backward()
        assert not audit or auditor.report().ok
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert bitwise_equal(a, b)
