"""Loading a run configuration: schema defaults <- configs/ pieces <- recipe <- overrides.

A recipe is a YAML file (a path, or a name under ``recipes/``) that may list reusable
pieces under ``base:`` (paths relative to ``configs/``); both folders ship with the package
(:mod:`lightning_fp8state.shipped`). The schema's defaults are the library's own
(``cli/schema.py``); a recipe that wants others says so. Every error — unknown key, wrong
type, value out of range, missing file — is a ``ConfigError`` whose message names the key
(or path) and what is allowed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import QuantConfig
from ..errors import ConfigError
from ..shipped import shipped_dir
from .schema import RunCfg

__all__ = [
    "CONFIGS_DIR",
    "DEFAULT_RECIPE",
    "RECIPES_DIR",
    "load_config",
    "require_run_name",
    "resolve_recipe",
    "validate",
]

CONFIGS_DIR = shipped_dir("configs")
RECIPES_DIR = shipped_dir("recipes")
DEFAULT_RECIPE = "tiny_gpt_cpu"
_SECTIONS = tuple(f.name for f in fields(RunCfg))


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
    if len(node) == 0:  # an empty file would train the library defaults under the default name
        raise ConfigError(
            f"{path}: the recipe is empty: expected a mapping of sections ({', '.join(_SECTIONS)}), "
            "at least name: ...; or run a packaged recipe (e.g. tiny_gpt_cpu)"
        )
    return node


def _merge(base: DictConfig, other, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        if key != "?" and not _is_known(base, key):
            raise ConfigError(_unknown_key(base, key, f"{origin}: key {key!r}")) from exc
        raise ConfigError(f"{origin}: key {key!r}: {_reason(exc)}") from exc


def _unknown_key(cfg: DictConfig, key: str, where: str) -> str:
    """An unknown key as one line: the valid keys of the section it names, the nearest first."""
    node, section = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            break
        node, section = node[part], [*section, part]
    if not isinstance(node, DictConfig):  # a key below a value (trainer.lr.x)
        return f"{where}: unknown key: {'.'.join(section)} is a value, not a section"
    prefix = ".".join(section) + "." if section else ""
    valid = [f"{prefix}{k}" for k in node.keys()]
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" (nearest: {near[0]!r})" if near else ""
    return f"{where}: unknown key{hint}; the keys of {'.'.join(section) or 'the top level'} are: {', '.join(valid)}"


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
    _open_mappings(schema)
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
            raise ConfigError(_unknown_key(cfg, key, f"override {key!r}"))
        try:
            dotted = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: cannot parse ({_reason(exc)})") from exc
        cfg = _merge(cfg, dotted, f"override {item!r}")
    validate(cfg)
    return cfg


def _open_mappings(node: DictConfig) -> None:
    """Let mapping fields (``quant.amax_reduction``: role -> mode) take new keys; every other
    node stays closed (struct). Their values are checked by the section's dataclass."""
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            if OmegaConf.get_type(child) is dict:
                OmegaConf.set_struct(child, False)
            else:
                _open_mappings(child)


def _is_known(cfg: DictConfig, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return False
        if part not in node:
            return OmegaConf.is_struct(node) is False  # a new key of an open mapping
        node = node[part]
    return True


def validate(cfg: DictConfig) -> None:
    """Build every section's dataclass from ``cfg``, so that each checks its own choices and
    bounds (``__post_init__``; ``QuantConfig`` for ``quant``); raise ConfigError naming the key."""
    require_run_name(cfg.name)
    for f in fields(RunCfg):
        if not is_dataclass(f.default_factory):
            continue
        try:
            if f.name == "quant":
                quant_config(cfg)
            else:
                f.default_factory(**OmegaConf.to_container(cfg[f.name], resolve=True))
        except ConfigError as exc:
            raise ConfigError(f"{f.name}.{exc}") from exc


def require_run_name(name: object) -> None:
    """A run name is one path component: the run directory is ``out_dir/name``, never elsewhere."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
    if not ok:
        raise ConfigError(
            f"name={name!r} is not allowed: expected a single path component (no '/', '\\', '.' or '..'); "
            "the run directory is out_dir/name, so choose the folder with out_dir=..."
        )


def quant_config(cfg: DictConfig) -> QuantConfig:
    """The library QuantConfig described by ``cfg.quant``."""
    return QuantConfig.from_dict(OmegaConf.to_container(cfg.quant, resolve=True))
