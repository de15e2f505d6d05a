"""The model a run trains, chosen by ``model.arch``: our GPT (``gpt``) or the Llama family
(``llama``: RMSNorm, SwiGLU, rotary positions, grouped-query attention), and for a Llama
optionally its weights from a local Hugging Face checkpoint folder (``model.init_from``).

The ``model`` section holds the keys of every architecture (``ModelCfg``, cli/schema.py); a
run names the ones of its own: a key of another architecture set away from its default is
refused, naming it. With ``model.init_from`` the folder's ``config.json`` sets the model's
shape (its vocabulary, widths, depth, heads, rotary base, norm epsilon, tied head): the run
configuration takes those values (so ``config.yaml`` records them and the data uses the
vocabulary), and a recipe value that disagrees is refused. ``model.seq_len`` and the
checkpointing keys stay the run's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..config import require_choice, require_that
from ..models import GPT, GPTConfig, Llama, LlamaConfig, load_hf_llama, read_hf_llama_config
from ..models.hf_llama import TRAINING_KEYS

__all__ = ["ARCHITECTURES", "adopt_init_from", "build_model", "model_config"]

ARCHITECTURES: dict[str, tuple[type[nn.Module], type]] = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}
# the keys every model section carries besides its architecture's own
_SECTION_KEYS = ("arch", "init_from")


def _defaults() -> dict:
    out = {}
    for _, config_cls in ARCHITECTURES.values():
        for f in dataclasses.fields(config_cls):
            out.setdefault(f.name, f.default)
    return out


def model_config(cfg: DictConfig) -> GPTConfig | LlamaConfig:
    """The architecture's config of ``cfg.model`` (``ConfigError`` naming a key that is not the
    architecture's yet set, or a value the config refuses)."""
    keys = OmegaConf.to_container(cfg.model, resolve=True)
    arch, init_from = keys.pop("arch"), keys.pop("init_from")
    require_choice("arch", arch, tuple(ARCHITECTURES))
    require_that(not init_from or arch == "llama", "init_from", repr(init_from), "'' unless arch='llama'")
    config_cls = ARCHITECTURES[arch][1]
    own = {f.name for f in dataclasses.fields(config_cls)}
    defaults = _defaults()
    for key, value in keys.items():
        if key not in own:
            require_that(value == defaults[key], key, repr(value), f"its default {defaults[key]!r} with arch={arch!r}")
    return config_cls(**{k: v for k, v in keys.items() if k in own})


def adopt_init_from(cfg: DictConfig) -> None:
    """With ``model.init_from``: the checkpoint's shape into ``cfg.model`` (in place), after
    checking the run's values agree with it (a value left at its default takes the folder's)."""
    folder = cfg.model.init_from
    if not folder:
        return
    require_that(cfg.model.arch == "llama", "init_from", repr(folder), "'' unless arch='llama'")
    hf = read_hf_llama_config(Path(folder))
    defaults = _defaults()
    for f in dataclasses.fields(LlamaConfig):
        if f.name in TRAINING_KEYS:
            continue
        theirs, ours = getattr(hf, f.name), cfg.model[f.name]
        if ours != defaults[f.name]:
            require_that(ours == theirs, f.name, repr(ours), f"{theirs!r}, the value of model.init_from={folder!r}")
        cfg.model[f.name] = theirs
    require_that(
        cfg.model.seq_len <= hf.seq_len,
        "seq_len",
        cfg.model.seq_len,
        f"at most {hf.seq_len}, the max_position_embeddings of model.init_from={folder!r}",
    )


def build_model(cfg: DictConfig, *, weights: bool = True) -> nn.Module:
    """The run's model: built from ``cfg.model``, with ``model.init_from``'s weights when
    ``weights`` (else freshly initialised, as a shape-only build on the meta device needs)."""
    config = model_config(cfg)
    if weights and cfg.model.init_from:
        training = {key: getattr(config, key) for key in TRAINING_KEYS}
        model, _ = load_hf_llama(cfg.model.init_from, training=training)
        return model
    return ARCHITECTURES[cfg.model.arch][0](config)
