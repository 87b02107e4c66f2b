"""The decoder step of an encoder-decoder as one TorchScript program.

A step of the reference model (3 decoder layers, d_model 256) calls about 190 torch
operators from Python, through the modules, the attention helpers and the cache; at the
few rows of greedy search's last steps, calling them costs more than their arithmetic.
CTranslate2, a C++ engine, does not pay that.  Here the same operators, in the same order
on the same tensors, run inside TorchScript's interpreter, from one call per step:

    Python path:   decode_step -> layers -> attention, FFN, products  (~190 calls from Python)
    scripted:      decode_step -> StepScript(y, the caches' buffers)  (1 call; the rest in C++)

The interpreter runs without its optimizing passes (``torch.jit.optimized_execution(False)``):
no fusion and no specialization by shape, so a new batch shape compiles nothing and every
value is the Python step's, bit for bit (tests/test_step_script.py).  Scripting takes
tens of milliseconds, once per process.

What stays in Python, once per step: the cache's bookkeeping (growing the buffers
(:meth:`LayerCache.reserve`), the beams' ancestry mask, ``select``) and the output
projection z = logits(h) (with a shortlist's rows of W_U).  What is not scripted (the Python
step runs, :func:`unsupported`): a model in training or under autograd, a step that returns
attention weights (alignments, the coverage penalty), copy and coverage models, T5's
relative positions, RMSNorm, gated FFNs, devices other than the CPU, Python 3.14 and a torch without
TorchScript (``torch.jit.script`` is deprecated in favour of ``torch.compile``, whose
compile per batch shape took a minute a shape on these models: README, ``--compile``).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from s2s.model import gemm
from s2s.model.attention import beams_as_queries, inference_attention, queries_as_beams, slot_attention
from s2s.model.cache import DecoderCache
from s2s.model.int8 import Int8Linear
from s2s.model.layers import FeedForward

log = logging.getLogger("s2s")

NEVER = 1 << 62  # a threshold (x.numel()) no product reaches


def no_scalars() -> List[Optional[Union[int, float, complex]]]:
    """The empty ``scalars`` of oneDNN's linear with a post-op, typed as its schema wants
    (Scalar?[]: a literal [] would be a list of tensors to TorchScript)."""
    scalars: List[Optional[Union[int, float, complex]]] = []
    return scalars


class ScriptedNorm(nn.Module):
    """LayerNorm(x) = (x - mean) / sqrt(var + eps) * g + b, as nn.LayerNorm.forward computes it
    (its parameters, shared)."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.shape: List[int] = list(norm.normalized_shape)
        self.weight, self.bias, self.eps = norm.weight, norm.bias, float(norm.eps)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def activation(h: Tensor, name: str) -> Tensor:
    """act(h) for a key of s2s.model.layers.ACTIVATIONS, in place where FeedForward's decoding
    writes it in place (ReLU, SiLU)."""
    if name == "relu":
        return torch.relu_(h)
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    return F.silu(h, inplace=True)


