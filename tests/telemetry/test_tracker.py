"""TrainingTelemetry in a plain PyTorch loop: the non-finite guard, counting, dominant
source, clipping, effective throughput, host syncs, engine-reported skips."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fp8state.errors import ConfigError
from lightning_fp8state.telemetry import TrainingTelemetry, read_jsonl
from lightning_fp8state.telemetry.report import summarize
from tests.telemetry.helpers import FakeDeepSpeedEngine, TinyNet, assert_bitwise_same, regression_batches, snapshot


def make(tmp_path, fused=False, **kw):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    tel = TrainingTelemetry(tmp_path, model=model, **kw)
    return model, opt, tel


def backward(model, batch):
    x, y = batch
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("fused", [False, True], ids=["host_guard", "fused_device_guard"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_step_is_skipped_counted_and_changes_nothing(tmp_path, bad, fused):
    model, opt, tel = make(tmp_path, log_every=4, fused=fused)
    batches = regression_batches(8)
    for step, batch in enumerate(batches):
        loss = backward(model, batch)
        if step == 5:
            model.hidden.weight.grad[3, 1] = bad
            before = snapshot(model, opt)
        apply = tel.before_optimizer_step(opt, loss=loss, tokens=8)
        assert apply == (fused or step != 5)  # a fused optimizer skips on the device itself
        opt.step()  # called even on the skipped step, as Lightning does: it must be a no-op
        if step == 5:
            assert_bitwise_same(before, snapshot(model, opt))
        if step == 6:  # the next step applies again: the comparison above can see a change
            with pytest.raises(AssertionError, match="changed"):
                assert_bitwise_same(before, snapshot(model, opt))
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    assert (tel.attempted, tel.applied, tel.skipped) == (8, 7, 1)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["train/skipped"] for r in rows] == [0.0] * 5 + [1.0] + [0.0] * 2
    assert rows[5]["train/grad_finite"] == 0.0 and rows[4]["train/grad_finite"] == 1.0
    assert rows[5]["train/dominant_grad_source"] == "hidden"  # where the bad value is
    assert rows[-1]["train/steps_skipped"] == 1 and rows[-1]["train/steps_applied"] == 7
    assert rows[-1]["train/steps_nonfinite"] == 1
    assert rows[3]["train/steps_skipped_window"] == 0 and rows[7]["train/steps_skipped_window"] == 1
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters())


def test_without_the_guard_a_nonfinite_step_is_applied_and_reported(tmp_path):
    model, opt, tel = make(tmp_path, log_every=2, guard=False)
    for step, batch in enumerate(regression_batches(2)):
        loss = backward(model, batch)
        if step == 1:
            model.hidden.weight.grad[0, 0] = float("nan")
        assert tel.before_optimizer_step(opt, loss=loss)
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    assert math.isnan(float(model.hidden.weight.detach()[0, 0]))  # what the guard prevents
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert rows[1]["train/skipped"] == 0.0 and rows[1]["train/grad_finite"] == 0.0
    assert rows[1]["train/steps_nonfinite"] == 1 and rows[1]["train/steps_skipped"] == 0


@pytest.mark.parametrize("by, expected", [("layer", "embed"), ("parameter", "embed.weight")])
def test_dominant_source_names_the_layer_made_largest(tmp_path, by, expected):
    model, opt, tel = make(tmp_path, log_every=3, dominant_by=by)
    model.embed.weight.register_hook(lambda g: g * 1000.0)
    for batch in regression_batches(3):
        loss = backward(model, batch)
        tel.before_optimizer_step(opt, loss=loss)
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/dominant_grad_source"] for r in rows] == [expected] * 3
    assert all(r["train/dominant_grad_share"] > 0.99 for r in rows)


def test_clipping_is_applied_with_the_measured_norm_and_events_counted(tmp_path):
    model, opt, tel = make(tmp_path, log_every=10, max_grad_norm=0.5)
    pre_norms, post_norms = [], []
    for batch in regression_batches(10):
        loss = backward(model, batch)
        for p in model.parameters():
            p.grad.mul_(float(torch.rand(())) * 2)  # some steps above the threshold, some below
        pre_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        tel.before_optimizer_step(opt, loss=loss)
        post_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/grad_norm"] for r in rows] == pytest.approx(pre_norms, rel=1e-5)  # before clipping
    assert all(n <= 0.5 * (1 + 1e-5) for n in post_norms)
    events = sum(n > 0.5 for n in pre_norms)
    assert 0 < events < 10
    assert rows[-1]["train/clip_events"] == events
    assert [r["train/clipped"] for r in rows] == [float(n > 0.5) for n in pre_norms]


@pytest.mark.parametrize("fused", [False, True], ids=["host_guard", "fused_device_guard"])
def test_effective_throughput_counts_applied_steps_only(tmp_path, fused):
    model, opt, tel = make(tmp_path, log_every=4, fused=fused)
    for step, batch in enumerate(regression_batches(8)):
        loss = backward(model, batch)
        if step in (1, 2, 6):
            model.head.bias.grad[0] = float("nan")
        if tel.before_optimizer_step(opt, loss=loss, tokens=100 + step):
            opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    logs = [r for r in read_jsonl(tmp_path / "telemetry.jsonl") if "train/tokens_per_s" in r]
    assert [r["step"] for r in logs] == [4, 8]
    # same window, same seconds: the ratio is exactly effective tokens / raw tokens
    assert logs[0]["train/effective_tokens_per_s"] / logs[0]["train/tokens_per_s"] == pytest.approx((100 + 103) / 406)
    assert logs[1]["train/effective_tokens_per_s"] / logs[1]["train/tokens_per_s"] == pytest.approx(
        (104 + 105 + 107) / 422
    )
    assert logs[1]["train/steps_applied_window"] == 3 and logs[1]["train/steps_skipped_window"] == 1


class _HostReads:
    """Counts tensor-to-host conversions (item, tolist, cpu, bool/float/int) while active."""

    NAMES = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def wrapper(t, *a, _orig=original, **k):
                if self.active:
                    self.count += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


@pytest.mark.parametrize(
    "guard, fused, per_step", [(False, False, 0), (True, False, 1), (True, True, 0)], ids=["off", "host", "device"]
)
def test_host_reads_only_on_log_steps_plus_the_guards_one(tmp_path, monkeypatch, guard, fused, per_step):
    model, opt, tel = make(tmp_path, log_every=5, guard=guard, max_grad_norm=1.0, fused=fused)
    reads = _HostReads(monkeypatch)
    counts = []
    for batch in regression_batches(10):
        loss = backward(model, batch)
        reads.count, reads.active = 0, True
        tel.before_optimizer_step(opt, loss=loss, tokens=8)
        reads.active = False
        opt.step()  # the optimizer's own host reads are not ours
        opt.zero_grad()
        reads.active = True
        row = tel.after_optimizer_step()
        reads.active = False
        counts.append((reads.count, row is not None))
    assert [c for c, logged in counts if not logged] == [per_step] * 8
    assert all(c >= per_step + 1 for c, logged in counts if logged)  # the window's transfer


def test_engine_reported_skips_are_counted_like_guard_skips(tmp_path):
    """DeepSpeed fp16: the engine skips overflowing steps itself; telemetry reads its counter."""
    model, opt, tel = make(tmp_path, log_every=3, guard=False)
    engine = FakeDeepSpeedEngine()
    for step, batch in enumerate(regression_batches(6)):
        loss = backward(model, batch)
        tel.before_optimizer_step(opt, loss=loss, tokens=8)
        engine.step(overflow=step in (2, 3))
        opt.zero_grad()
        tel.after_optimizer_step(engine=engine)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/skipped"] for r in rows] == [0, 0, 1, 1, 0, 0]
    assert [r["train/steps_skipped_loss_scale"] for r in rows] == [0, 0, 1, 2, 2, 2]
    assert [r["train/loss_scale"] for r in rows] == [65536.0] * 2 + [32768.0, 16384.0] + [16384.0] * 2
    assert (tel.attempted, tel.applied, tel.skipped) == (6, 4, 2)
    assert rows[2]["train/effective_tokens_per_s"] / rows[2]["train/tokens_per_s"] == pytest.approx(2 / 3)


def test_counters_survive_a_state_dict_round_trip(tmp_path):
    model, opt, tel = make(tmp_path, log_every=2)
    for step, batch in enumerate(regression_batches(4)):
        loss = backward(model, batch)
        if step == 0:
            model.embed.bias.grad[0] = float("nan")
        tel.before_optimizer_step(opt, loss=loss)
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()
    resumed = TrainingTelemetry(tmp_path, model=model, log_every=2)
    resumed.load_state_dict(tel.state_dict())
    loss = backward(model, regression_batches(1)[0])
    resumed.before_optimizer_step(opt, loss=loss)
    resumed.after_optimizer_step()
    resumed.close()
    rows = read_jsonl(tmp_path / "telemetry.jsonl")  # appended to the same file
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["train/steps_skipped"] == 1 and rows[-1]["train/steps_applied"] == 4


def test_device_guard_counts_mid_window_for_a_checkpoint_and_leaves_no_flag_behind(tmp_path):
    """Fused AdamW: the skip is decided on the device; a state_dict taken between log steps
    still holds the exact counts, and the found_inf flag does not outlive its step."""
    model, opt, tel = make(tmp_path, log_every=10, fused=True)
    for step, batch in enumerate(regression_batches(3)):
        loss = backward(model, batch)
        if step == 1:
            model.embed.bias.grad[0] = float("nan")
        assert tel.before_optimizer_step(opt, loss=loss, tokens=8)
        assert hasattr(opt, "found_inf")
        opt.step()
        opt.zero_grad()
        assert tel.after_optimizer_step() is None  # no log step yet
        assert not hasattr(opt, "found_inf")
    sd = tel.state_dict()
    assert (sd["attempted"], sd["applied"], sd["skipped"]) == (3, 2, 1)
    assert int(opt.state[model.embed.bias]["step"]) == 2  # the skipped step did not count
    before = snapshot(model, opt)
    backward(model, regression_batches(1, seed=1)[0])
    opt.step()  # a later step without telemetry applies: no stale flag
    with pytest.raises(AssertionError, match="changed"):
        assert_bitwise_same(before, snapshot(model, opt))
    tel.close()
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/skipped"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["train/steps_applied"] for r in rows] == [1, 1, 2]
    assert rows[-1]["train/steps_skipped_window"] == 1


@pytest.mark.parametrize("fused", [False, True], ids=["host_guard", "fused_device_guard"])
def test_a_window_reset_mid_window_keeps_every_rows_counts(tmp_path, fused):
    """reset_window() between log steps (a new throughput window, e.g. after setup) must not
    lose what the steps recorded so far say: their rows and counts are written at the flush."""
    model, opt, tel = make(tmp_path, log_every=4, fused=fused)
    for step, batch in enumerate(regression_batches(4)):
        loss = backward(model, batch)
        if step == 0:
            model.embed.bias.grad[0] = float("nan")
        tel.before_optimizer_step(opt, loss=loss, tokens=10)
        opt.step()
        opt.zero_grad()
        if step == 1:
            tel.reset_window()
        tel.after_optimizer_step()
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert [r["train/skipped"] for r in rows] == [1.0, 0.0, 0.0, 0.0]
    assert [r["train/steps_applied"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["train/window_steps"] == 3 and rows[-1]["train/steps_applied_window"] == 3  # steps 1-3


def test_a_fused_optimizer_that_loaded_a_non_fused_state_is_guarded_on_the_host(tmp_path):
    """load_state_dict takes the saved param groups' settings: an AdamW built fused that loads
    a non-fused one's state steps unfused, and its foreach path refuses a found_inf flag. The
    guard must see that and skip on the host."""
    model, opt, tel = make(tmp_path, log_every=2, fused=True)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    backward(model, regression_batches(1)[0])
    plain.step()
    opt.load_state_dict(plain.state_dict())
    assert opt._step_supports_amp_scaling and not opt.param_groups[0]["fused"]
    for step, batch in enumerate(regression_batches(2)):
        opt.zero_grad()
        loss = backward(model, batch)
        if step == 1:
            model.embed.bias.grad[0] = float("nan")
            before = snapshot(model, opt)
        applied = tel.before_optimizer_step(opt, loss=loss)
        assert not hasattr(opt, "found_inf") and applied == (step == 0)
        opt.step()
        tel.after_optimizer_step()
    assert_bitwise_same(before, snapshot(model, opt))
    assert (tel.applied, tel.skipped) == (1, 1)


def test_bad_arguments_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="log_every=0"):
        TrainingTelemetry(tmp_path, log_every=0)
    with pytest.raises(ConfigError, match="clip_algorithm='l1'"):
        TrainingTelemetry(tmp_path, clip_algorithm="l1")
    with pytest.raises(ConfigError, match="max_grad_norm=-1"):
        TrainingTelemetry(tmp_path, max_grad_norm=-1)


def _train(model, opt, tel, steps: int) -> None:
    for batch in regression_batches(steps):
        loss = backward(model, batch)
        tel.before_optimizer_step(opt, loss=loss, tokens=8)
        opt.step()
        opt.zero_grad()
        tel.after_optimizer_step()
    tel.close()


def test_a_cuda_models_log_rows_carry_the_allocators_peak_and_reserved_memory(tmp_path, monkeypatch):
    """On log steps, the model's CUDA device: the peak allocated since the process began (never
    reset here, so a user's own reading stays theirs) and the reserved memory, in GiB, read from the
    allocator's host counters. A CPU model's rows carry neither."""
    model, opt, tel = make(tmp_path, log_every=2)
    cuda0 = torch.device("cuda", 0)
    seen = []

    def peak(device):
        seen.append(device)
        return 3 * 2**30

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * 2**29)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: pytest.fail("the peak was reset"))
    monkeypatch.setattr(type(tel), "_model_device", lambda self: cuda0)
    _train(model, opt, tel, 4)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    logged = [r for r in rows if "train/mem_peak_gib" in r]
    assert [r["step"] for r in logged] == [2, 4]  # the windows' last rows
    assert all(r["train/mem_peak_gib"] == 3.0 and r["train/mem_reserved_gib"] == 2.5 for r in logged)
    assert seen == [cuda0, cuda0]
    assert summarize(rows)["peak memory GiB (CUDA, allocated)"] == 3.0  # fp8state report's table


def test_a_cpu_models_rows_carry_no_device_memory(tmp_path):
    model, opt, tel = make(tmp_path, log_every=2)
    assert tel._model_device() == torch.device("cpu")
    _train(model, opt, tel, 2)
    rows = read_jsonl(tmp_path / "telemetry.jsonl")
    assert not any("train/mem_peak_gib" in r for r in rows)
    assert not any("memory" in key for key in summarize(rows))
