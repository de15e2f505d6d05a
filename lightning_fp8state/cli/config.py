"""Loading a run configuration: schema defaults <- configs/ pieces <- recipe <- (an override
switching ``quant.recipe``: that recipe's ``configs/quant`` piece) <- overrides.

A recipe is a YAML file (a path, or a name under ``recipes/``) that may list reusable
pieces under ``base:`` (paths relative to ``configs/``, or to the recipe's own folder); both
folders ship with the package (:mod:`lightning_fp8state.shipped`). The schema's defaults are the
library's own (``cli/schema.py``); a recipe that wants others says so. Every error — unknown key,
wrong type, value out of range, missing file — is a ``ConfigError`` whose message names the key
(or path) and what is allowed.

A recipe, a received run's ``config.yaml`` and a command-line override are data, not programs:

- an interpolation may refer to another key (``${trainer.lr}``) but call no resolver
  (``${oc.env:VAR}`` read the environment into ``config.yaml``, checkpoints and W&B; any
  ``${name:...}`` is refused, naming the key);
- a ``base:`` piece is a plain relative path (no ``..``, not absolute) to a file inside the
  package's ``configs/`` or the recipe's own folder, and stays inside it through links;
- a YAML file is at most :data:`MAX_YAML_BYTES`, UTF-8, and uses no aliases (``*anchor``: a few
  lines of them expand to gigabytes).
"""

from __future__ import annotations

import difflib
import io
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import QuantConfig
from ..errors import ConfigError
from ..quant_recipes import check_recipe, recipe_names
from ..shipped import shipped_dir
from .models import adopt_init_from, model_config
from .schema import RunCfg

__all__ = [
    "CONFIGS_DIR",
    "DEFAULT_RECIPE",
    "MAX_YAML_BYTES",
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
MAX_YAML_BYTES = 1 << 20  # a recipe or config.yaml is a few KiB; 50 MB once took gigabytes of memory
# an interpolation that calls a resolver: ${name:...} (oc.env, oc.decode, any registered one)
_RESOLVER = re.compile(r"\$\{\s*[\w.\-]+\s*:")


def resolve_recipe(recipe: str | None) -> Path:
    """A recipe path, or a recipe name from the package (``tiny_gpt_cpu`` by default)."""
    name = recipe or DEFAULT_RECIPE
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"recipe {name!r} is a directory: pass a recipe's YAML file, or a packaged recipe's name")
    packaged = RECIPES_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if packaged.is_file():
        return packaged
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"recipe {name!r}: no such file, and no packaged recipe by that name (known: {known})")


