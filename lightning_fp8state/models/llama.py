"""A Llama-family decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU) whose
blocks run through the recompute-safe checkpoint wrapper, like :class:`~.gpt.GPT`.

Every op follows Hugging Face transformers' ``LlamaForCausalLM`` in the same order and dtype
(RMSNorm in float32 then cast back before the weight, the rotary tables computed in float32 and
cast to the hidden states' dtype, "rotate_half" rotary, SDPA with ``scale=head_dim**-0.5``), and
the module names mirror its own (``layers.0.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...): its weights load with no permutation (``hf_llama.load_hf_llama``) and
the logits equal its logits bitwise in float32 on the CPU (``tests/unit/test_llama.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from ..config import require_bool, require_choice, require_int, require_number
from ..errors import ConfigError
from ..nn import GroupedExperts, linear_after, register_rms_norm
from ..recompute import ENGINES
from .blocks import next_token_loss, run_blocks
from .moe import MoEFeedForward

__all__ = ["Llama", "LlamaConfig", "llama_ffn_hidden"]

# torch >= 2.5 repeats k/v across a group inside scaled_dot_product_attention (enable_gqa);
# before, they are repeated here, as transformers does on either side of that version.
_SDPA_GQA = TorchVersion(torch.__version__) >= (2, 5)
# LlamaConfig.rope_type: plain rotary positions, or Llama 3.1's frequency scaling
ROPE_TYPES = ("default", "llama3")


def llama_ffn_hidden(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The SwiGLU hidden size Meta's Llama derives from ``d_model``: two thirds of ``4 * d_model``
    (times ``ffn_dim_multiplier``, Llama 3), rounded up to a multiple of ``multiple_of``
    (Llama 2 7B: 4096 -> 11008; Llama 3 8B, multiplier 1.3, multiple of 1024: 4096 -> 14336)."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class LlamaConfig:
    """The shape of a :class:`Llama`; every field is checked when the config is made."""

    vocab_size: int = 64
    # the longest input (positions 0 .. seq_len-1); transformers' max_position_embeddings
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    # key/value heads, each shared by n_heads // n_kv_heads query heads (grouped-query
    # attention); None: n_heads (multi-head attention). Set to the number when the config is made.
    n_kv_heads: int | None = None
    # SwiGLU hidden size; None: derived from d_model as Meta's Llama does (llama_ffn_hidden, with
    # multiple_of and ffn_dim_multiplier below). Set to the number when the config is made.
    ffn_hidden: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    # base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000)
    rope_theta: float = 10000.0
    # default: plain rotary positions. llama3: Llama 3.1 / 3.2's frequency scaling (their
    # config.json's rope_scaling / rope_parameters): wavelengths longer than
    # rope_original_positions / rope_low_freq_factor divided by rope_factor, shorter than
    # rope_original_positions / rope_high_freq_factor kept, those between blended smoothly
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    # RMSNorm's epsilon, added to the mean square
    norm_eps: float = 1e-5
    # the lm head's weight is the token embedding's
    tie_embeddings: bool = False
    # activation checkpointing of every block, and through which engine
    checkpoint: bool = True
    checkpoint_engine: str = "torch"  # torch | deepspeed
    use_reentrant: bool = False
    # one q/k/v projection (qkv_proj) and one gate/up projection (gate_up_proj) per block, with the
    # RMSNorms and SwiGLU fused into their FP8 input encodes (linear_after); False: transformers'
    # separate projections, module for module (a Hugging Face checkpoint loads either way)
    fused_projections: bool = False
    # mixture of experts (models/moe.py): the number of experts of every block's feed-forward, each a
    # SwiGLU of ffn_hidden; 0: the dense feed-forward. The experts' projections are not fused (the
    # attention's still are with fused_projections)
    moe_experts: int = 0
    # the experts each token is routed to (top-k of the router's softmax, renormalized)
    moe_top_k: int = 2
    # a dense SwiGLU expert of ffn_hidden that every token also goes through (its output added)
    moe_shared_expert: bool = False
    # the weight of the load-balancing auxiliary loss (its gradient added in backward); 0: none
    moe_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        require_int("vocab_size", self.vocab_size, 2)
        for key in ("seq_len", "d_model", "n_layers", "n_heads", "multiple_of"):
            require_int(key, getattr(self, key), 1)
        require_int("n_kv_heads", self.n_kv_heads, 1, optional=True)
        require_int("ffn_hidden", self.ffn_hidden, 1, optional=True)
        self.ffn_dim_multiplier = require_number(
            "ffn_dim_multiplier", self.ffn_dim_multiplier, 0, low_open=True, optional=True
        )
        self.rope_theta = require_number("rope_theta", self.rope_theta, 0, low_open=True)
        require_choice("rope_type", self.rope_type, ROPE_TYPES)
        for key in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            setattr(self, key, require_number(key, getattr(self, key), 0, low_open=True))
        require_int("rope_original_positions", self.rope_original_positions, 1)
        if self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"rope_high_freq_factor={self.rope_high_freq_factor} is not allowed: expected more than "
                f"rope_low_freq_factor={self.rope_low_freq_factor} (the blend between them divides by the difference)"
            )
        self.norm_eps = require_number("norm_eps", self.norm_eps, 0, low_open=True)
        for key in ("tie_embeddings", "checkpoint", "use_reentrant", "fused_projections", "moe_shared_expert"):
            require_bool(key, getattr(self, key))
        require_int("moe_experts", self.moe_experts, 0)
        bound = f"moe_experts={self.moe_experts}: a token goes to distinct experts" if self.moe_experts else ""
        require_int("moe_top_k", self.moe_top_k, 1, self.moe_experts or None, why=bound)
        self.moe_aux_loss_coef = require_number("moe_aux_loss_coef", self.moe_aux_loss_coef, 0)
        require_choice("checkpoint_engine", self.checkpoint_engine, ENGINES)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not allowed: expected a multiple of n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(
                f"d_model={self.d_model} is not allowed with n_heads={self.n_heads}: expected an even head size "
                f"d_model / n_heads (rotary positions turn pairs of features), found {self.head_dim}"
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} is not allowed: expected a divisor of n_heads={self.n_heads} "
                "(each key/value head serves the same number of query heads)"
            )
        if self.ffn_hidden is None:
            self.ffn_hidden = llama_ffn_hidden(self.d_model, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@register_rms_norm  # its forward is the formula the fused rms_norm prologue computes
class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm op for op: normalized in float32, cast back to the input's
    dtype, then scaled by the weight in that dtype. (``nn.RMSNorm`` equals it in float32 on the
    CPU but scales in float32 before the cast, so it differs in bfloat16.)"""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """The rotary cos/sin tables, shared by every block: computed in float32 once per
    (sequence length, device, dtype) by :meth:`prepare` and kept as non-persistent buffers.

    The tables are computed for exactly the input's length, with transformers' ops (the
    frequencies on the CPU, an outer product by matmul, ``cat``, ``cos``/``sin``): vectorized
    ``cos`` may round a tensor's tail elements differently from its body, so a table of another
    length could differ from transformers' in the last bit."""

    def __init__(self, head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # (factor, low_freq_factor, high_freq_factor, original positions): Llama 3.1's scaling
        self.llama3 = llama3
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self._key: tuple | None = None  # (seq_len, device, dtype) of the tables held

    def prepare(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Make ``cos``/``sin`` the ``[seq_len, head_dim]`` tables for ``device`` and ``dtype``.

        Called outside the checkpointed blocks (they only read the tables), so a recompute never
        sees a table change."""
        key = (seq_len, torch.device(device), dtype)
        held = self.cos
        if self._key == key and held is not None and held.device == key[1] and held.dtype == dtype:
            return  # (a module .to() moves or casts the buffers without telling us: checked too)
        # the frequencies on the CPU, in float32, as transformers computes them at construction
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        if self.llama3 is not None:
            inv_freq = _llama3_frequencies(inv_freq, *self.llama3)
        inv_freq = inv_freq.to(device)
        positions = torch.arange(seq_len, device=device).to(torch.float32)
        with torch.autocast(key[1].type, enabled=False):
            freqs = (inv_freq[None, :, None] @ positions[None, None, :]).transpose(1, 2)
            angles = torch.cat((freqs, freqs), dim=-1)[0]
            self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self._key = key

    def extra_repr(self) -> str:
        scaled = "" if self.llama3 is None else f", llama3 scaling {self.llama3}"
        return f"head_dim={self.head_dim}, theta={self.theta:g}{scaled}"


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, low: float, high: float, positions: int) -> torch.Tensor:
    """Llama 3.1's rotary frequencies from the plain ones (float32, on the CPU, in the op order
    transformers uses, so the tables are bitwise its own): a wavelength longer than
    ``positions / low`` is stretched by ``factor``, one shorter than ``positions / high`` kept,
    and one between them blends the two by where ``positions / wavelength`` lies in [low, high]."""
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > positions / low, inv_freq / factor, inv_freq)
    blend = (positions / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / factor + blend * stretched
    between = ~(wavelength < positions / high) * ~(wavelength > positions / low)
    return torch.where(between, blended, stretched)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim: the rotary convention of transformers'
    Llama (halves, not interleaved pairs), so its q/k weights need no permutation."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, kv_heads, t, d] -> [b, kv_heads * n_rep, t, d]``, each head repeated ``n_rep`` times."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary q and k; no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.scaling = hd**-0.5
        self.widths = (cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd)
        if cfg.fused_projections:
            self.qkv_proj = nn.Linear(d, sum(self.widths), bias=False)
        else:
            self.q_proj = nn.Linear(d, cfg.n_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(d, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, d, bias=False)

    def _qkv(self, x: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, ...]:
        """q, k, v of ``norm(x)``: one projection with the norm fused into its FP8 encode, or
        transformers' three."""
        if hasattr(self, "qkv_proj"):
            return linear_after(self.qkv_proj, x, norm=norm).split(self.widths, dim=-1)
        h = norm(x)
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def forward(self, x: torch.Tensor, norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in self._qkv(x, norm))
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        groups = self.n_heads // self.n_kv_heads
        if _SDPA_GQA and groups > 1:
            att = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, is_causal=t > 1, enable_gqa=True)
        else:
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            att = F.scaled_dot_product_attention(q, k, v, scale=self.scaling, is_causal=t > 1)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.fused_projections:  # [gate; up]: the swiglu prologue's input layout
            self.gate_up_proj = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
            self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):  # the norm fused into gate_up's encode, SwiGLU into down's
            return linear_after(self.down_proj, linear_after(self.gate_up_proj, x, norm=norm), activation="swiglu")
        h = norm(x)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def moe_feed_forward(cfg: LlamaConfig) -> MoEFeedForward:
    """The block's mixture-of-experts feed-forward (``cfg.moe_experts > 0``)."""
    shared = LlamaMLP(replace(cfg, fused_projections=False)) if cfg.moe_shared_expert else None
    return MoEFeedForward(cfg.d_model, cfg.ffn_hidden, cfg.moe_experts, cfg.moe_top_k, cfg.moe_aux_loss_coef, shared)


