"""The strategies on the CPU: registration by name, the callback requirement, DeepSpeed's
refusal of the CPU, activation checkpointing settings passed through to DeepSpeed, and the
routing of lightning_fp8state.checkpoint to DeepSpeed's engine."""

from __future__ import annotations

from types import SimpleNamespace

import deepspeed
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.lightning import Fp8StateCallback, Fp8StateDeepSpeedStrategy
from tests.conftest import Block, bitwise_equal
from tests.lightning.test_callback import make_model, make_trainer


def test_strategies_are_registered_and_found_by_name():
    assert f8s.lightning.Fp8StateCallback is Fp8StateCallback
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fp8state_ddp", logger=False)
    assert isinstance(trainer.strategy, f8s.lightning.Fp8StateDDPStrategy)
    assert trainer.strategy._start_method == "popen"
    spawn = pl.Trainer(accelerator="cpu", devices=2, strategy="fp8state_ddp_spawn", logger=False)
    assert spawn.strategy._start_method == "spawn"
    for name, stage in (
        ("fp8state_deepspeed", 2),
        ("fp8state_deepspeed_stage_1", 1),
        ("fp8state_deepspeed_stage_3", 3),
    ):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        assert isinstance(trainer.strategy, f8s.lightning.Fp8StateDeepSpeedStrategy)
        assert trainer.strategy.config["zero_optimization"]["stage"] == stage


def test_strategies_require_the_callback():

    no_callback = SimpleNamespace(callbacks=[])
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="needs an Fp8StateCallback"):
        f8s.lightning.Fp8StateDDPStrategy().setup(no_callback)
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="needs an Fp8StateCallback"):
        f8s.lightning.Fp8StateDeepSpeedStrategy().setup(no_callback)


@pytest.mark.parametrize("keep", [False, True])
def test_ddp_turns_dynamos_ddp_optimizer_off_unless_asked(monkeypatch, keep):
    """Dynamo's DDPOptimizer splits a block compiled inside DDP's forward at bucket boundaries; a
    checkpointed block's recompute (outside DDP's forward) then saved its tensors in another
    order, and torch's checkpoint refused the backward (the 1B Llama recipe, compiled, on the H200;
    tests/gpu/test_compile_ddp_cuda.py). ``dynamo_ddp_optimizer=True`` leaves the setting alone."""
    from lightning.pytorch.strategies import DDPStrategy

    monkeypatch.setattr(DDPStrategy, "setup", lambda self, trainer: None)
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    try:
        trainer = SimpleNamespace(callbacks=[Fp8StateCallback()])
        f8s.lightning.Fp8StateDDPStrategy(dynamo_ddp_optimizer=keep).setup(trainer)
        assert torch._dynamo.config.optimize_ddp is keep
    finally:
        torch._dynamo.config.optimize_ddp = before


def test_ddp_strategy_arguments_are_validated():
    with pytest.raises(f8s.ConfigError, match="dynamo_ddp_optimizer"):
        f8s.lightning.Fp8StateDDPStrategy(dynamo_ddp_optimizer="yes")


def test_deepspeed_strategy_refuses_the_cpu_with_a_clear_message():
    trainer = make_trainer(Fp8StateCallback(), strategy="fp8state_deepspeed")
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="needs CUDA GPUs.*fp8state_ddp"):
        trainer.fit(make_model())


def test_deepspeed_activation_checkpointing_settings_reach_deepspeed(monkeypatch):
    seen = {}
    monkeypatch.setattr(deepspeed.checkpointing, "configure", lambda mpu_, **kw: seen.update(kw, mpu_=mpu_))
    strategy = Fp8StateDeepSpeedStrategy(
        stage=2,
        partition_activations=True,
        cpu_checkpointing=True,
        contiguous_memory_optimization=True,
        synchronize_checkpoint_boundary=True,
        num_checkpoints=4,
    )
    strategy._set_deepspeed_activation_checkpointing()
    assert seen == {
        "mpu_": None,
        "partition_activations": True,
        "contiguous_checkpointing": True,
        "num_checkpoints": 4,
        "checkpoint_in_cpu": True,
        "synchronize": True,
        "profile": None,
    }
    assert strategy.config["activation_checkpointing"]["number_checkpoints"] == 4
    assert strategy.routed_engine == "deepspeed"


