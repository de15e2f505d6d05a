"""Training-effective telemetry: what the optimizer actually applied, and quantizer health.

Per optimizer step: steps attempted / applied / skipped, loss, learning rate, gradient norm
before clipping, the dominant gradient source, clipping, finiteness, raw and effective
throughput, per-expert token counts and idle experts of mixture-of-experts layers, and (on
log steps) the Fp8State's scales, amaxes, saturation, commits per event,
ledger violations and recompute mismatches. A non-finite guard skips steps whose gradients
are not finite. Rows go to a JSONL file that is always written, and to any sinks (Lightning
loggers, W&B offline). :func:`write_report` draws the plots.
"""

from .engines import EngineStepInfo, read_engine_step
from .experts import ExpertTelemetry
from .metrics import clip_event, gradient_norms, gradient_summary, loss_summary, source_groups
from .quantizer import SaturationWindow, find_protocol, owner_label, quantizer_health
from .recorder import StepRecorder
from .report import TelemetryReport, find_jsonl, summarize, write_report
from .sinks import JSONL_NAME, FanOut, JsonlSink, Sink, TelemetryLog, WandbSink, read_jsonl, read_telemetry
from .tracker import TrainingTelemetry, count_tokens

__all__ = [
    "JSONL_NAME",
    "EngineStepInfo",
    "ExpertTelemetry",
    "FanOut",
    "JsonlSink",
    "SaturationWindow",
    "Sink",
    "StepRecorder",
    "TelemetryLog",
    "TelemetryReport",
    "TrainingTelemetry",
    "WandbSink",
    "clip_event",
    "count_tokens",
    "find_jsonl",
    "find_protocol",
    "gradient_norms",
    "gradient_summary",
    "loss_summary",
    "owner_label",
    "quantizer_health",
    "read_engine_step",
    "read_jsonl",
    "read_telemetry",
    "source_groups",
    "summarize",
    "write_report",
]