class ScriptedProduct(nn.Module):
    """y = x W^T + b as the model's layer computes it: nn.Linear's F.linear; an Int8Linear's
    int8 copy from its rows threshold on (oneDNN's copy for a wide W from its own); a
    PackedLinear's packed bf16 W for bf16 inputs (gemm.packed_linear).  For an FFN's W_1,
    :meth:`activated` gives act(x W^T + b) as FeedForward.forward does."""

    def __init__(self, linear: nn.Linear, act: Optional[str] = None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.int8: Optional[torch.ScriptObject] = None
        self.int8_numel, self.onednn_numel = NEVER, NEVER
        self.onednn: Optional[torch.ScriptObject] = None
        self.packed: Optional[Tensor] = None
        if isinstance(linear, Int8Linear):
            self.int8, self.int8_numel = linear.packed, linear.int8_numel
            if linear.onednn_numel is not None:  # packed now: a script cannot pack on first use
                if linear.packed_onednn is None:
                    linear.packed_onednn = linear.pack("onednn")
                self.onednn, self.onednn_numel = linear.packed_onednn, linear.onednn_numel
        elif isinstance(linear, gemm.PackedLinear):
            self.packed = linear.packed
        # W_1's activation (FeedForward.post_op: every activation has one) and its oneDNN post-op
        self.act, self.fused = act or "", act is not None
        self.post_op, self.post_algorithm = gemm.POST_OPS[act] if act is not None else ("none", "")

    def forward(self, x: Tensor) -> Tensor:
        # (each ``is not None`` test alone in its if: TorchScript drops the branch of an attribute
        # that is None, so a product without an int8 or packed copy compiles without its calls)
        int8 = self.int8
        if int8 is not None:
            if x.numel() >= self.int8_numel:  # Int8Linear.forward
                return self.int8_product(x, int8, False)
        packed = self.packed
        if packed is not None:
            if x.dtype == packed.dtype:
                return self.packed_product(x, packed, "none", "")
        return F.linear(x, self.weight, self.bias)

    def packed_product(self, x: Tensor, packed: Tensor, post_op: str, algorithm: str) -> Tensor:
        """gemm.packed_linear: post_op(x W^T + b) through W packed for s2s's AMX kernel (3
        dimensions, gemm.pack_bf16 with native) or for oneDNN."""
        if packed.dim() == 3:
            return torch.ops.s2s.bf16_linear(x, self.weight, packed, self.bias, post_op, algorithm)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, post_op, no_scalars(), algorithm)

    def int8_product(self, x: Tensor, int8: torch.classes.quantized.LinearPackedParamsBase, relu: bool) -> Tensor:
        """Int8Linear.int8: x W^T + b (max(0, .) with ``relu``) through oneDNN's copy from its
        rows on, else through ``int8`` (fbgemm's)."""
        onednn = self.onednn
        if onednn is not None:
            if x.numel() >= self.onednn_numel:
                int8 = onednn
        if relu:
            return torch.ops.quantized.linear_relu_dynamic(x, int8, True)
        return torch.ops.quantized.linear_dynamic(x, int8, True)

    def activated(self, x: Tensor) -> Tensor:
        """act(x W^T + b), as FeedForward.forward computes it without autograd: ReLU inside the
        int8 product, a post-op inside the packed one, else after the product."""
        if self.fused:
            int8 = self.int8
            if int8 is not None:
                if self.act == "relu" and x.numel() >= self.int8_numel:
                    return self.int8_product(x, int8, True)
            packed = self.packed
            if packed is not None:
                if x.dtype == packed.dtype:
                    return self.packed_product(x, packed, self.post_op, self.post_algorithm)
        return activation(self.forward(x), self.act)