def test_a_deepspeed_config_file_section_is_passed_through_too(monkeypatch):
    seen = {}
    monkeypatch.setattr(deepspeed.checkpointing, "configure", lambda mpu_, **kw: seen.update(kw))
    config = {
        "zero_optimization": {"stage": 2},
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True, "profile": True},
    }
    strategy = Fp8StateDeepSpeedStrategy(config=config)
    strategy._set_deepspeed_activation_checkpointing()
    assert seen["checkpoint_in_cpu"] is True and seen["partition_activations"] is False and seen["profile"] is True
    assert strategy.routed_engine == "deepspeed"


def test_checkpoint_engine_routing_choices():
    assert Fp8StateDeepSpeedStrategy().routed_engine is None  # no DeepSpeed-only feature: torch's stays
    assert Fp8StateDeepSpeedStrategy(checkpoint_engine="deepspeed").routed_engine == "deepspeed"
    assert Fp8StateDeepSpeedStrategy(checkpoint_engine="torch", cpu_checkpointing=True).routed_engine == "torch"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"checkpoint_engine": "fast"}, r"checkpoint_engine='fast' is not allowed"),
        ({"num_checkpoints": 0}, r"num_checkpoints=0 is not allowed"),
        ({"device_guard": "yes"}, r"device_guard='yes' is not allowed"),
        ({"overlap_comm": "no"}, r"overlap_comm='no' is not allowed"),
        ({"contiguous_memory_optimization": True, "num_checkpoints": 2}, "needs partition_activations=True"),
        ({"contiguous_memory_optimization": True, "partition_activations": True}, "needs num_checkpoints"),
    ],
)
def test_deepspeed_strategy_arguments_are_validated(kwargs, match):
    error = f8s.ConfigError if "is not allowed" in match else MisconfigurationException
    with pytest.raises(error, match=match):
        Fp8StateDeepSpeedStrategy(**kwargs)


def test_routing_sends_the_wrapper_through_deepspeeds_engine_and_stays_exact(monkeypatch):
    """With the state's checkpoint engine set to DeepSpeed (what the callback does at setup
    with the strategy's routed engine), lightning_fp8state.checkpoint(fn, x) inside its events
    runs deepspeed.checkpointing.checkpoint, and the result equals the torch engine's bitwise;
    torch-only keywords keep the torch engine. No process-wide default changes."""
    calls = []
    real = deepspeed.checkpointing.checkpoint
    monkeypatch.setattr(deepspeed.checkpointing, "checkpoint", lambda fn, *a: calls.append(fn) or real(fn, *a))
    results = {}
    for engine in ("torch", "deepspeed"):
        state = f8s.Fp8State(f8s.QuantConfig(), checkpoint_engine=engine)
        torch.manual_seed(0)
        block = state.convert(torch.nn.Sequential(Block(16)))
        x = torch.randn(4, 16, requires_grad=True)
        with f8s.RecomputeAuditor(state) as auditor, state.step(0):
            assert f8s.recompute.default_engine() == engine
            y = f8s.checkpoint(block, x)
            state.commit_forward()
            y.float().pow(2).mean().backward()
        assert auditor.report().ok and auditor.report().recomputed >= 1
        results[engine] = (y.detach(), x.grad)
        assert f8s.recompute.default_engine() == "torch"  # outside the event: the state's engine is not bound
    assert len(calls) == 1  # only the deepspeed-routed run went through DeepSpeed
    assert all(bitwise_equal(a, b) for a, b in zip(results["torch"], results["deepspeed"], strict=True))
    assert f8s.recompute.default_engine() == "torch"
    state = f8s.Fp8State(f8s.QuantConfig(), checkpoint_engine="deepspeed")
    with torch.no_grad(), state.step(0):
        f8s.checkpoint(torch.nn.Identity(), torch.ones(2), preserve_rng_state=False)
    assert len(calls) == 1
    with pytest.raises(f8s.ConfigError, match="checkpoint_engine='jax' is not allowed"):
        f8s.Fp8State(f8s.QuantConfig(), checkpoint_engine="jax")