class LlamaBlock(nn.Module):
    """Pre-norm decoder block mapping one tensor to one tensor (the checkpoint and graph
    contract of :class:`~.gpt.GPT`'s blocks): the rotary tables are read from the model's shared
    :class:`RotaryEmbedding`, held here by a plain reference and not registered as a submodule,
    so the module tree stays a tree (one owner moves it, no block's checkpoint region claims its
    buffers) and the state dict names match transformers'."""

    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = moe_feed_forward(cfg) if cfg.moe_experts else LlamaMLP(cfg)
        object.__setattr__(self, "rotary", rotary)  # bypasses nn.Module's submodule registration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x, self.input_layernorm, self.rotary.cos, self.rotary.sin)
        return x + self.mlp(x, self.post_attention_layernorm)


class Llama(nn.Module):
    """Token embedding, ``n_layers`` checkpointed decoder blocks, final RMSNorm, lm head (tied to
    the embedding when ``cfg.tie_embeddings``). Parameters are drawn from N(0, 0.02), norms start
    at one (transformers' initialization); :func:`~.hf_llama.load_hf_llama` loads trained ones."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        llama3 = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_positions)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, llama3 if cfg.rope_type == "llama3" else None)
        self.layers = nn.ModuleList(LlamaBlock(cfg, self.rotary_emb) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(_init_weights)
        self.tie_weights()
        # what runs the blocks while training, in place of the loop below: e.g. GraphedBlocks
        # (per-block CUDA graphs); None: the loop
        self.blocks_runner = None

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder blocks under the name :class:`~.gpt.GPT` gives them (what ``GraphedBlocks``
        and the trainer run); ``layers`` is transformers' name, the one in the state dict."""
        return self.layers

    def tie_weights(self) -> None:
        """Make the lm head's weight the embedding's (one parameter) when ``cfg.tie_embeddings``;
        after anything that replaces parameters (``load_state_dict(assign=True)``)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        require_int("idx.shape[1]", t, 1, self.cfg.seq_len, why="the model's seq_len")
        x = self.embed_tokens(idx)
        self.rotary_emb.prepare(t, x.device, x.dtype)
        if self.blocks_runner is not None and torch.is_grad_enabled():
            return self.lm_head(self.norm(self.blocks_runner(x)))
        return self.lm_head(self.norm(run_blocks(self.layers, x, self.cfg)))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self(idx), targets)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, GroupedExperts):
        for name in module.projections:
            nn.init.normal_(getattr(module, name), mean=0.0, std=0.02)


def fuse_projections(state: dict, cfg: LlamaConfig) -> dict:
    """A state dict of transformers' separate projections as one of ``fused_projections``
    (q, k, v concatenated into ``qkv_proj``; gate, up into ``gate_up_proj``), tensors shared
    where nothing is concatenated."""
    out = {}
    for name, value in state.items():
        prefix, _, leaf = name.rpartition(".self_attn.")
        if leaf in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            if leaf.startswith("q_"):
                parts = [state[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
                out[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat(parts, 0)
            continue
        prefix, _, leaf = name.rpartition(".mlp.")
        if leaf in ("gate_proj.weight", "up_proj.weight"):
            if leaf.startswith("gate"):
                parts = [state[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")]
                out[f"{prefix}.mlp.gate_up_proj.weight"] = torch.cat(parts, 0)
            continue
        out[name] = value
    return out