def _read_yaml_text(path: Path) -> str:
    """The file's text: at most MAX_YAML_BYTES, UTF-8, no YAML alias; else ConfigError naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from exc
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES // 1024} KiB: not a recipe or run config")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} on line {line}); save it as UTF-8"
        ) from None
    try:
        alias = next((t for t in yaml.scan(text) if isinstance(t, yaml.AliasToken)), None)
    except yaml.YAMLError:
        return text  # the parser below says where the syntax is wrong
    if alias is not None:
        raise ConfigError(
            f"{path}, line {alias.start_mark.line + 1}: YAML alias *{alias.value} is not allowed in a recipe "
            "(aliases can expand a small file to gigabytes); write the values out"
        )
    return text


def _refuse_resolvers(node, origin: str) -> None:
    """No value of ``node`` calls a resolver (``${oc.env:VAR}`` and the like): ConfigError naming
    the key. Plain references to other keys (``${trainer.lr}``) stay allowed."""
    raw = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node

    def walk(value, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")
        elif isinstance(value, str) and _RESOLVER.search(value):
            raise ConfigError(
                f"{origin}: key {key!r}: the interpolation {value!r} calls a resolver, which is not allowed: a "
                "recipe, a run's config.yaml and an override are data (a resolver such as oc.env reads the "
                "environment or files into the run's files); write the value itself, or ${other.key}"
            )

    walk(raw, "")


def _load_yaml(path: Path) -> DictConfig:
    stream = io.StringIO(_read_yaml_text(path))
    stream.name = str(path)  # YAML's error marks name the file
    try:
        node = OmegaConf.load(stream)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if len(node) == 0:  # an empty file would train the library defaults under the default name
        raise ConfigError(
            f"{path}: the recipe is empty: expected a mapping of sections ({', '.join(_SECTIONS)}), "
            "at least name: ...; or run a packaged recipe (e.g. tiny_gpt_cpu)"
        )
    _refuse_resolvers(node, str(path))
    return node


def _base_piece(recipe: Path, piece) -> Path:
    """A ``base:`` piece: a plain relative path to a YAML file inside the package's ``configs/``
    or the recipe's own folder (looked up in that order), which stays inside it through links."""
    text = str(piece)
    rel = Path(text if text.endswith(".yaml") else f"{text}.yaml")
    if not isinstance(piece, str) or rel.is_absolute() or ".." in rel.parts:
        raise ConfigError(
            f"{recipe}: base piece {piece!r} is not allowed: expected a relative path inside {CONFIGS_DIR} or "
            f"the recipe's folder {recipe.parent} (no '..', not absolute)"
        )
    for root in (CONFIGS_DIR, recipe.parent):
        candidate = root / rel
        if candidate.is_file():
            if not candidate.resolve().is_relative_to(root.resolve()):
                raise ConfigError(f"{recipe}: base piece {piece!r} leads outside {root} through a link")
            return candidate
    raise ConfigError(f"{recipe}: base piece {piece!r}: no such file under {CONFIGS_DIR} or {recipe.parent}")


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
    if not value.strip():
        raise ConfigError(f"override {item!r}: {key.strip()} needs a value: expected {key.strip()}=VALUE")
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
        piece_path = _base_piece(path, piece)
        cfg = _merge(cfg, _load_yaml(piece_path), str(piece_path))
    cfg = _merge(cfg, node, str(path))
    cfg = _with_switched_recipe_piece(cfg, overrides or [])
    for item in overrides or []:
        key, _ = _parse_override(item)
        if not _is_known(cfg, key):
            raise ConfigError(_unknown_key(cfg, key, f"override {key!r}"))
        try:
            dotted = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: cannot parse ({_reason(exc)})") from exc
        _refuse_resolvers(dotted, f"override {item!r}")
        cfg = _merge(cfg, dotted, f"override {item!r}")
    try:
        adopt_init_from(cfg)
    except ConfigError as exc:
        raise ConfigError(f"model.{exc}") from exc
    validate(cfg)
    return cfg


def _with_switched_recipe_piece(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """``cfg`` with ``configs/quant/NAME.yaml`` merged in where an override switches the run to
    another quantization recipe ``NAME`` (``quant.recipe=NAME``): the recipe's shipped settings
    (its formats, margin, mode) come with it, as a recipe YAML's ``base: [quant/NAME]`` brings
    them, under every override (a key the user sets still wins). Without it the schema's
    per-tensor defaults stayed: ``fp8_rowwise`` and ``fp8_blockwise`` ran E5M2 gradients, whose
    GEMMs fall back to a float32 emulation. A name the registry does not list is left to the
    validation (an error naming ``quant.recipe``), never looked up as a file."""
    names = [value.strip() for key, value in map(_parse_override, overrides) if key == "quant.recipe"]
    if not names or names[-1] == cfg.quant.recipe or names[-1] not in recipe_names():
        return cfg
    piece_path = CONFIGS_DIR / "quant" / f"{names[-1]}.yaml"
    return _merge(cfg, _load_yaml(piece_path), str(piece_path)) if piece_path.is_file() else cfg


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
            elif f.name == "model":
                model_config(cfg)
            else:
                f.default_factory(**OmegaConf.to_container(cfg[f.name], resolve=True))
        except ConfigError as exc:
            raise ConfigError(f"{f.name}.{exc}") from exc


def require_run_name(name: object) -> None:
    """A run name is one path component: the run directory is ``out_dir/name``, never elsewhere."""
    ok = (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name)
    )
    if not ok:
        raise ConfigError(
            f"name={name!r} is not allowed: expected a single path component (no '/', '\\', '.' or '..', no "
            "control character such as a newline); "
            "the run directory is out_dir/name, so choose the folder with out_dir=..."
        )


def quant_config(cfg: DictConfig) -> QuantConfig:
    """The library QuantConfig described by ``cfg.quant``, its recipe and mode checked; a size
    rule's ``quant.policy.tokens`` left 0 is the run's: ``data.batch_size x model.seq_len``."""
    values = OmegaConf.to_container(cfg.quant, resolve=True)
    policy = values.get("policy")
    if isinstance(policy, dict) and not policy.get("tokens") and str(policy.get("by_size")) not in ("off", "False"):
        policy["tokens"] = int(cfg.data.batch_size) * int(cfg.model.seq_len)
    config = QuantConfig.from_dict(values)
    check_recipe(config)
    return config