def test_the_callback_takes_the_strategys_engine_for_its_state_s_events(monkeypatch):
    """The engine a strategy routes to reaches unnamed checkpoint calls through the callback's
    state (a CPU stand-in for fp8state_deepspeed, which refuses the CPU); outside the run's
    events nothing is left changed."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lightning_fp8state.lightning import Fp8StateStrategyContract

    class RoutingStrategy(Fp8StateStrategyContract, SingleDeviceStrategy):
        fp8state_checkpoint_engine = "deepspeed"

    calls = []
    real = deepspeed.checkpointing.checkpoint
    monkeypatch.setattr(deepspeed.checkpointing, "checkpoint", lambda fn, *a: calls.append(fn) or real(fn, *a))
    cb = Fp8StateCallback(config=f8s.QuantConfig(), audit=True)
    trainer = make_trainer(cb, strategy=RoutingStrategy(device=torch.device("cpu")), max_steps=2)
    trainer.fit(make_model(ckpt="f8s_default"))
    assert cb.state.checkpoint_engine == "deepspeed"
    assert len(calls) == 2 * 2  # two blocks, two steps: every unnamed call went through DeepSpeed
    assert cb.audit_report().ok and cb.audit_report().recomputed >= 1
    assert f8s.recompute.default_engine() == "torch"


# -- fp8state_fsdp (the two-rank runs: tests/lightning/test_fsdp.py, tests/distributed/test_fsdp.py) --
def test_fsdp_strategy_is_registered_and_takes_its_arguments():
    from lightning_fp8state.lightning import Fp8StateFSDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fp8state_fsdp", logger=False)
    assert isinstance(trainer.strategy, Fp8StateFSDPStrategy)
    assert trainer.strategy.fp8_all_gather is True and trainer.strategy.reshard_after_forward is True
    s = Fp8StateFSDPStrategy(fp8_all_gather=False, shard_modules=["blocks.*"], reshard_after_forward=False)
    assert (s.fp8_all_gather, s.shard_modules, s.reshard_after_forward) == (False, ("blocks.*",), False)
    assert s.fp8state_sharded is True
    assert trainer.strategy.local_optimizer_step is True
    # the CLI's strategy section, key for key
    from lightning_fp8state.cli.config import load_config

    cfg = load_config("tiny_gpt_cpu", ["strategy.name=fp8state_fsdp", "strategy.local_optimizer_step=false"])
    assert Fp8StateFSDPStrategy.from_cli(cfg.strategy).local_optimizer_step is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8_all_gather": "yes"}, r"fp8_all_gather='yes' is not allowed: expected true or false"),
        ({"reshard_after_forward": 1}, r"reshard_after_forward=1 is not allowed"),
        ({"local_optimizer_step": "no"}, r"local_optimizer_step='no' is not allowed"),
        ({"tensor_parallel_size": 2}, r"tensor_parallel_size=2 is not allowed: .*data parallel only"),
        ({"data_parallel_size": 2}, r"data_parallel_size=2 is not allowed: expected one of \['auto'\]"),
        ({"save_distributed_checkpoint": False}, r"save_distributed_checkpoint=False is not allowed"),
        ({"shard_modules": "blocks.*"}, r"shard_modules='blocks.\*' is not allowed: expected a list"),
        ({"shard_modules": ["blocks.*", 3]}, r"shard_modules=\['blocks.\*', 3\] is not allowed: expected a list"),
    ],
)
def test_fsdp_strategy_arguments_are_validated(kwargs, match):
    from lightning_fp8state.lightning import Fp8StateFSDPStrategy

    with pytest.raises(f8s.ConfigError, match=match):
        Fp8StateFSDPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"amax_reduction": "none"}, r"fp8_all_gather=True cannot run .*amax_reduction gives the weight 'none'"),
        ({"ownership": "per_layer_rank_stream"}, r"cannot run .*ownership='per_layer_rank_stream'"),
        ({"mode": "naive", "strict": False}, r"cannot run .*mode='naive'"),
    ],
)
def test_fsdp_strategy_refuses_quantizer_configurations_fp8_all_gather_cannot_serve(config, match):
    from lightning_fp8state.lightning import Fp8StateFSDPStrategy

    with pytest.raises(MisconfigurationException, match=match):
        Fp8StateFSDPStrategy().check_config(f8s.QuantConfig(**config))
    Fp8StateFSDPStrategy(fp8_all_gather=False).check_config(f8s.QuantConfig(**config))  # gathers hp: fine
    Fp8StateFSDPStrategy().check_config(f8s.QuantConfig(recipe="bf16"))  # nothing quantized: nothing to gather


def test_fsdp_default_units_are_the_blocks_and_the_wrapped_network():
    from lightning_fp8state.lightning.fsdp import default_shard_units
    from lightning_fp8state.models import GPT, GPTConfig

    class Module(pl.LightningModule):  # training_step calls self.model, never self's forward
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(n_layers=2))

    assert default_shard_units(Module()) == ["model.blocks.0", "model.blocks.1", "model"]
    stack = torch.nn.Module()
    stack.inp, stack.blocks = torch.nn.Linear(2, 2), torch.nn.ModuleList([Block(4), Block(4)])
    assert default_shard_units(stack) == ["blocks.0", "blocks.1", "inp"]


# -- the strategy contract the callback reads ----------------------------------------------
def test_every_fp8state_strategy_declares_the_contract_and_the_cli_knows_each():
    from lightning.pytorch.strategies import DeepSpeedStrategy, SingleDeviceStrategy

    from lightning_fp8state.cli.schema import strategy_choices
    from lightning_fp8state.lightning import STRATEGIES, Fp8StateStrategyContract, contract_of

    assert set(strategy_choices()) == {"auto", *STRATEGIES}
    ddp = STRATEGIES["fp8state_ddp"]()
    ds3 = STRATEGIES["fp8state_deepspeed"](stage=3)
    for strategy in (ddp, ds3):
        assert isinstance(strategy, Fp8StateStrategyContract) and contract_of(strategy) is strategy
    assert (ddp.fp8state_process_group, ddp.fp8state_sharded, ddp.fp8state_converts_before_wrap) == (None, False, False)
    assert ds3.fp8state_converts_before_wrap and ds3.fp8state_saves_accumulation
    assert not STRATEGIES["fp8state_deepspeed"](stage=2).fp8state_converts_before_wrap
    assert STRATEGIES["fp8state_fsdp"].fp8state_sharded.fget(None) is True
    # Lightning's own strategies answer from what they are
    assert contract_of(DeepSpeedStrategy(stage=3)).fp8state_converts_before_wrap
    plain = contract_of(SingleDeviceStrategy(device="cpu"))
    assert (plain.fp8state_checkpoint_engine, plain.fp8state_sharded, plain.fp8state_saves_accumulation) == (
        None,
        False,
        False,
    )


def test_the_callback_reads_strategies_only_through_the_contract():
    import ast
    import inspect

    from lightning_fp8state.lightning import callback

    tree = ast.parse(inspect.getsource(callback))
    probes = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and "strategy" in ast.unparse(n.args[0])
    ]
    assert probes == []


def test_deepspeeds_throughput_timer_does_not_wait_for_the_device_unless_asked():
    """DeepSpeed's throughput timer synchronizes the device at every forward and every step by
    default (the GPU test ``test_deepspeeds_synchronized_throughput_timer_makes_every_step_wait_for_the_device``
    finds them): ours keeps the timer and leaves out the waits; a config that sets
    ``synchronized`` keeps it, and the CLI's strategy gets the same default."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_fp8state.cli.schema import StrategyCfg
    from lightning_fp8state.lightning import STRATEGIES

    def synced(strategy):
        return strategy.config.get("timers", {}).get("throughput", {}).get("synchronized")

    assert synced(DeepSpeedStrategy()) is None  # Lightning leaves DeepSpeed's default (True)
    assert synced(Fp8StateDeepSpeedStrategy()) is False
    assert [synced(Fp8StateDeepSpeedStrategy(stage=s)) for s in (1, 2, 3)] == [False, False, False]
    own = {"zero_optimization": {"stage": 2}, "timers": {"throughput": {"synchronized": True, "enabled": True}}}
    assert synced(Fp8StateDeepSpeedStrategy(config=own)) is True
    own = {"zero_optimization": {"stage": 2}, "timers": {"throughput": {"enabled": False}}}
    strategy = Fp8StateDeepSpeedStrategy(config=own)
    assert strategy.config["timers"]["throughput"] == {"enabled": False, "synchronized": False}
    cls = STRATEGIES["fp8state_deepspeed"]
    assert synced(cls.from_cli(StrategyCfg(name="fp8state_deepspeed"))) is False


