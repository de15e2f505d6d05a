"""PyTorch Lightning integration (the only layer, with the CLI, that imports Lightning)."""

from .telemetry_callback import LightningLoggerSink, TelemetryCallback, wandb_logger

__all__ = ["LightningLoggerSink", "TelemetryCallback", "wandb_logger"]
