"""The run configuration schema: plain (non-frozen) dataclasses that omegaconf types.

Two sections are the library's own configurations, not restated: ``model`` holds the fields of
``GPTConfig`` and ``LlamaConfig`` with ``arch`` choosing one (cli/models.py), and ``quant`` is ``QuantCfg``, a non-frozen twin generated from ``QuantConfig``'s
fields (omegaconf makes a frozen dataclass a read-only node that rejects merges), with the
same names and defaults in types omegaconf can hold (tuples as lists, ``amax_reduction``'s
(role, mode) pairs as a mapping). Their documentation is the comment on each field in
``config.py`` and ``models/gpt.py``. The other sections belong to the CLI and are defined
here. Every section checks its own choices and bounds in ``__post_init__`` (``QuantConfig``
for ``quant``), which ``cli.config.validate`` runs; a recipe that wants other defaults than
these says so in its YAML.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path

from ..config import QuantConfig, require_bool, require_choice, require_int, require_number
from ..errors import ConfigError
from ..models.data import DATA_SOURCES
from ..models.gpt import GPTConfig
from ..models.llama import LlamaConfig
from ..telemetry.sinks import WANDB_MODES

__all__ = [
    "ACCELERATORS",
    "PRECISIONS",
    "WANDB_MODES",
    "DataCfg",
    "GPTConfig",
    "ModelCfg",
    "QuantCfg",
    "RunCfg",
    "StrategyCfg",
    "TelemetryCfg",
    "TrainerCfg",
    "schema_twin",
    "strategy_choices",
    "strategy_facts",
]

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
GC_MODES = ("managed", "automatic")
ZERO_STAGES = (1, 3)  # lowest and highest DeepSpeed ZeRO stage


def strategy_choices() -> dict[str, type]:
    """Every ``strategy.name`` a run may give, each with the facts the CLI reads (the strategy
    contract's class attributes, ``lightning/contract.py``). Imports Lightning."""
    from ..lightning import STRATEGY_CHOICES  # noqa: PLC0415  (Lightning loads only when a config is checked)

    return STRATEGY_CHOICES


def strategy_facts(strategy_cfg) -> type:
    """The contract class of the configured strategy (``strategy_cfg``: the ``strategy`` section)."""
    return strategy_choices()[strategy_cfg.name]


def _omegaconf_type(tp: object, default: object) -> tuple[object, object]:
    """The type and default omegaconf can hold for a dataclass field of type ``tp``:
    ``tuple[X, ...]`` becomes ``list[X]``, a tuple of (key, value) pairs ``dict[K, V]``, a
    (frozen) dataclass its own non-frozen twin (``quant.policy``: a closed section of its keys)."""
    if is_dataclass(tp):
        twin = schema_twin(tp, f"{tp.__name__}Cfg")
        return twin, field(default_factory=lambda d=default: twin(**{f.name: getattr(d, f.name) for f in fields(d)}))
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) is tuple and len(typing.get_args(item)) == 2:
            key, value = typing.get_args(item)
            return dict[key, value], field(default_factory=lambda d=default: dict(d))
        return list[item], field(default_factory=lambda d=default: list(d))
    return tp, default


def schema_twin(cls: type, name: str, *, skip: tuple[str, ...] = ()) -> type:
    """A non-frozen dataclass with ``cls``'s fields (minus ``skip``), defaults and order.

    Args:
        cls: a dataclass whose field types are scalars, ``tuple[X, ...]`` or tuples of pairs.
        name: the twin's class name.
        skip: fields the twin leaves out.

    Returns:
        The twin class; it checks nothing itself (``cls`` does, when built from its values).
    """
    hints = typing.get_type_hints(cls)
    spec = []
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a schema twin needs a default for every field")
        tp, default = _omegaconf_type(hints[f.name], f.default)
        spec.append((f.name, tp, default))
    twin = make_dataclass(name, spec)
    twin.__module__ = __name__
    twin.__doc__ = f"The fields of {cls.__module__}.{cls.__qualname__}, for omegaconf (validated by it)."
    return twin