def test_deepspeed_overlap_comm_is_off_under_zero_1_2_unless_asked():
    """ZeRO-1/2 with overlap_comm synchronize the device in every backward (the GPU test
    ``test_overlap_comm_makes_every_backward_wait_for_the_device`` counts it): ours leaves it
    off there by default, where Lightning's own strategy turns it on; ZeRO-3 waits at the end
    of every backward either way, so it keeps the overlap. Asked for, by argument or CLI key,
    it is what was asked."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_fp8state.cli.schema import StrategyCfg
    from lightning_fp8state.lightning import STRATEGIES

    def overlap(strategy) -> bool:
        return strategy.config["zero_optimization"]["overlap_comm"]

    assert overlap(DeepSpeedStrategy()) is True  # Lightning's default
    assert overlap(Fp8StateDeepSpeedStrategy()) is False  # stage 2
    assert [overlap(Fp8StateDeepSpeedStrategy(stage=s)) for s in (1, 2, 3)] == [False, False, True]
    assert overlap(Fp8StateDeepSpeedStrategy(None, True, 3)) is True  # the stage given by position
    assert overlap(Fp8StateDeepSpeedStrategy(overlap_comm=True)) is True
    assert overlap(Fp8StateDeepSpeedStrategy(stage=3, overlap_comm=False)) is False
    cls = STRATEGIES["fp8state_deepspeed"]
    cli = [overlap(cls.from_cli(StrategyCfg(name="fp8state_deepspeed", zero_stage=s))) for s in (1, 2, 3)]
    assert cli == [False, False, True]
    assert overlap(cls.from_cli(StrategyCfg(name="fp8state_deepspeed", overlap_comm=True))) is True
    with pytest.raises(f8s.ConfigError, match=r"overlap_comm='on' is not allowed"):
        StrategyCfg(overlap_comm="on")
    # the registered names, built as the registry builds them
    for stage in (1, 2, 3):
        entry = pl.strategies.StrategyRegistry[f"fp8state_deepspeed_stage_{stage}"]
        assert overlap(entry["strategy"](**entry["init_params"])) is (stage == 3), stage


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero3_marks_every_converted_layer_sharded(monkeypatch, stage):
    """ZeRO-3 partitions every parameter: no call may hold its weight's codes from the forward
    to the recompute (nn.fsdp.mark_sharded). ZeRO-1/2 keep whole weights, so the codes are
    kept. DeepSpeed's own setup needs CUDA and is stood in for here."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    state = f8s.Fp8State(f8s.QuantConfig(strict=False))
    model = state.convert(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    monkeypatch.setattr(DeepSpeedStrategy, "setup", lambda self, trainer: None)
    strategy = Fp8StateDeepSpeedStrategy(stage=stage)
    monkeypatch.setattr(type(strategy), "lightning_module", property(lambda self: model))
    strategy.setup(SimpleNamespace(callbacks=[Fp8StateCallback()]))
    converted = sorted(m.layer_name for m in model.modules() if isinstance(m, f8s.nn.Fp8Linear))
    assert len(converted) == 2
    assert sorted(state.protocol.sharded_layers) == (converted if stage == 3 else [])


def test_the_cli_reads_strategy_facts_from_the_contract_and_names_no_strategy():
    """A new strategy is its class (and its YAML): cli/ lists or tests no strategy name; what it
    needs to know it reads from the contract's class attributes."""
    import ast
    from pathlib import Path

    import lightning_fp8state.cli as cli
    from lightning_fp8state.cli.schema import strategy_choices

    names = [n for n in strategy_choices() if n != "auto"]
    found = []
    for path in Path(cli.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found += [f"{path.name}: {node.value!r}" for n in names if n in node.value]
            if isinstance(node, ast.Compare) and "strategy.name" in ast.unparse(node.left):
                found.append(f"{path.name}: {ast.unparse(node)}")
    assert found == []


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        ("auto", dict(compiles_blocks=True, cuda_graphs="step", writes_checkpoint_directory=False, needs_cuda=False)),
        ("fp8state_ddp", dict(compiles_blocks=True, cuda_graphs="blocks", writes_checkpoint_directory=False)),
        ("fp8state_deepspeed", dict(compiles_blocks=False, writes_checkpoint_directory=True, needs_cuda=True)),
        ("fp8state_fsdp", dict(compiles_blocks=False, writes_checkpoint_directory=True, restores_optimizer_late=True)),
    ],
)
def test_each_strategy_declares_the_facts_the_cli_reads(name, facts):
    from lightning_fp8state.cli.schema import StrategyCfg, strategy_choices

    cls = strategy_choices()[name]
    assert {k: getattr(cls, k) for k in facts} == facts
    fused = {s: cls.fused_optimizer(StrategyCfg(name=name, zero_stage=s)) for s in (1, 2, 3)}
    expected = {1: True, 2: True, 3: False} if name == "fp8state_deepspeed" else {1: True, 2: True, 3: True}
    assert fused == expected
