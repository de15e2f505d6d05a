"""Load a Hugging Face Llama (or Mistral) checkpoint folder into :class:`~.llama.Llama`, without
importing transformers.

The folder is untrusted input (downloaded, or handed over): only ``config.json`` (at most 1 MiB),
``model.safetensors`` or the shards that ``model.safetensors.index.json`` names are read, each a
regular file directly inside the folder (no symbolic link, no path out of it), and never anything
pickled. The config is mapped key by key and whatever the model cannot reproduce is refused with
the key and what is allowed; the weights load strictly: every tensor the model has, of its shape,
and no other. Shapes are checked against the files' headers before anything is allocated, so a
config that claims a huge model costs nothing unless the files hold its bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import require_bool, require_choice, require_int, require_number, require_that, require_type
from ..errors import ConfigError, StateLoadError, UntrustedCheckpointError
from .llama import ROPE_TYPES, Llama, LlamaConfig, fuse_projections

__all__ = ["HF_MODEL_TYPES", "TRAINING_KEYS", "llama_config_from_hf", "load_hf_llama", "read_hf_llama_config"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_MAX_BYTES = 1 << 20
# an index names every tensor once: a few hundred KiB for the largest public models
INDEX_MAX_BYTES = 16 << 20
# Mistral's weights and blocks are Llama's; its sliding window is not (refused unless null)
HF_MODEL_TYPES = ("llama", "mistral")
# safetensors dtype names of the weights the model can hold
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
LOAD_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)
# rotary frequencies some older checkpoints stored; the model derives them from rope_theta
_DERIVED_SUFFIX = ".rotary_emb.inv_freq"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_ROPE_KEYS = ("rope_type", "rope_theta")
# Llama 3.1's rope scaling: its config.json keys, and LlamaConfig's fields they fill
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_LLAMA3_FIELDS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")


def read_hf_llama_config(folder: str | os.PathLike) -> LlamaConfig:
    """The :class:`~.llama.LlamaConfig` of the Hugging Face checkpoint folder ``folder``, read from
    its ``config.json`` (a regular file inside the folder, at most 1 MiB) without the weights."""
    root = Path(folder)
    if not root.is_dir():
        raise StateLoadError(f"{root}: not a folder; expected a Hugging Face checkpoint folder with {CONFIG_FILE}")
    config_path = _member(root, CONFIG_FILE, root)
    try:
        return llama_config_from_hf(_read_json(config_path, CONFIG_MAX_BYTES))
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None


# what a run may choose for a checkpoint's model: how long its sequences are (up to the
# checkpoint's max_position_embeddings), how its blocks are checkpointed, and whether its
# projections are fused (the checkpoint's separate ones concatenated at load)
TRAINING_KEYS = ("seq_len", "checkpoint", "checkpoint_engine", "use_reentrant", "fused_projections")


def load_hf_llama(
    folder: str | os.PathLike, *, dtype: torch.dtype | None = None, training: Mapping[str, Any] | None = None
) -> tuple[Llama, LlamaConfig]:
    """Build a :class:`~.llama.Llama` from a local Hugging Face checkpoint folder.

    Args:
        folder: holds ``config.json`` (``model_type`` llama, or mistral without a sliding
            window) and ``model.safetensors``, or the shards named by
            ``model.safetensors.index.json``.
        dtype: the parameters' dtype (float32, bfloat16, float16, float64); None: the dtype the
            weights are stored in (one for all of them).
        training: values of :data:`TRAINING_KEYS` for this run (a ``seq_len`` within the
            checkpoint's, the checkpointing of the blocks); the rest of the config is the folder's.

    Returns:
        ``(model, config)``: the model on the CPU, in training mode, its config's ``seq_len`` the
        checkpoint's ``max_position_embeddings``. The lm head is the embedding when the
        checkpoint ties them.

    Raises:
        ConfigError: ``dtype`` not allowed, or ``config.json`` asks for what the model does not
            have (the message names the key and what is allowed).
        UntrustedCheckpointError: a file that would be read is a symbolic link or not a regular
            file, or the index names a file outside the folder.
        StateLoadError: a file is missing, too large or unreadable, or the weights do not match
            the config: missing, unexpected or misshapen tensors, all named.
    """
    require_choice("dtype", dtype, LOAD_DTYPES)
    root = Path(folder)
    cfg = read_hf_llama_config(root)
    if training:
        unknown = sorted(set(training) - set(TRAINING_KEYS))
        require_that(not unknown, "training", unknown, f"keys among {list(TRAINING_KEYS)}")
        longest = cfg.seq_len
        cfg = dataclasses.replace(cfg, **training)
        require_int("seq_len", cfg.seq_len, 1, longest, why=f"the checkpoint's max_position_embeddings={longest}")
    config_path = root / CONFIG_FILE
    stored = _stored_tensors(root)
    if cfg.n_layers > len(stored):  # each layer is a tensor at least: the meta build below stays small
        raise StateLoadError(
            f"{config_path}: num_hidden_layers={cfg.n_layers}, but the weight files hold only {len(stored)} "
            "tensors; the config does not belong to these weights"
        )
    separate = dataclasses.replace(cfg, fused_projections=False)  # the checkpoint's own layout
    with torch.device("meta"):  # shapes and names only: no memory until the tensors are read
        model = Llama(separate)
    wanted = _check_tensors(model, stored, separate, root)
    state = _read_tensors(stored, wanted, dtype or _stored_dtype(stored, wanted))
    if cfg.tie_embeddings:
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state["embed_tokens.weight"]):
            raise StateLoadError(
                f"{root}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight; "
                "the checkpoint is inconsistent (set tie_word_embeddings to false to load both)"
            )
        state["lm_head.weight"] = state["embed_tokens.weight"]
    if cfg.fused_projections:  # q/k/v and gate/up concatenated, the model built fused
        state = fuse_projections(state, cfg)
        with torch.device("meta"):
            model = Llama(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign made the head a parameter of its own
    return model, cfg


def llama_config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
    """The :class:`~.llama.LlamaConfig` of a transformers Llama/Mistral ``config.json`` (parsed).

    The structural keys (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
    ``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings``) are required; the rest take
    transformers' defaults when absent. Refused, naming the key: another ``model_type``, a
    ``sliding_window``, a ``rope_scaling`` / ``rope_parameters`` of a ``rope_type`` other than
    default or llama3 (Llama 3.1's), ``attention_bias``/``mlp_bias``, ``hidden_act`` other than
    silu, attention dropout, a ``head_dim`` other than ``hidden_size / num_attention_heads``. Keys that do not change the
    forward (token ids, ``dtype``, ``pretraining_tp``, ...) are ignored.
    """
    require_type("config", hf, Mapping, "a JSON object")
    require_choice("model_type", hf.get("model_type"), HF_MODEL_TYPES)
    if hf["model_type"] == "mistral":
        require_choice("sliding_window", hf.get("sliding_window"), (None,), why="attention here is plain causal")
    require_choice("hidden_act", hf.get("hidden_act", "silu"), ("silu",), why="the MLP is SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        require_choice(key, hf.get(key, False), (False,), why="the projections have no bias")
    require_choice("attention_dropout", hf.get("attention_dropout", 0.0), (0,), why="attention has no dropout")
    sizes = {}
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
    ):
        if key not in hf:
            raise ConfigError(f"{key} is missing: expected an integer (the config of a Llama model has one)")
        require_int(key, hf[key], 2 if key == "vocab_size" else 1)
        sizes[key] = hf[key]
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    require_int("num_key_value_heads", kv_heads, 1)
    if hidden % heads:
        raise ConfigError(f"hidden_size={hidden} is not allowed: expected a multiple of num_attention_heads={heads}")
    if heads % kv_heads:
        raise ConfigError(
            f"num_key_value_heads={kv_heads} is not allowed: expected a divisor of num_attention_heads={heads}"
        )
    if (hidden // heads) % 2:
        raise ConfigError(
            f"hidden_size={hidden} is not allowed with num_attention_heads={heads}: expected an even head size "
            f"(rotary positions turn pairs of features), found {hidden // heads}"
        )
    if hf.get("head_dim") is not None:
        require_choice("head_dim", hf["head_dim"], (hidden // heads,), why="hidden_size / num_attention_heads")
    eps = require_number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6), 0, low_open=True)
    tie = hf.get("tie_word_embeddings", False)
    require_bool("tie_word_embeddings", tie)
    return LlamaConfig(
        vocab_size=sizes["vocab_size"],
        seq_len=sizes["max_position_embeddings"],
        d_model=hidden,
        n_layers=sizes["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden=sizes["intermediate_size"],
        **_rope(hf),
        norm_eps=eps,
        tie_embeddings=tie,
    )


def _rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary keys of :class:`~.llama.LlamaConfig`: transformers 5 writes ``rope_parameters``
    ({rope_type, rope_theta, and for llama3 its four numbers}), earlier versions ``rope_theta``
    beside ``rope_scaling`` ({rope_type or type, the four numbers}). Plain RoPE and Llama 3.1's
    ``llama3`` scaling are supported; any other type, or a key neither uses, is refused."""
    theta = hf.get("rope_theta", 10000.0)
    params, where = hf.get("rope_parameters"), "rope_parameters"
    if hf.get("rope_scaling") is not None:
        params, where = hf["rope_scaling"], "rope_scaling"
        if hf.get("rope_parameters") is not None:
            raise ConfigError("rope_scaling and rope_parameters are both set: expected one (transformers writes one)")
    if params is None:
        return {"rope_theta": require_number("rope_theta", theta, 0, low_open=True)}
    require_type(where, params, Mapping, "a JSON object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    require_choice(f"{where}.rope_type", kind, ROPE_TYPES, why="plain rotary positions or Llama 3.1's")
    allowed = (*_ROPE_KEYS, "type", *(_LLAMA3_KEYS if kind == "llama3" else ()))
    extra = sorted(set(params) - set(allowed))
    if extra:
        raise ConfigError(
            f"{where} keys {extra} are not allowed with rope_type={kind!r}: expected only {list(allowed)}"
        )
    out = {"rope_theta": require_number("rope_theta", params.get("rope_theta", theta), 0, low_open=True)}
    if kind == "llama3":
        missing = sorted(set(_LLAMA3_KEYS) - set(params))
        if missing:
            raise ConfigError(f"{where} of rope_type='llama3' lacks {missing}: expected all of {list(_LLAMA3_KEYS)}")
        out["rope_type"] = "llama3"
        for ours, theirs in zip(_LLAMA3_FIELDS, _LLAMA3_KEYS, strict=True):
            out[ours] = params[theirs]  # (LlamaConfig checks each)
    return out


def _member(root: Path, name: str, named_by: Path) -> Path:
    """``root / name``, where ``name`` (given by the folder's layout or by ``named_by``, the index)
    is a plain file name and the entry a regular file, not a link; else the error says which."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise UntrustedCheckpointError(named_by, f"the file {name!r} (a path, not a file name in the folder)")
    path = root / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise StateLoadError(
            f"{path}: not found; a Hugging Face checkpoint folder holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (or {INDEX_FILE} and the shards it names)"
        ) from None
    if stat.S_ISLNK(mode):
        raise UntrustedCheckpointError(path, f"a symbolic link (to {os.readlink(path)!r})")
    if not stat.S_ISREG(mode):
        raise UntrustedCheckpointError(path, "a special file (a folder, FIFO, socket or device) where a file belongs")
    return path


def _read_json(path: Path, limit: int) -> Any:
    """The JSON value in ``path`` (a regular file, opened without following a link), at most
    ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UntrustedCheckpointError(path, "a special file where a file belongs")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise StateLoadError(f"{path}: larger than {limit} bytes, which no Hugging Face {path.name} is; refused")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StateLoadError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from None


def _weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None, Path]:
    """The safetensors files to read, the index's weight map (None without an index), and the
    file that named them (the index, or the folder itself)."""
    if not os.path.lexists(root / INDEX_FILE):
        return [_member(root, WEIGHTS_FILE, root)], None, root
    index_path = _member(root, INDEX_FILE, root)
    index = _read_json(index_path, INDEX_MAX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise StateLoadError(f"{index_path}: expected a 'weight_map' of tensor names to file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not name.endswith(".safetensors"):
            raise UntrustedCheckpointError(index_path, f"the file {name!r} (not a .safetensors file)")
    return [_member(root, name, index_path) for name in names], weight_map, index_path


def _stored_tensors(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Every tensor the weight files hold: name -> (file, safetensors dtype, shape), read from
    the headers only (no tensor data); each name once, and where the index says it is."""
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415  (only the loader needs it)

    files, weight_map, named_by = _weight_files(root)
    stored: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    if name in stored:
                        raise StateLoadError(f"{path}: tensor {name!r} is also in {stored[name][0].name}")
                    if weight_map is not None and weight_map.get(name) != path.name:
                        raise StateLoadError(
                            f"{path}: holds tensor {name!r}, which {named_by.name} puts "
                            f"{'in ' + repr(weight_map[name]) if name in weight_map else 'nowhere'}"
                        )
                    part = f.get_slice(name)
                    stored[name] = (path, part.get_dtype(), tuple(part.get_shape()))
        except SafetensorError as exc:
            raise StateLoadError(f"{path}: not a readable safetensors file ({exc})") from None
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(stored))
        if absent:
            raise StateLoadError(f"{named_by}: names tensors its files do not hold: {_listed(absent)}")
    return stored


def _hf_name(name: str) -> str:
    """transformers' name of our parameter ``name`` (its decoder lives under ``model.``)."""
    return name if name == "lm_head.weight" else f"model.{name}"


def _check_tensors(
    model: Llama, stored: Mapping[str, tuple[Path, str, tuple[int, ...]]], cfg: LlamaConfig, root: Path
) -> dict[str, str]:
    """Our name -> transformers' name of every tensor to read, after checking that the files
    hold every parameter of ``model`` (built on the meta device), of its shape and a float dtype,
    and nothing else. A tied checkpoint may hold ``lm_head.weight`` too (read, and held equal to
    the embedding by the caller)."""
    expected = {_hf_name(name): (name, tuple(p.shape)) for name, p in model.state_dict().items()}
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    missing = sorted(n for n in expected if n not in stored and n not in optional)
    unexpected = sorted(n for n in stored if n not in expected and not n.endswith(_DERIVED_SUFFIX))
    if missing or unexpected:
        found = [f"missing {_listed(missing)}"] if missing else []
        found += [f"unexpected {_listed(unexpected)}"] if unexpected else []
        raise StateLoadError(
            f"{root}: the weights do not match config.json ({cfg.n_layers} layers): {'; '.join(found)}; "
            "nothing was loaded"
        )
    wanted = {}
    for theirs, (mine, shape) in expected.items():
        if theirs not in stored:
            continue
        path, kind, have = stored[theirs]
        if have != shape:
            raise StateLoadError(f"{path}: tensor {theirs!r} has shape {list(have)}; config.json gives {list(shape)}")
        if kind not in _FLOAT_DTYPES:
            raise StateLoadError(
                f"{path}: tensor {theirs!r} is {kind}; expected one of {sorted(_FLOAT_DTYPES)} (quantized "
                "checkpoints are not supported)"
            )
        wanted[mine] = theirs
    return wanted


def _stored_dtype(stored: Mapping[str, tuple[Path, str, tuple[int, ...]]], wanted: Mapping[str, str]) -> torch.dtype:
    kinds = sorted({stored[theirs][1] for theirs in wanted.values()})
    if len(kinds) != 1:
        raise ConfigError(
            f"dtype=None is not allowed for weights stored in several dtypes {kinds}: pass dtype= (torch.float32, ...)"
        )
    return _FLOAT_DTYPES[kinds[0]]


def _read_tensors(
    stored: Mapping[str, tuple[Path, str, tuple[int, ...]]], wanted: Mapping[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Our name -> tensor (``dtype``, CPU) of every tensor in ``wanted``, one file open at a time."""
    from safetensors import safe_open  # noqa: PLC0415

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for mine, theirs in wanted.items():
        by_file.setdefault(stored[theirs][0], []).append((mine, theirs))
    state = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for mine, theirs in names:
                state[mine] = f.get_tensor(theirs).to(dtype)
    return state


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
