"""Loading a run configuration: schema defaults <- configs/ pieces <- recipe <- overrides.

A recipe is a YAML file (a path, or a name under ``recipes/``) that may list reusable
pieces under ``base:`` (paths relative to ``configs/``); both folders ship with the package
(:mod:`lightning_fp8state.shipped`). Every error —
unknown key, wrong type, value out of range, missing file — is a ``ConfigError`` whose
message names the key (or path) and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import QuantConfig
from ..errors import ConfigError
from ..shipped import shipped_dir
from .schema import RunCfg

__all__ = ["CONFIGS_DIR", "DEFAULT_RECIPE", "RECIPES_DIR", "load_config", "resolve_recipe", "validate"]

CONFIGS_DIR = shipped_dir("configs")
RECIPES_DIR = shipped_dir("recipes")
DEFAULT_RECIPE = "tiny_gpt_cpu"

_CHOICES = {
    "model.checkpoint_engine": ("torch", "deepspeed"),
    "data.source": ("markov", "text", "bin"),
    "telemetry.wandb": ("offline", "online", "disabled"),
    "trainer.accelerator": ("cpu", "gpu", "cuda", "auto"),
    "trainer.precision": ("32-true", "bf16-mixed", "bf16-true", "16-mixed"),
    "strategy.name": ("auto", "fp8state_ddp", "fp8state_deepspeed"),
}
_MINIMUM = {
    "model.vocab_size": 2,
    "model.seq_len": 1,
    "model.d_model": 1,
    "model.n_layers": 1,
    "model.n_heads": 1,
    "model.mlp_ratio": 1,
    "data.batch_size": 1,
    "data.num_samples": 1,
    "data.num_workers": 0,
    "telemetry.log_every_n_steps": 1,
    "trainer.max_steps": 1,
    "trainer.devices": 1,
    "trainer.num_nodes": 1,
    "trainer.accumulate_grad_batches": 1,
    "trainer.gradient_clip_val": 0,
    "trainer.lr": 0,
    "trainer.weight_decay": 0,
    "trainer.warmup_steps": 0,
    "trainer.schedule_steps": 0,
    "trainer.checkpoint_every_n_steps": 1,
    "strategy.zero_stage": 1,
}


def resolve_recipe(recipe: str | None) -> Path:
    """A recipe path, or a recipe name from the package (``tiny_gpt_cpu`` by default)."""
    name = recipe or DEFAULT_RECIPE
    path = Path(name)
    if path.is_file():
        return path
    packaged = RECIPES_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if packaged.is_file():
        return packaged
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe {name!r}: no such file, and no packaged recipe by that name (known: {known})")


def _load_yaml(path: Path) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return node


def _merge(base: DictConfig, other, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{origin}: key {key!r}: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0]
    text = re.sub(r"\s*full_key:.*", "", text)
    return text


def _parse_override(item: str) -> tuple[str, str]:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.max_steps=50")
    key, value = item.split("=", 1)
    return key.strip(), value


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """The validated run configuration for ``recipe`` with ``key=value`` ``overrides``."""
    schema = OmegaConf.structured(RunCfg)
    OmegaConf.set_struct(schema, True)
    path = resolve_recipe(recipe)
    node = _load_yaml(path)
    pieces = node.pop("base", []) if "base" in node else []
    cfg = schema
    for piece in pieces:
        piece_path = CONFIGS_DIR / (piece if str(piece).endswith(".yaml") else f"{piece}.yaml")
        if not piece_path.is_file():
            raise ConfigError(f"{path}: base piece {piece!r}: no such file under {CONFIGS_DIR}")
        cfg = _merge(cfg, _load_yaml(piece_path), str(piece_path))
    cfg = _merge(cfg, node, str(path))
    for item in overrides or []:
        key, _ = _parse_override(item)
        if not _is_known(cfg, key):
            raise ConfigError(f"override {key!r}: unknown key (sections: {list(cfg.keys())})")
        try:
            dotted = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: cannot parse ({_reason(exc)})") from exc
        cfg = _merge(cfg, dotted, f"override {item!r}")
    validate(cfg)
    return cfg


def _is_known(cfg: DictConfig, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return True


def validate(cfg: DictConfig) -> None:
    """Value checks the types cannot express; raise ConfigError naming the key."""
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed: expected one of {list(allowed)}")
    for key, low in _MINIMUM.items():
        value = OmegaConf.select(cfg, key)
        if value < low:
            raise ConfigError(f"{key}={value!r} is not allowed: expected a value >= {low}")
    if cfg.strategy.zero_stage > 3:
        raise ConfigError(f"strategy.zero_stage={cfg.strategy.zero_stage} is not allowed: expected 1, 2 or 3")
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError(
            f"model.d_model={cfg.model.d_model} is not allowed: expected a multiple of model.n_heads={cfg.model.n_heads}"
        )
    if cfg.data.source in ("text", "bin") and not cfg.data.path:
        raise ConfigError(f"data.path is required when data.source={cfg.data.source!r}")
    if cfg.data.path and not Path(cfg.data.path).is_file():
        raise ConfigError(f"data.path={cfg.data.path!r}: no such file")
    try:
        quant_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"quant.{exc}") from exc


def quant_config(cfg: DictConfig) -> QuantConfig:
    """The library QuantConfig described by ``cfg.quant``."""
    return QuantConfig.from_dict(OmegaConf.to_container(cfg.quant, resolve=True))