class ScriptedLayer(nn.Module):
    """DecoderLayer.forward for one position: x (B, 1, d_model) at position t, this position's
    self-attention K/V written into the layer cache's buffers (LayerCache.append's layout)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        sa, ca, ffn = layer.self_attn, layer.cross_attn, layer.ffn
        self.pre_norm = bool(layer.pre_norm)
        self.heads, self.d_head = sa.heads, sa.d_head
        self.self_scale, self.cross_scale = bool(sa.scale), bool(ca.scale)
        self.self_native, self.cross_native = bool(sa.native), bool(ca.native)  # s2s.model.native
        self.norm1, self.norm2, self.norm3 = (ScriptedNorm(layer.norm1), ScriptedNorm(layer.norm2),
                                              ScriptedNorm(layer.norm3))
        self.qkv_proj, self.self_out_proj = ScriptedProduct(sa.qkv_proj), ScriptedProduct(sa.out_proj)
        self.cross_q_proj, self.cross_out_proj = ScriptedProduct(ca.q_proj), ScriptedProduct(ca.out_proj)
        self.w_1, self.w_2 = ScriptedProduct(ffn.w_1, ffn.post_op), ScriptedProduct(ffn.w_2)

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, 1, heads d_head) -> (B, heads, 1, d_head): one view (MultiHeadAttention.split_heads's
        values; with one position its transpose moves nothing)."""
        return x.view(x.size(0), self.heads, 1, self.d_head)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, heads, 1, d_head) -> (B, 1, heads d_head), as MultiHeadAttention.merge_heads."""
        return x.reshape(x.size(0), 1, self.heads * self.d_head)

    def self_attn(self, x: Tensor, mask: Optional[Tensor], k_buf: Tensor, v_buf: Tensor, t: int, slots: int,
                  whole: bool, columns: Optional[Tensor] = None) -> Tensor:
        """SelfAttn(x) = MHA(x, [y_<t; x]) over the cache's keys and values, this position's
        appended at column t (with K = ``slots`` beam slots, columns t K .. t K + K - 1 of
        each sentence's buffer, a sentence's beams its K queries)."""
        B = x.size(0)
        q, k, v = self.qkv_proj(x).view(B, 3, self.heads, 1, self.d_head).unbind(1)  # 3 x (B, heads, 1, d_head)
        if slots > 1:
            k, v = beams_as_queries(k, slots), beams_as_queries(v, slots)  # (B / K, heads, K, d_head)
        n = k.size(0)
        c = t * slots  # the columns in use
        k_buf = k_buf.narrow(0, 0, n)  # (n, heads, capacity, d_head)
        v_buf = v_buf.narrow(0, 0, n)
        k_buf.narrow(2, c, slots).copy_(k)
        v_buf.narrow(2, c, slots).copy_(v)
        if columns is not None:  # each beam reads its ancestors' slots alone, through the kernel
            return self.self_out_proj(self.merge_heads(slot_attention(q, k_buf, v_buf, columns, self.self_scale)))
        if whole:  # slots read whole: every column, those past t K masked
            keys, values = k_buf, v_buf
        else:
            keys, values = k_buf.narrow(2, 0, c + slots), v_buf.narrow(2, 0, c + slots)  # (n, heads, (t+1) K, d_head)
        if slots > 1:
            out = queries_as_beams(inference_attention(beams_as_queries(q, slots), keys, values, mask,
                                                       self.self_scale, native=self.self_native), slots)
        else:
            out = inference_attention(q, keys, values, mask, self.self_scale,
                                      native=self.self_native)  # (B, heads, 1, d_head)
        return self.self_out_proj(self.merge_heads(out))

    def cross_attn(self, x: Tensor, src_mask: Tensor, cross_k: Tensor, cross_v: Tensor, group: int) -> Tensor:
        """CrossAttn(x, H_enc) = MHA(x W_Q, the cached H_enc W_K, H_enc W_V), G = ``group`` rows
        (a sentence's beams) sharing their sentence's K/V."""
        q = self.split_heads(self.cross_q_proj(x))  # (B, heads, 1, d_head)
        if group > 1:
            out = queries_as_beams(inference_attention(beams_as_queries(q, group), cross_k, cross_v,
                                                       src_mask[::group], self.cross_scale, native=self.cross_native),
                                   group)
        else:
            out = inference_attention(q, cross_k, cross_v, src_mask, self.cross_scale,
                                      native=self.cross_native)  # (B, heads, 1, d_head)
        return self.cross_out_proj(self.merge_heads(out))

    def ffn(self, x: Tensor) -> Tensor:
        """FFN(x) = W_2 act(W_1 x + b_1) + b_2."""
        return self.w_2(self.w_1.activated(x))

    def forward(self, x: Tensor, self_mask: Optional[Tensor], src_mask: Tensor, k_buf: Tensor, v_buf: Tensor,
                t: int, slots: int, whole: bool, group: int, cross_k: Tensor, cross_v: Tensor,
                self_columns: Optional[Tensor]) -> Tensor:
        if self.pre_norm:
            # 1. causal self-attention, 2. cross-attention, 3. feed-forward: x + Sublayer(Norm(x))
            x = x + self.self_attn(self.norm1(x), self_mask, k_buf, v_buf, t, slots, whole, self_columns)
            x = x + self.cross_attn(self.norm2(x), src_mask, cross_k, cross_v, group)
            return x + self.ffn(self.norm3(x))
        # post-norm: Norm(x + Sublayer(x))
        x = self.norm1(x + self.self_attn(x, self_mask, k_buf, v_buf, t, slots, whole, self_columns))
        x = self.norm2(x + self.cross_attn(x, src_mask, cross_k, cross_v, group))
        return self.norm3(x + self.ffn(x))


class StepScript(nn.Module):
    """The decoder's step without the output projection: y_prev (B, 1) at position t -> h (B, 1,
    d_model), the final states that Seq2SeqTransformer.logits takes (see the module doc)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.table, self.embed_scale = model.tgt_embed.weight, float(model.embed_scale)
        embed_norm, final = model.dec_embed_norm, model.dec_final_norm
        self.embed_norm: Optional[ScriptedNorm] = None if embed_norm is None else ScriptedNorm(embed_norm)
        self.final_norm: Optional[ScriptedNorm] = None if isinstance(final, nn.Identity) else ScriptedNorm(final)
        self.layers = nn.ModuleList([ScriptedLayer(layer) for layer in model.decoder_layers])

    def forward(self, y_prev: Tensor, P: Optional[Tensor], self_mask: Optional[Tensor], src_mask: Tensor,
                k_bufs: List[Tensor], v_bufs: List[Tensor], cross_k: List[Tensor], cross_v: List[Tensor],
                t: int, slots: int, whole: bool, group: int, self_columns: Optional[Tensor] = None) -> Tensor:
        x = F.embedding(y_prev, self.table) * self.embed_scale  # (B, 1, d_model): E[y] s_E (ModelBase.embed)
        if P is not None:
            x = x + P.to(x.dtype)
        embed_norm = self.embed_norm
        if embed_norm is not None:
            x = embed_norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, self_mask, src_mask, k_bufs[i], v_bufs[i], t, slots, whole, group, cross_k[i], cross_v[i],
                      self_columns)
        final = self.final_norm
        if final is not None:
            x = final(x)
        return x


def unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model``'s decoder step cannot be scripted, or None (see the module doc)."""
    cfg = model.cfg
    if sys.version_info >= (3, 14):
        return "Python 3.14, which TorchScript does not support"
    if cfg.arch != "encoder_decoder":
        return f"model.arch {cfg.arch}"
    if model.device.type != "cpu":
        return f"device {model.device.type}"
    if cfg.copy or cfg.coverage:
        return "copy or coverage"
    if model.dec_rel_bias is not None:
        return "relative positions"
    norms = [model.dec_embed_norm, model.dec_final_norm]
    for layer in model.decoder_layers:
        norms += [layer.norm1, layer.norm2, layer.norm3]
        ffn = layer.ffn
        if not isinstance(ffn, FeedForward) or ffn.w_13 is not None or ffn.w_3 is not None:
            return "a gated FFN"
        if ffn.post_op is None:  # (every activation of model.activation has a name in gemm.POST_OPS)
            return "an activation of its own"
        linears = [layer.self_attn.qkv_proj, layer.self_attn.out_proj, layer.cross_attn.q_proj,
                   layer.cross_attn.out_proj, ffn.w_1, ffn.w_2]
        if any(type(m) not in (nn.Linear, Int8Linear, gemm.PackedLinear) for m in linears):
            return "a linear layer of another kind"
    if any(n is not None and type(n) not in (nn.LayerNorm, nn.Identity) for n in norms):
        return "RMSNorm"
    return None


def script_step(model: nn.Module) -> Optional[torch.jit.ScriptModule]:
    """``model``'s decoder step scripted (:class:`StepScript`), or None where it cannot be
    (:func:`unsupported`, or TorchScript fails: logged at debug level).  Build it after the
    model's arithmetic is set (bf16, int8): it holds the matrices the layers hold then."""
    why = unsupported(model)
    if why is None:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():  # torch 2.13 flags TorchScript as deprecated
                warnings.simplefilter("ignore")
                script = torch.jit.script(StepScript(model))
        except Exception as e:  # noqa: BLE001 - no TorchScript, or a torch it cannot script
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            log.debug("decoder step scripted in %.3f s", time.perf_counter() - start)
            return script
    log.debug("decoder step not scripted (%s): steps run in Python", why)
    return None


def run_step_script(script: torch.jit.ScriptModule, y_prev: Tensor, P: Optional[Tensor],
                    self_mask: Optional[Tensor], cache: DecoderCache, self_columns: Optional[Tensor] = None) -> Tensor:
    """One step through ``script`` over ``cache`` (a DecoderCache, its buffers reserved for this
    position): h (B, 1, d_model).  The interpreter runs without its optimizing passes."""
    layers = cache.layers
    first = layers[0]
    with torch.jit.optimized_execution(False):
        return script(y_prev, P, self_mask, cache.src_mask, [lc.k_buf for lc in layers], [lc.v_buf for lc in layers],
                      [lc.cross_k for lc in layers], [lc.cross_v for lc in layers], first.length, first.slots,
                      first.whole, cache.group, self_columns)
