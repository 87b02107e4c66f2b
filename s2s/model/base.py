"""What both architectures share: the token embedding in, the output head out,
and the initialisation (docs/model.md (14), (19), (21)).

    x_t = Dropout(Norm(E[y_t] s_E + P_t))     s_E = sqrt(d_model) with model.scale_embeddings, else 1;
                                              Norm only with model.embed_norm
    z_t = (s_U h_t) W_U + b_U                 W_U = E^T with model.tie_output, else its own (d_model, V);
                                              s_U = 1 / sqrt(d_model) with model.scale_output, else 1;
                                              b_U with model.output_bias
    z'_t = (s_U h_t) W_U[:, ids] + b_U[ids]   a vocabulary subset (a shortlist): z'_t = z_t[ids]

The parameters keep the names they have always had (``tgt_embed``,
``output_proj``, ``output_bias``) on the model itself, so model directories,
the Hugging Face and CTranslate2 converters read the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.loss import OutputNLL, fuses_output_nll, label_smoothed_nll
from s2s.model import gemm
from s2s.model.dropout import Dropout


@dataclass
class VocabSubset:
    """The rows of the output head for a subset of the target vocabulary (a shortlist)."""

    ids: Tensor  # (V',) full-vocabulary ids, ascending
    W: Tensor  # (V', d_model): W_U[:, ids]^T
    b: Optional[Tensor]  # (V',): b_U[ids], or None without model.output_bias
    int8: Optional[nn.Module] = None  # W and b as an Int8Linear, when the model decodes in int8
    packed: Optional[Tensor] = None  # W packed for oneDNN, when the model decodes in bf16 (s2s.model.gemm)


class ModelBase(nn.Module):
    """The shared ends of :class:`Seq2SeqTransformer` and :class:`DecoderOnlyLM`.

    A subclass builds its embedding tables first (``tgt_embed`` is the output's
    E), then its stacks, then calls :meth:`build_embedding_and_output` last, so that the
    parameters are created (and drawn from the RNG) in one fixed order.
    """

    cfg: ModelConfig
    pad_id: int
    tgt_embed: nn.Embedding
    # decoding: a beam search's self-attention K/V slots kept in this dtype where it is not the
    # model's (s2s.model.cache; bf16 on a CPU with native bf16, s2s.precision.beam_slot_dtype)
    beam_slot_dtype: Optional[torch.dtype] = None
    # decoding: a greedy search's attention K/V kept in this dtype where it is not the model's
    # (DecoderCache.narrow_kv; bf16 on a CPU with native bf16, s2s.precision.greedy_kv_dtype)
    greedy_kv_dtype: Optional[torch.dtype] = None

    def build_embedding_and_output(self, cfg: ModelConfig, vocab: int) -> None:
        """s_E and the embedding dropout, W_U (None when tied to E), b_U and s_U of the formulas above."""
        d = cfg.d_model
        self.embed_scale = math.sqrt(d) if cfg.scale_embeddings else 1.0
        self.dropout = Dropout(cfg.dropout)
        self.output_proj = None if cfg.tie_output else nn.Linear(d, vocab, bias=False)
        self.output_bias = nn.Parameter(torch.zeros(vocab)) if cfg.output_bias else None
        self.output_scale = d ** -0.5 if cfg.scale_output else 1.0
        self.gemm = "torch"  # or, training: openblas (s2s.model.gemm.use_openblas), rows (use_row_blocks);
        # decoding in bf16: packed for oneDNN, or native, for s2s's kernel (use_packed_bf16)
        self.output_int8: Optional[nn.Module] = None  # W_U in int8 too, decoding (s2s.model.int8)
        self.output_packed: Optional[Tensor] = None  # the tied W_U packed (gemm.pack_bf16), decoding in bf16

    def embed(self, tokens: Tensor, table: nn.Embedding, P: Optional[Tensor],
              norm: Optional[nn.Module]) -> Tensor:
        """x = Dropout(Norm(E[tokens] s_E + P)): tokens (B, L), P broadcast to (B, L, d_model)
        or None (relative positions) -> x (B, L, d_model)."""
        x = table(tokens) * self.embed_scale  # (B, L, d_model)
        if P is not None:
            x = x + P.to(x.dtype)
        if norm is not None:
            x = norm(x)
        return self.dropout(x) if self.training else x

    def logits(self, h: Tensor, subset: Optional[VocabSubset] = None) -> Tensor:
        """z_t = (s_U h_t) W_U + b_U, W_U = E^T when tied.   (..., d_model) -> (..., V);
        with a ``subset``, z'_t = (s_U h_t) W_U[:, ids] + b_U[ids]:  (..., d_model) -> (..., V')."""
        if self.output_scale != 1.0:
            h = h * self.output_scale
        if subset is not None:
            if subset.int8 is not None:
                return subset.int8(h)  # (..., V'), b included
            z = gemm.packed_linear(h, subset.W, subset.packed)  # (..., V')
            return z if subset.b is None else z + subset.b
        if self.output_int8 is not None:  # --quantize int8 (its own choice of int8 or fp32 per call)
            z = self.output_int8(h)
        elif self.output_proj is not None:
            z = self.output_proj(h)
        elif self.gemm == "openblas":  # training through OpenBLAS (s2s.model.gemm)
            z = gemm.linear(h, self.tgt_embed.weight)
        elif self.gemm == "rows":  # bf16 training on the CPU: rows in blocks (s2s.model.gemm)
            z = gemm.row_block_linear(h, self.tgt_embed.weight)
        elif self.gemm in ("packed", "native"):  # bf16 decoding on the CPU: W_U packed once (s2s.model.gemm)
            z = gemm.packed_linear(h, self.tgt_embed.weight, self.output_packed)
        else:
            z = h @ self.tgt_embed.weight.t()
        return z if self.output_bias is None else z + self.output_bias

    def head_nll(self, h: Tensor, target: Tensor, epsilon: float, pad_id: int) -> Tensor:
        """label_smoothed_nll(logits(h), target): h (n, d_model) -> the fp32 sum.  Where the head is
        x W_U + b_U in bf16 on the CPU and autograd records it (a bf16 training step), in one pass
        that never holds the (n, V) scores (s2s.loss.OutputNLL); elsewhere through :meth:`logits`."""
        W = self.tgt_embed.weight if self.output_proj is None else self.output_proj.weight
        plain = self.output_int8 is None and self.gemm in ("torch", "rows")
        if not (plain and fuses_output_nll(h, W)):
            return label_smoothed_nll(self.logits(h), target, epsilon, pad_id)
        if self.output_scale != 1.0:
            h = h * self.output_scale
        return OutputNLL.apply(h, W, self.output_bias, target, epsilon, pad_id)  # fuses_output_nll checked above

    def vocab_subset(self, ids: Tensor) -> VocabSubset:
        """The output head's rows for target ids ``ids`` (V',), gathered once per batch;
        under --quantize int8 also quantized once per batch (an int8 copy of V' rows), and
        for bf16 decoding on the CPU packed once per batch (s2s.model.gemm.use_packed_bf16)."""
        if self.output_proj is None:
            W = self.tgt_embed.weight
        else:
            W = self.output_proj.weight  # fp32 (an int8-quantized projection keeps it)
        b = None if self.output_bias is None else self.output_bias.index_select(0, ids)
        subset = VocabSubset(ids=ids, W=W.index_select(0, ids), b=b)
        if self.output_int8 is not None:
            from s2s.model.int8 import Int8Linear  # torch's quantized operators, only when asked

            subset.int8 = Int8Linear(subset.W, b)
        elif self.gemm in ("packed", "native"):
            subset.packed = gemm.pack_bf16(subset.W, native=self.gemm == "native")
        return subset

    def embedding_tables(self) -> Iterable[nn.Embedding]:
        """The tables :meth:`reset_parameters` draws from N(0, 1/d_model), each once."""
        return [self.tgt_embed]

    def reset_parameters(self) -> None:
        """Matrices ~ Xavier-uniform, biases = 0, embedding tables ~ N(0, 1/d_model) with
        the pad row 0; position tables and relative biases are not matrices of the stacks
        (they keep their own initialisation unless listed in :meth:`embedding_tables`)."""
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name and "positions" not in name and "rel_bias" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias") and p.dim() == 1:
                nn.init.zeros_(p)
        for table in self.embedding_tables():
            nn.init.normal_(table.weight, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            for table in {id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values():
                table.weight[self.pad_id].zero_()

    def step_layers(self) -> nn.ModuleList:
        """The blocks a decoding step runs (a subclass's decoder stack)."""
        raise NotImplementedError

    def lay_out_for_steps(self) -> None:
        """Store each matrix W (out, in) of :meth:`step_layers` column-major (W^T contiguous).

        The values are unchanged; x W^T then runs as a plain row-major GEMM, which
        MKL does up to 2.5x faster than the transposed-operand one at the few rows
        of a decoding step (1.0-2.5x at 8-17 rows on a Skylake core; 0.83-1.15x at
        hundreds of rows, so the encoder keeps its layout).
        For a model loaded to translate only: a model in training keeps its layout,
        which its optimizer state and data-parallel buckets are built on.
        """
        with torch.no_grad():
            for module in self.step_layers().modules():
                if isinstance(module, nn.Linear):
                    module.weight.data = module.weight.data.t().contiguous().t()

    @property
    def device(self) -> torch.device:
        return self.tgt_embed.weight.device

    @property
    def needs_attention(self) -> bool:
        """Copy and coverage read the last decoder layer's cross-attention."""
        return self.cfg.copy or self.cfg.coverage
