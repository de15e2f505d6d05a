"""The run configuration schema: plain (non-frozen) dataclasses that omegaconf types and
validates. Each field's comment is its documentation."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.gpt import GPTConfig

__all__ = ["DataCfg", "GPTConfig", "QuantCfg", "RunCfg", "StrategyCfg", "TelemetryCfg", "TrainerCfg"]


@dataclass
class DataCfg:
    source: str = "markov"  # markov (generated) | text (UTF-8 file, byte tokens) | bin (uint16 memmap)
    path: str | None = None  # for text / bin
    batch_size: int = 16
    num_samples: int = 100_000  # generated samples (markov)
    seed: int = 0
    num_workers: int = 0


@dataclass
class QuantCfg:
    """The library's QuantConfig, field for field (validated by it)."""

    recipe: str = "fp8_delayed"  # fp8_delayed | bf16
    history_len: int = 16
    margin: int = 0
    amax_algo: str = "max"  # max | most_recent
    initial_scale: str = "calibrate"  # calibrate (first event: from the call's own amax) | one
    mode: str = "safe"  # safe | naive | naive_snapshot
    ownership: str = "per_layer_rank"  # per_model | per_layer | per_layer_rank | per_layer_rank_stream
    strict: bool = False  # raise at the first protocol violation (else count it)
    include: list[str] = field(default_factory=lambda: ["*"])
    exclude: list[str] = field(default_factory=lambda: ["*head"])  # keep the output head in high precision
    forward_format: str = "e4m3"
    backward_format: str = "e5m2"
    gemm: str = "auto"  # auto | emulated | scaled_mm
    fuse_prologues: bool = True  # LayerNorm / GELU written straight as the next Linear's FP8 input
    # role -> none | data_parallel: MAX of pending amaxes across data-parallel ranks
    amax_reduction: dict[str, str] = field(default_factory=lambda: {"weight": "data_parallel"})
    attn_format: str = "nvfp4"  # packed-FP4 attention operands (model.fp4_attention): nvfp4 | mxfp4
    attn_centered: bool = False  # centered variant: quantize x - running per-channel center
    attn_center_momentum: float = 0.5
    attn_quantize_v: bool = False


@dataclass
class TelemetryCfg:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "fp8state"
    log_every_n_steps: int = 10
    audit: bool = False  # attach the recompute auditor during training (diagnostic, slower)


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
    deterministic: bool = False


@dataclass
class StrategyCfg:
    name: str = "auto"  # auto | fp8state_ddp | fp8state_deepspeed
    zero_stage: int = 2  # DeepSpeed ZeRO stage 1-3
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False


@dataclass
class RunCfg:
    name: str = "tiny_gpt_cpu"
    out_dir: str = "runs"  # the run directory is out_dir/name
    model: GPTConfig = field(default_factory=GPTConfig)  # the model, field for field
    data: DataCfg = field(default_factory=DataCfg)
    quant: QuantCfg = field(default_factory=QuantCfg)
    telemetry: TelemetryCfg = field(default_factory=TelemetryCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    strategy: StrategyCfg = field(default_factory=StrategyCfg)
