"""lightning.deepspeed_guard on a real DeepSpeed ZeRO-2 engine under bf16 (GPU only).

Two engines from the same weights train the same batches: one with DeepSpeed's own overflow
check and clipping (host decisions), one with the device guard. Their parameters must stay
bitwise equal through clipped steps and through a step whose gradients hold a NaN, which both
must skip (the guard's without touching the parameters). Each engine runs in a child process:
DeepSpeed initializes torch.distributed for the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (DeepSpeed engines need CUDA)"),
]

SCRIPT = textwrap.dedent(
    """
    import json, sys, traceback, warnings, torch, deepspeed
    from lightning_fp8state.lightning import deepspeed_guard
    from lightning_fp8state.telemetry.engines import FOUND_INF_ATTR
    guard = sys.argv[1] == "guard"
    overlap = sys.argv[2] == "overlap"
    timer_waits = sys.argv[3] == "synchronized-timer"  # DeepSpeed's default; Fp8StateDeepSpeedStrategy's is not
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True}, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": 2, "overlap_comm": overlap}, "zero_allow_untested_optimizer": True,
              "timers": {"throughput": {"synchronized": timer_waits}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    reason = deepspeed_guard.install(engine) if guard else "off"
    g = torch.Generator(device="cuda").manual_seed(1)
    flags, skipped, syncs, waits = [], [], [], []
    device_wait = torch.cuda.synchronize
    def caller():  # the innermost DeepSpeed frame above its accelerator, or the innermost frame
        stack = traceback.extract_stack()[:-2]
        frames = [f for f in stack if "/deepspeed/" in f.filename and "/accelerator/" not in f.filename]
        f = (frames or stack)[-1]
        return f"{f.filename.split('/deepspeed/')[-1]}:{f.lineno} {f.name}"
    def counted_wait(*a, **k):  # torch.cuda.synchronize is not seen by set_sync_debug_mode
        waits.append(caller())
        return device_wait(*a, **k)
    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("called a synchronizing"):  # not set_sync_debug_mode's own notice
            syncs.append(caller())
    for step in range(6):
        x = torch.randn(8, 64, device="cuda", generator=g).bfloat16() * (30 if step == 2 else 1)
        loss = engine(x).float().pow(2).mean()
        if step == 4:
            loss = loss * float("nan")
        if step == 3:  # a steady-state step: how often do the backward and the step wait for the device?
            torch.cuda.synchronize = counted_wait
        engine.backward(loss)
        if step == 3:  # ... and which host syncs does the engine's step make?
            device_wait()
            shown, warnings.showwarning = warnings.showwarning, record
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        engine.step()
        if step == 3:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
            torch.cuda.synchronize = device_wait
        flag = getattr(engine, FOUND_INF_ATTR, None)
        flags.append(None if flag is None else flag.item())
        skipped.append(engine.skipped_steps)
    params = torch.cat([p.detach().float().flatten().cpu() for p in engine.module.parameters()])
    print(json.dumps({"reason": reason, "flags": flags, "skipped": skipped, "syncs": syncs, "waits": waits,
                      "params": params.tolist()}))
    """
)


def run(mode: str, tmp_path, overlap: bool = False, timer_waits: bool = False) -> dict:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29600 + (mode == "guard") + 2 * overlap + 4 * timer_waits),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            mode,
            "overlap" if overlap else "in-order",
            "synchronized-timer" if timer_waits else "host-timer",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_device_guard_is_bitwise_deepspeeds_check_and_clip(tmp_path):
    host, device = run("host", tmp_path), run("guard", tmp_path)
    facts = {
        "reason": device["reason"],
        "flags": device["flags"],
        "host skipped": host["skipped"],
        "guard skipped": device["skipped"],
        "host syncs": host["syncs"],
        "guard syncs": device["syncs"],
        "params equal": device["params"] == host["params"],
        "guard waits": device["waits"],
    }
    assert device["reason"] is None, facts
    assert device["flags"] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0], facts  # the NaN step flagged and skipped
    assert host["skipped"][-1] == 1, facts  # DeepSpeed's own check skipped it too (and counted it)
    assert device["params"] == host["params"], facts  # clipped steps and the skip: bitwise the same
    assert len(host["syncs"]) > 0, facts  # the probe sees DeepSpeed's own syncs
    assert device["syncs"] == [], facts
    assert device["waits"] == [], facts  # no torch.cuda.synchronize in the backward or the step


def test_overlap_comm_makes_every_backward_wait_for_the_device(tmp_path):
    """Why ``Fp8StateDeepSpeedStrategy`` turns DeepSpeed's ``overlap_comm`` off by default (Lightning
    turns it on): with it on, ZeRO-2 calls ``torch.cuda.synchronize`` in every backward (before a
    bucket's reduction and at the backward's end), so the host cannot issue the next step ahead
    of the GPU. The same guarded engine as above, with overlap_comm on: the probe counts the waits
    the in-order engine does not make."""
    overlapped = run("guard", tmp_path, overlap=True)
    assert overlapped["reason"] is None, overlapped["reason"]
    assert len(overlapped["waits"]) > 0, overlapped["waits"]


def test_deepspeeds_synchronized_throughput_timer_makes_every_step_wait_for_the_device(tmp_path):
    """Why ``Fp8StateDeepSpeedStrategy`` sets ``timers.throughput.synchronized`` to false by
    default: with DeepSpeed's default (true) the timer calls ``get_accelerator().synchronize()``
    when it stops at the end of every step (and at the start of every forward), a wait the
    in-order engine above does not make."""
    timed = run("guard", tmp_path, timer_waits=True)
    assert timed["reason"] is None, timed["reason"]
    assert any("utils/timer.py" in w for w in timed["waits"]), timed["waits"]
