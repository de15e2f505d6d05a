"""torch's own attention and encoder modules, quantized: ``nn.MultiheadAttention`` whose in- and
out-projections are FP8 GEMMs, and ``nn.TransformerEncoderLayer`` without the eval fast path that
would read its converted layers' weights directly.

``nn.MultiheadAttention`` keeps its in-projection as a bare parameter (``in_proj_weight [3E, E]``,
or ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ) and hands it, with ``out_proj.weight``, to
``F.multi_head_attention_forward``: no module's forward runs for them, so no Linear swap can
quantize them. :class:`Fp8MultiheadAttention` runs that function's computation itself (every
option: masks, ``need_weights``, ``bias_k``/``bias_v``, ``add_zero_attn``, ``is_causal``,
dropout, unbatched input), with the projections as protocol calls: the packed in-projection as
one FP8 GEMM for self-attention (``query is key is value``), q and packed kv for
encoder-decoder attention (``key is value``), three otherwise, each call its own owners
(layer ``<mha>.in_proj``, ``<mha>.in_proj.q|kv|k|v``, or ``<mha>.q_proj|k_proj|v_proj`` for
separate weights), and ``out_proj`` an :class:`~lightning_fp8state.nn.Fp8Linear` it calls.
With the projections unquantized (the ``bf16`` recipe) it is bitwise ``nn.MultiheadAttention``'s
slow path. It never takes torch's fast path (``torch._native_multi_head_attention``).

``nn.TransformerEncoderLayer.forward`` runs ``torch._transformer_encoder_layer_fwd`` in eval under
``no_grad`` (and ``nn.TransformerEncoder`` converts padded batches to nested tensors for it),
reading ``linear1``/``linear2``/``self_attn`` weights directly: a converted layer would silently
run in high precision there. :class:`Fp8TransformerEncoderLayer` is the same layer whose
forward is torch's other path (its modules called in order), so eval quantizes as training does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import require_that
from ..protocol import QuantProtocol
from .linear import apply_linear_fn
from .linear_call import LINEAR_ROLES, fp8_linear_op, op_key

__all__ = ["Fp8MultiheadAttention", "Fp8Projection", "Fp8TransformerEncoderLayer", "mha_projections"]


def mha_projections(mha: nn.MultiheadAttention) -> dict[str, tuple[str, ...]]:
    """The in-projection entries of ``mha`` (relative names) and the layer names their calls
    take: ``{"in_proj": ("in_proj", "in_proj.q", "in_proj.kv", "in_proj.k", "in_proj.v")}`` for a
    packed weight, ``{"q_proj": ("q_proj",), ...}`` for separate ones."""
    if mha._qkv_same_embed_dim:
        return {"in_proj": ("in_proj", "in_proj.q", "in_proj.kv", "in_proj.k", "in_proj.v")}
    return {p: (p,) for p in ("q_proj", "k_proj", "v_proj")}


class Fp8Projection:
    """One quantized GEMM on a weight its parent owns (a parameter or a view of one), under the
    layer name ``layer_name``: an :class:`~lightning_fp8state.nn.Fp8Linear` call without a module
    of its own (same Function, roles, snapshots; torch.compile's op names it by its key)."""

    def __init__(self, protocol: QuantProtocol, layer_name: str) -> None:
        self.protocol = protocol
        self.layer_name = layer_name
        if protocol.fallback is not None:  # QuantConfig.fallback may move it: _call runs its route
            protocol.fallback.movable.add(layer_name)
        self._op_key = op_key(self)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            protocol = self.protocol
            moved = protocol.fallen_back and self.layer_name in protocol.fallen_back  # a graph of its own
            if protocol.recipe.quantized and protocol.recipe.compiled_op and not moved:
                return fp8_linear_op(self, x, weight, bias, None, None)
            return self._call_outside_graph(x, weight, bias)
        return self._call(x, weight, bias)

    def _call(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        protocol = self.protocol
        config = protocol.config
        # a layer the fallback moved (QuantConfig.fallback) runs its target's recipe, as Fp8Linear does
        recipe = protocol.recipe_of(self.layer_name) if protocol.layer_recipes else protocol.recipe
        quantized = recipe.quantized
        phase, record = protocol.enter_call(self.layer_name, LINEAR_ROLES if quantized else (), x.device)
        if not quantized:
            out = F.linear(x, weight, bias)
            protocol.observe_output(record, phase, out, {})
            return out
        if not x.is_contiguous():
            x = x.contiguous()
        args = (x, weight, bias, None, None, protocol, record, phase)
        out = apply_linear_fn(args, x, config.gemm, None)
        protocol.observe_output(record, phase, out, record.used)
        return out

    _call_outside_graph = torch.compiler.disable(_call)


def _heads_first(t: torch.Tensor, parts: int, e: int) -> torch.Tensor:
    # [..., parts * E] -> [parts, ..., E], as torch's _in_projection_packed lays it out
    return t.unflatten(-1, (parts, e)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()


class Fp8MultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with FP8 projections (see the module docstring). Made by
    :meth:`convert` from an existing module, in place (its class changes; parameters, hooks and
    state dict keys stay); ``out_proj`` is converted by ``convert_model`` like any Linear."""

    protocol: QuantProtocol
    layer_name: str
    fp8_in_proj: frozenset  # the in-projection entries quantized ("in_proj" | "q_proj", "k_proj", "v_proj")

    @classmethod
    def convert(
        cls, mha: nn.MultiheadAttention, *, protocol: QuantProtocol, layer_name: str, in_proj: frozenset
    ) -> Fp8MultiheadAttention:
        """Make ``mha`` (exactly an ``nn.MultiheadAttention``) one of these, quantizing the
        in-projection entries named in ``in_proj`` (see :func:`mha_projections`)."""
        mha.__class__ = cls
        mha.protocol = getattr(protocol, "protocol", protocol)
        mha.layer_name = layer_name
        mha.fp8_in_proj = frozenset(in_proj)
        # made here, not at the first call: torch.compile's op finds them by key at run time
        mha._projections = {
            part: Fp8Projection(mha.protocol, f"{layer_name}.{part}" if layer_name else part)
            for entry, parts in mha_projections(mha).items()
            if entry in mha.fp8_in_proj
            for part in parts
        }
        return mha

    def extra_repr(self) -> str:
        quantized = ", ".join(sorted(self.fp8_in_proj)) or "none"
        return f"{super().extra_repr()}layer={self.layer_name!r}, fp8 in-projection: {quantized}"

    def _project(self, entry: str, part: str, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        if entry not in self.fp8_in_proj:
            return F.linear(x, weight, bias)
        return self._projections[part](x, weight, bias)

    def _in_projection(self, query, key, value):
        if not self._qkv_same_embed_dim:
            b_q = b_k = b_v = None
            if self.in_proj_bias is not None:
                b_q, b_k, b_v = self.in_proj_bias.chunk(3)
            return (
                self._project("q_proj", "q_proj", query, self.q_proj_weight, b_q),
                self._project("k_proj", "k_proj", key, self.k_proj_weight, b_k),
                self._project("v_proj", "v_proj", value, self.v_proj_weight, b_v),
            )
        w, b = self.in_proj_weight, self.in_proj_bias
        e = query.size(-1)
        if key is value:
            if query is key:  # self-attention: one GEMM on the packed weight
                proj = _heads_first(self._project("in_proj", "in_proj", query, w, b), 3, e)
                return proj[0], proj[1], proj[2]
            w_q, w_kv = w.split([e, e * 2])
            b_q, b_kv = (None, None) if b is None else b.split([e, e * 2])
            q = self._project("in_proj", "in_proj.q", query, w_q, b_q)
            kv = _heads_first(self._project("in_proj", "in_proj.kv", key, w_kv, b_kv), 2, e)
            return q, kv[0], kv[1]
        w_q, w_k, w_v = w.chunk(3)
        b_q, b_k, b_v = (None, None, None) if b is None else b.chunk(3)
        return (
            self._project("in_proj", "in_proj.q", query, w_q, b_q),
            self._project("in_proj", "in_proj.k", key, w_k, b_k),
            self._project("in_proj", "in_proj.v", value, w_v, b_v),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention.forward``'s slow path with the projections in FP8."""
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        nested = [name for name, t in (("query", query), ("key", key), ("value", value)) if t.is_nested]
        require_that(
            not nested,
            f"{self.layer_name}: {' and '.join(nested)}",
            "a nested tensor",
            "padded tensors with a key_padding_mask (Fp8MultiheadAttention does not take nested tensors; torch's "
            "fast path does, running the projections in high precision)",
        )
        if self.batch_first and is_batched:  # keep the "is" relations the in-projection reads
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._attention(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )
        if self.batch_first and is_batched:
            return out.transpose(1, 0), weights
        return out, weights

    def _attention(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
        """``F.multi_head_attention_forward`` (torch 2.13) with the in-projection through
        :meth:`_in_projection` and the out-projection through ``self.out_proj``, in torch's order:
        the masks made canonical and the shapes checked, the in-projection, the heads laid out,
        then the attention (with its weights, or through SDPA) and the out-projection."""
        num_heads = self.num_heads
        is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        key_padding_mask, attn_mask, is_causal = _canonical_masks(
            query, key_padding_mask, attn_mask, need_weights, is_causal
        )
        self._check_embeddings(embed_dim, key, value)
        q, k, v = self._in_projection(query, key, value)
        attn_mask = _checked_attn_mask(attn_mask, (tgt_len, src_len), (bsz * num_heads, tgt_len, src_len))
        q, k, v, attn_mask = self._heads(q, k, v, attn_mask, key_padding_mask, tgt_len, bsz, embed_dim // num_heads)
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = self._attention_with_weights(
                q, k, v, attn_mask, dropout_p, is_causal, average_attn_weights, tgt_len, bsz, embed_dim
            )
            if not is_batched:
                out, weights = out.squeeze(1), weights.squeeze(0)
            return out, weights
        out = self._sdpa_attention(q, k, v, attn_mask, dropout_p, is_causal, tgt_len, bsz, embed_dim)
        if not is_batched:
            out = out.squeeze(1)
        return out, None

    def _check_embeddings(self, embed_dim: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The query's embedding dimension is this module's, and key and value agree (in shape
        with a packed in-projection; in sequence and batch dims otherwise)."""
        name = self.layer_name
        require_that(embed_dim == self.embed_dim, f"{name}: query.shape[-1]", embed_dim, f"{self.embed_dim}")
        if self._qkv_same_embed_dim:
            require_that(
                key.shape == value.shape, f"{name}: key.shape", tuple(key.shape), f"value's {tuple(value.shape)}"
            )
        else:
            require_that(
                key.shape[:2] == value.shape[:2],
                f"{name}: key.shape[:2]",
                tuple(key.shape[:2]),
                f"value's sequence and batch dims {tuple(value.shape[:2])}",
            )

    def _heads(self, q, k, v, attn_mask, key_padding_mask, tgt_len: int, bsz: int, head_dim: int):
        """``q, k, v`` as ``[batch * heads, sequence, head_dim]``, with ``bias_k``/``bias_v`` and
        ``add_zero_attn``'s zero row appended to the keys and values (the masks padded to match),
        and the key padding mask merged into ``attn_mask``. Returns ``(q, k, v, attn_mask)``."""
        num_heads = self.num_heads
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = (bsz * num_heads, 1, head_dim)
            k = torch.cat([k, torch.zeros(zeros, dtype=k.dtype, device=k.device)], dim=1)
            v = torch.cat([v, torch.zeros(zeros, dtype=v.dtype, device=v.device)], dim=1)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, num_heads, -1, -1)
                .reshape(bsz * num_heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        return q, k, v, attn_mask

    def _attention_with_weights(
        self, q, k, v, attn_mask, dropout_p: float, is_causal: bool, average_attn_weights: bool, tgt_len, bsz, embed_dim
    ):
        """Attention computed step by step (``need_weights``): the output after ``out_proj`` as
        ``[tgt, batch, E]`` and the weights as ``[batch, (heads,) tgt, src]``."""
        src_len = k.size(1)
        _, _, e = q.shape
        q_scaled = q * math.sqrt(1.0 / float(e))
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal is not implemented for need_weights=True without attn_mask")
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v)
        out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = self.out_proj(out)
        out = out.view(tgt_len, bsz, out.size(1))
        weights = weights.view(bsz, self.num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        return out, weights

    def _sdpa_attention(self, q, k, v, attn_mask, dropout_p: float, is_causal: bool, tgt_len, bsz, embed_dim):
        """Attention through ``F.scaled_dot_product_attention`` (no weights): the output after
        ``out_proj`` as ``[tgt, batch, E]``."""
        num_heads, src_len = self.num_heads, k.size(1)
        head_dim = q.size(-1)
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = self.out_proj(out)
        return out.view(tgt_len, bsz, out.size(1))


def _canonical_masks(query, key_padding_mask, attn_mask, need_weights: bool, is_causal: bool):
    """torch's canonical masks (a boolean one made an additive float one) and what stays of the
    ``is_causal`` hint: without a padding mask or weights SDPA takes the hint itself
    (``attn_mask`` dropped); with a padding mask the masks are merged and no longer causal.
    Returns ``(key_padding_mask, attn_mask, is_causal)``."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA takes the hint itself
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        if key_padding_mask is not None:
            is_causal = False  # merged with the padding mask, no longer causal
    return key_padding_mask, attn_mask, is_causal


def _checked_attn_mask(attn_mask, shape_2d: tuple, shape_3d: tuple):
    """``attn_mask`` (None, ``[tgt, src]`` or ``[batch * heads, tgt, src]``) checked against
    those shapes, a 2-D mask unsqueezed to 3-D (torch's messages)."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if attn_mask.shape != shape_2d:
            raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {shape_2d}.")
        return attn_mask.unsqueeze(0)
    if attn_mask.dim() == 3:
        if attn_mask.shape != shape_3d:
            raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {shape_3d}.")
        return attn_mask
    raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")


class Fp8TransformerEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` that always calls its modules (torch's training path), also
    in eval under ``no_grad``, where torch's would run ``torch._transformer_encoder_layer_fwd`` on
    the raw weights of its converted layers. Made in place by :meth:`convert`."""

    @classmethod
    def convert(cls, layer: nn.TransformerEncoderLayer) -> Fp8TransformerEncoderLayer:
        layer.__class__ = cls
        return layer

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """``nn.TransformerEncoderLayer.forward`` without its fast path."""
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask,
            mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask),
            other_name="src_mask",
            target_type=src.dtype,
        )
        src_mask = F._canonical_mask(
            mask=src_mask, mask_name="src_mask", other_type=None, other_name="", target_type=src.dtype,
            check_other=False,
        )  # fmt: skip
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x