# QuantConfig's fields, for omegaconf: validated by QuantConfig.from_dict (cli.config.quant_config)
QuantCfg = schema_twin(QuantConfig, "QuantCfg", skip=("extra",))


def _model_schema() -> type:
    """The ``model`` section: ``arch`` (gpt | llama), ``init_from`` (a Hugging Face checkpoint
    folder for a Llama; empty: initialised afresh) and every architecture's keys, each with its
    default (cli/models.py builds the chosen architecture's config from its own keys)."""
    spec = [("arch", str, "gpt"), ("init_from", str, "")]
    seen = set()
    for cls in (GPTConfig, LlamaConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name not in seen:
                seen.add(f.name)
                spec.append((f.name, hints[f.name], f.default))
    twin = make_dataclass("ModelCfg", spec)
    twin.__module__ = __name__
    twin.__doc__ = _model_schema.__doc__
    return twin


ModelCfg = _model_schema()


# an upper bound for step and sample counts: far beyond any run, well inside every integer type used
MAX_COUNT = 10**12


@dataclass
class DataCfg:
    source: str = "markov"  # markov (generated) | text (UTF-8 file, byte tokens) | bin (uint16 memmap)
    path: str | None = None  # for text / bin
    batch_size: int = 16
    num_samples: int = 100_000  # generated samples (markov)
    seed: int = 0
    num_workers: int = 0

    def __post_init__(self) -> None:
        require_choice("source", self.source, DATA_SOURCES)
        require_int("batch_size", self.batch_size, 1)
        require_int("num_samples", self.num_samples, 1, MAX_COUNT)
        require_int("num_workers", self.num_workers, 0)
        if self.source == "markov" and self.num_samples < self.batch_size:
            raise ConfigError(
                f"num_samples={self.num_samples} is not allowed: expected at least batch_size={self.batch_size} "
                "(fewer samples make no batch, and the run would train 0 steps)"
            )
        if self.source in ("text", "bin") and not self.path:
            raise ConfigError(f"path is required when data.source={self.source!r}")
        if self.path and not Path(self.path).is_file():
            raise ConfigError(f"path={self.path!r}: no such file")
        if self.source == "bin" and Path(self.path).stat().st_size % 2:
            raise ConfigError(
                f"path={self.path!r} holds {Path(self.path).stat().st_size} bytes, an odd number: a .bin file is "
                "uint16 token ids (2 bytes each); write it with numpy's uint16 tofile(), or use data.source=text"
            )


@dataclass
class TelemetryCfg:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "fp8state"
    log_every_n_steps: int = 10
    audit: bool = False  # attach the recompute auditor during training (diagnostic, slower)

    def __post_init__(self) -> None:
        require_choice("wandb", self.wandb, WANDB_MODES)
        require_int("log_every_n_steps", self.log_every_n_steps, 1)
        require_bool("audit", self.audit)


@dataclass
class TrainerCfg:
    max_steps: int = 200
    accelerator: str = "cpu"  # cpu | gpu | auto
    devices: int = 1
    num_nodes: int = 1
    precision: str = "32-true"  # 32-true | bf16-mixed | bf16-true
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    # length of the learning-rate schedule (0: max_steps); set it to stop a run early
    # (max_steps) and resume it later on the same schedule
    schedule_steps: int = 0
    seed: int = 0
    checkpoint_every_n_steps: int = 100
    # false: no checkpoint is written (a throwaway or benchmark run, or a model whose checkpoint
    # would not fit the disk); such a run cannot be resumed, and one interrupted keeps its
    # directory (its telemetry) and says so
    enable_checkpointing: bool = True
    deterministic: bool = False
    # torch.compile every block of the model (each FP8 linear is one op in the block's graph);
    # with the strategies whose contract says compiles_blocks
    compile: bool = False
    # replay each step's forward and backward from a CUDA graph (the optimizer steps eagerly;
    # lightning_fp8state.lightning.GraphedTrainingStep): one GPU, strategy auto, no accumulation
    cuda_graphs: bool = False
    cuda_graphs_warmup: int = 3  # eager steps before the capture (at least 1)
    # torch's intra-op threads on the CPU: 0 = the cores this process may use (os.sched_getaffinity;
    # OMP_NUM_THREADS wins when set). A small model gains nothing from more threads and, beside
    # another run on the same cores, loses most of its speed to them (the tiny recipe sets 1)
    cpu_threads: int = 0
    # Python's garbage collector: managed (off during training, run after every batch, frozen
    # objects after the first batches: lightning_fp8state.ManagedCollector) or automatic
    # (Python's own, whose full collections land inside steps and stall the host)
    gc: str = "managed"
    gc_full_every_n_steps: int = 100  # managed: a collection of every generation this often

    def __post_init__(self) -> None:
        require_choice("gc", self.gc, GC_MODES)
        require_int("gc_full_every_n_steps", self.gc_full_every_n_steps, 1)
        require_choice("accelerator", self.accelerator, ACCELERATORS)
        require_choice("precision", self.precision, PRECISIONS)
        for key in ("devices", "num_nodes", "accumulate_grad_batches"):
            require_int(key, getattr(self, key), 1)
        for key in ("max_steps", "checkpoint_every_n_steps"):
            require_int(key, getattr(self, key), 1, MAX_COUNT)
        for key in ("warmup_steps", "schedule_steps"):
            require_int(key, getattr(self, key), 0, MAX_COUNT)
        for key in ("gradient_clip_val", "lr", "weight_decay"):
            require_number(key, getattr(self, key), 0)
        require_bool("deterministic", self.deterministic)
        require_bool("enable_checkpointing", self.enable_checkpointing)
        require_bool("compile", self.compile)
        require_bool("cuda_graphs", self.cuda_graphs)
        require_int("cuda_graphs_warmup", self.cuda_graphs_warmup, 1)
        require_int("cpu_threads", self.cpu_threads, 0)


@dataclass
class StrategyCfg:
    name: str = "auto"  # auto, or a strategy of lightning_fp8state.lightning.STRATEGY_CHOICES
    zero_stage: int = 2  # DeepSpeed ZeRO stage 1-3
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    # fp8state_deepspeed: DeepSpeed's overlap_comm; null: off under ZeRO-1/2 (on, they
    # synchronize the device at every bucket's reduction and every backward's end: the host
    # cannot run ahead of the GPU), on under ZeRO-3 (it waits at the backward's end either way)
    overlap_comm: typing.Optional[bool] = None  # noqa: UP045  (omegaconf reads no "bool | None")
    # fp8state_fsdp: all-gather converted weights as FP8 codes at the delayed scale (else in
    # the parameters' dtype); free each block's gathered parameters after its forward
    fp8_all_gather: bool = True
    reshard_after_forward: bool = True
    # fp8state_fsdp: AdamW steps on the local shards, not through DTensor's dispatch
    local_optimizer_step: bool = True

    def __post_init__(self) -> None:
        require_choice("name", self.name, tuple(strategy_choices()))
        require_int("zero_stage", self.zero_stage, *ZERO_STAGES)
        keys = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        for key in (*keys, "fp8_all_gather", "reshard_after_forward", "local_optimizer_step"):
            require_bool(key, getattr(self, key))
        if self.overlap_comm is not None:
            require_bool("overlap_comm", self.overlap_comm)


@dataclass
class RunCfg:
    name: str = "tiny_gpt_cpu"
    out_dir: str = "runs"  # the run directory is out_dir/name
    model: ModelCfg = field(default_factory=ModelCfg)  # model.arch's config, field for field
    data: DataCfg = field(default_factory=DataCfg)
    quant: QuantCfg = field(default_factory=QuantCfg)  # QuantConfig, field for field
    telemetry: TelemetryCfg = field(default_factory=TelemetryCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    strategy: StrategyCfg = field(default_factory=StrategyCfg)
