"""The benchmark scripts import and parse their arguments on a machine without a GPU (CPU).

They run on the device only, so nothing else in CI would notice a script broken by a
refactor of what it imports. ``--help`` exits before any CUDA work."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text())


def test_the_benchmarks_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"quantize.py", "quantize_fp4.py", "train_step.py", "linear_stack.py", "scaling.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports_and_parses_help(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their shared timing module
    monkeypatch.setattr("sys.argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_train_step_saturation_diagnostic_counts_clamped_elements_per_role(monkeypatch):
    """train_step.py --saturation (the open loss question's check): per role, the share of
    elements that encoding clamped. An input 100x above its history saturates almost all of
    it; the weights, whose scale fits them, do not."""
    import importlib

    import torch
    from torch import nn

    import lightning_fp8state as f8s

    monkeypatch.syspath_prepend(str(BENCH))
    train_step = importlib.import_module("train_step")
    torch.manual_seed(0)
    state = f8s.Fp8State(f8s.QuantConfig())
    model = state.convert(nn.Sequential(nn.Linear(32, 16, bias=False)))
    seen = []
    rows = []
    for step, gain in enumerate((1.0, 100.0)):
        with state.step(step):
            loss = model(torch.randn(64, 32) * gain).float().pow(2).mean()
            state.commit_forward()
            loss.backward()
        rows.append(train_step.saturation_by_role(state, seen))
    assert set(rows[1]) == {"input", "weight", "grad_output"}
    assert rows[1]["input"] > 0.9
    assert rows[1]["weight"] < 0.01 and rows[0]["input"] < 0.01


def test_fsdp_step_smoke_runs_every_variant_on_two_cpu_processes(tmp_path):
    """fsdp_step.py --smoke: a tiny GPT on two gloo processes, every variant in one run (torchao's
    printed as not measured on the CPU). Ours with FP8 all-gather sends fewer all-gather bytes than
    the same model gathered in fp32 (the weights travel as 1 byte an element), and both run the
    one amax all-reduce a step; the baseline none."""
    import json
    import subprocess
    import sys

    from tests.lightning.launch import launch_env

    out = tmp_path / "fsdp.json"
    env = launch_env() | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCH / "fsdp_step.py"), "--smoke", "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "torchao" in done.stdout and "not measured" in done.stdout
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"bf16", "torchao", "torchao_fp8ag", "ours_hpag", "ours"}
    assert not rows["torchao"]["measured"] and not rows["torchao_fp8ag"]["measured"]
    bf16, hp, ours = rows["bf16"], rows["ours_hpag"], rows["ours"]
    assert bf16["all_gather_bytes_per_step"] == hp["all_gather_bytes_per_step"] > ours["all_gather_bytes_per_step"]
    assert ours["all_reduces_per_step"] == hp["all_reduces_per_step"] == 1 and bf16["all_reduces_per_step"] == 0


def _fsdp_step_under_torch_2_11_recompute(rank, port, steps, block_inputs):
    """One gloo rank: fsdp_step.py's ``ours`` variant (bf16 root, float32 blocks, FP8 all-gather)
    under CPU bf16 autocast, with FSDP2 patched to behave as torch 2.11's does in a checkpoint's
    recompute: no cast of the unit's inputs (torch 2.13 casts them in the recompute too)."""
    import os
    import sys

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp._fully_shard import _fsdp_state as fsdp_state

    def pre_forward_2_11(self, module, args, kwargs):
        if self._training_state == fsdp_state.TrainingState.PRE_BACKWARD:
            for group in self._fsdp_param_groups:
                if not group.is_unsharded:
                    group.unshard()
                    group.wait_for_unshard()
            return args, kwargs  # torch 2.11: the inputs are not cast again
        return original(self, module, args, kwargs)

    original = fsdp_state.FSDPState._pre_forward
    fsdp_state.FSDPState._pre_forward = pre_forward_2_11
    sys.path.insert(0, str(BENCH))
    import fsdp_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        args = fsdp_step.parse(["--smoke", "--ours-block-inputs", block_inputs])
        args.param_dtype = "bf16"
        cfg = fsdp_step.GPTConfig(
            vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
        )
        model, state, opt, _ = fsdp_step.build("ours", cfg, args, torch.device("cpu"), rank)
        norm_forward = model.ln.forward  # the CPU LayerNorm takes no float32 input with bf16 weights
        model.ln.forward = lambda x: norm_forward(x.to(model.ln.weight.dtype))
        for i, (x, y) in enumerate(fsdp_step.batches(cfg, args.batch, steps, "cpu")):
            with state.step(i):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                state.commit_forward()
                loss.backward()  # the recompute saw other dtypes than the forward: CheckpointError
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("block_inputs", ["keep", "fp32"])
def test_fsdp_step_float32_blocks_recompute_under_torch_2_11_fsdp(block_inputs):
    """The H200 (torch 2.11) failed fsdp_step.py's ``ours`` variant with a CheckpointError: its
    float32 blocks under a bf16 root relied on FSDP2 casting their inputs, which torch 2.11's
    FSDP2 skips in a checkpoint's recompute. Neither way of feeding the blocks relies on that cast
    now: ``keep`` (the default) turns FSDP2's cast off and hands the blocks the root's bf16
    stream; ``fp32`` casts it with a pre-hook of the benchmark's own, which runs in the forward
    and the recompute alike."""
    from tests.distributed.spawn import spawn

    spawn(_fsdp_step_under_torch_2_11_recompute, (2, block_inputs), nprocs=1, timeout=240, what="FSDP2 processes")


def test_host_overhead_runs_on_the_cpu_with_the_kernels_stubbed():
    """host_overhead.py runs without a GPU (its purpose): every variant (fp8_blockwise's stubs
    too), eager and compiled, and the per-linear difference. In a subprocess: it replaces the
    kernels' entry points."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(BENCH / "host_overhead.py"), "--layers", "2", "--steps", "2", "--warmup", "1",
         "--variants", "plain", "safe", "blockwise"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    for mode in ("eager", "compile"):
        assert f"{mode:>8}  plain:" in out and f"{mode:>8}   safe:" in out and f"{mode:>8} blockwise:" in out
        assert f"{mode:>8}: safe adds" in out and f"{mode:>8}: blockwise adds" in out


def test_host_overhead_by_area_splits_each_variants_host_time():
    """``--by-area``: one column per (mode, variant), the areas' rows and a total that is their sum."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(BENCH / "host_overhead.py"), "--layers", "2", "--steps", "2", "--warmup", "1",
         "--modes", "eager", "--by-area"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    table = out.split("--- host time by area", 1)[1].splitlines()[1:]
    assert table[0].split() == ["area", "eager", "plain", "eager", "safe"]
    rows = {
        line.rsplit(None, 2)[0].strip(): [float(v) for v in line.split()[-2:]] for line in table[1:] if line.strip()
    }
    assert "ours: protocol, state, recompute" in rows and "total" in rows
    total = rows.pop("total")
    for col in (0, 1):
        assert abs(sum(r[col] for r in rows.values()) - total[col]) < 0.05 * total[col] + 0.05
    assert rows["ours: nn (modules, the linear call)"][1] > rows["ours: nn (modules, the linear call)"][0]


def test_memory_peak_replays_a_trace_to_its_peak(monkeypatch):
    """benchmarks/memory_peak.py on a hand-made trace of the recorder's shape: the peak is where
    the live bytes were highest (not the sum of every allocation), the blocks live then are
    the ones reported, grouped by their innermost frames of interest and by size."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH))
    memory_peak = importlib.import_module("memory_peak")

    def frames(*where):
        return [{"filename": f, "line": n, "name": fn} for f, n, fn in where]

    ours = frames(("/x/torch/nn/modules/module.py", 1, "_call_impl"), ("/x/lightning_fp8state/nn/linear.py", 9, "fwd"))
    theirs = frames(("/x/torch/optim/adam.py", 5, "_init_group"))
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 300, "frames": theirs},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 3, "size": 50, "frames": ours},  # live 350 < 400: not the peak
        {"action": "alloc", "addr": 4, "size": 200, "frames": ours},  # live 550: the peak
        {"action": "free_completed", "addr": 2, "size": 300, "frames": []},
        {"action": "alloc", "addr": 5, "size": 250, "frames": []},  # live 500
    ]
    peak, live = memory_peak.live_at_peak({"device_traces": [trace]})
    assert peak == 550
    assert sorted(ev["addr"] for ev in live) == [2, 3, 4]
    text = memory_peak.summarize({"device_traces": [trace]}, top=5)
    lines = text.splitlines()
    # Adam's block (300 bytes) first, then the linear's two (250), module.py's frame left out
    assert "     1 x" in lines[1] and "torch/optim/adam.py:5(_init_group)" in lines[1]
    assert "     2 x" in lines[2] and "lightning_fp8state/nn/linear.py:9(fwd)" in lines[2]
    assert "module.py" not in text


@pytest.mark.parametrize("recipe", ["gpt_124m_h200", "tiny_gpt_cpu"])
def test_recipe_speed_runs_each_mode_as_named_whatever_the_recipe_ships(recipe, tmp_path, monkeypatch, capsys):
    """``--modes eager`` must be eager on a recipe that ships graphs on (and ``graphs`` graphed on
    one that ships them off); the default mode runs the recipe as it ships."""
    from lightning_fp8state.cli.config import load_config

    monkeypatch.syspath_prepend(str(BENCH))
    import recipe_speed

    runs = []

    def fake_train(out, name, args):
        runs.append((name, load_config(args[0], args[1:])))
        return 0, [{"train/loss": 1.0, "train/mem_peak_gib": 3.25}, {"train/loss": 1.0, "train/mem_peak_gib": 2.0}]

    monkeypatch.setattr(recipe_speed, "train", fake_train)
    monkeypatch.setattr(recipe_speed, "throughput", lambda rows, skip, key: 1.0)
    modes = ["eager", "compile", "graphs", "compile+graphs"]
    monkeypatch.setattr(
        "sys.argv", ["recipe_speed.py", "--out", str(tmp_path / "a"), "--recipe", recipe, "--modes", *modes]
    )
    recipe_speed.main()
    switches = {name: (cfg.trainer.compile, cfg.trainer.cuda_graphs) for name, cfg in runs}
    for variant in ("fp8", "bf16"):
        assert switches[f"{variant}_eager"] == (False, False)
        assert switches[f"{variant}_compile"] == (True, False)
        assert switches[f"{variant}_graphs"] == (False, True)
        assert switches[f"{variant}_compile_graphs"] == (True, True)
    runs.clear()
    monkeypatch.setattr("sys.argv", ["recipe_speed.py", "--out", str(tmp_path / "b"), "--recipe", recipe])
    recipe_speed.main()
    shipped = load_config(recipe)
    assert [name for name, _ in runs] == ["fp8", "bf16"]
    assert all(cfg.trainer.cuda_graphs == shipped.trainer.cuda_graphs for _, cfg in runs)
    assert runs[1][1].quant.recipe == "bf16" and runs[0][1].quant.recipe == shipped.quant.recipe
    out = capsys.readouterr().out
    assert out.count("peak 3.2 GiB") == 2 + 2 * len(modes)  # each run's largest, from its telemetry


def test_hf_speed_collects_the_previous_variant_before_building_the_next(monkeypatch):
    """A model trained through Lightning sits in reference cycles (trainer, strategy, module):
    without a collection it stays allocated into the next variant's peak-memory window, as
    H1's peaks showed. Each variant begins with ``timing.fresh_peak``, which collects first."""
    import argparse
    import gc
    import weakref

    monkeypatch.syspath_prepend(str(BENCH))
    hf_speed = runpy.run_path(str(BENCH / "hf_speed.py"))
    measure, build = hf_speed["measure"], hf_speed["_module"]
    made, alive_at_build = [], []

    def module(variant, args):
        alive_at_build.append([ref() is not None for ref in made])
        m = build(variant, args)
        made.append(weakref.ref(m))
        return m

    measure.__globals__["_module"] = module
    shape = "d_model=32 layers=1 heads=2 kv_heads=1 ffn=64 vocab=64 seq=16 batch=2 steps=1 warmup=1"
    args = argparse.Namespace(accelerator="cpu", **{k: int(v) for k, v in (kv.split("=") for kv in shape.split())})
    enabled = gc.isenabled()
    gc.disable()  # only the benchmark's own collection may free the first model
    try:
        for variant in ("hf_bf16", "ours_bf16"):
            measure(variant, args)
    finally:
        if enabled:
            gc.enable()
    assert alive_at_build == [[], [False]]


@pytest.mark.parametrize("codes_once", ["true", "false"])
def test_hf_speed_passes_weight_codes_once_to_its_fp8_variants(monkeypatch, codes_once):
    """``--weight-codes-once false`` measures the FP8 variants without weight codes held from
    forward to backward (the Llama recipes' setting), the memory the peak comparison wants."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH))
    hf_speed = runpy.run_path(str(BENCH / "hf_speed.py"))
    measure = hf_speed["measure"]
    seen = []
    real = measure.__globals__["Fp8StateCallback"]

    def spy(*a, **kw):
        seen.append(kw["config"].weight_codes_once)
        return real(*a, **kw)

    measure.__globals__["Fp8StateCallback"] = spy
    shape = "d_model=32 layers=1 heads=2 kv_heads=1 ffn=64 vocab=64 seq=16 batch=2 steps=1 warmup=1"
    args = argparse.Namespace(
        accelerator="cpu",
        weight_codes_once=codes_once,
        **{k: int(v) for k, v in (kv.split("=") for kv in shape.split())},
    )
    measure("hf_fp8", args)
    assert seen == [codes_once == "true"]
