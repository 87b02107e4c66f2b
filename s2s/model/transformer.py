"""The encoder-decoder transformer (docs/model.md (1)-(21)).

    Enc: x -> H_enc (B, S, d_model)                      runs once per input
    Dec: (y_<t, H_enc) -> p_t = softmax(h_t W_U)        runs per output token

Three entry points, no hidden state:
    encode(src)                      -> h_enc, src_mask
    forward(src, tgt_in)             -> logits (B, T, V)    teacher forcing
    start_decoding(h_enc, src_mask)  -> DecoderCache        cross-attn K/V, once
    decode_step(y_prev, cache)       -> logits (B, V)       one step, cache grows
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.model.attention import causal_mask, padding_mask
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.layers import DecoderLayer, EncoderLayer, make_norm
from s2s.model.positions import LearnedPositions, RelativePositionBias, SinusoidalPositions
from s2s.params import parameter_budget  # noqa: F401 (its home is s2s.params; re-exported)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, src_vocab: int, tgt_vocab: int, pad_id: int = 0):
        super().__init__()
        if cfg.share_embeddings and src_vocab != tgt_vocab:
            raise ValueError("share_embeddings needs equal source and target vocabularies")
        self.cfg = cfg
        self.pad_id = pad_id
        d = cfg.d_model
        self.src_embed = nn.Embedding(src_vocab, d, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(
            tgt_vocab, d, padding_idx=pad_id)
        self.embed_scale = math.sqrt(d) if cfg.scale_embeddings else 1.0

        self.enc_positions: Optional[nn.Module] = None
        self.dec_positions: Optional[nn.Module] = None
        self.enc_rel_bias: Optional[RelativePositionBias] = None
        self.dec_rel_bias: Optional[RelativePositionBias] = None
        if cfg.positions == "sinusoidal":
            self.enc_positions = self.dec_positions = SinusoidalPositions(d)
        elif cfg.positions == "learned":
            self.enc_positions = LearnedPositions(cfg.max_positions, d, cfg.position_offset)
            self.dec_positions = LearnedPositions(cfg.max_positions, d, cfg.position_offset)
        elif cfg.positions == "t5_bias":
            self.enc_rel_bias = RelativePositionBias(cfg.heads, cfg.rel_buckets,
                                                     cfg.rel_max_distance, bidirectional=True)
            self.dec_rel_bias = RelativePositionBias(cfg.heads, cfg.rel_buckets,
                                                     cfg.rel_max_distance, bidirectional=False)
        else:
            raise ValueError(f"unknown positions {cfg.positions!r}")

        # BART: a norm on the embeddings (one per stack)
        self.enc_embed_norm = make_norm(cfg) if cfg.embed_norm else None
        self.dec_embed_norm = make_norm(cfg) if cfg.embed_norm else None
        pre_norm = cfg.norm == "pre"
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(cfg, coverage=cfg.coverage and i == cfg.dec_layers - 1)
            for i in range(cfg.dec_layers))
        # pointer-generator: p_gen = sigmoid(w_p . [h_t; ctx_t; x_t] + b_p)
        self.p_gen_proj = nn.Linear(3 * d, 1) if cfg.copy else None
        # pre-norm stacks end with a norm (their residual stream is never normalized otherwise)
        self.enc_final_norm = make_norm(cfg) if pre_norm else nn.Identity()
        self.dec_final_norm = make_norm(cfg) if pre_norm else nn.Identity()
        self.dropout = nn.Dropout(cfg.dropout)
        self.output_proj = None if cfg.tie_output else nn.Linear(d, tgt_vocab, bias=False)
        self.output_bias = nn.Parameter(torch.zeros(tgt_vocab)) if cfg.output_bias else None
        self.output_scale = d ** -0.5 if cfg.scale_output else 1.0
        self.reset_parameters()

    # ------------------------------------------------------------------ #
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2 and "embed" not in name and "positions" not in name and "rel_bias" not in name:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias") and p.dim() == 1:
                nn.init.zeros_(p)
        for emb in {id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values():
            nn.init.normal_(emb.weight, std=self.cfg.d_model ** -0.5)
            with torch.no_grad():
                emb.weight[self.pad_id].zero_()

    @property
    def device(self) -> torch.device:
        return self.src_embed.weight.device

    # ------------------------------------------------------------------ #
    def _embed(self, tokens: Tensor, table: nn.Embedding, positions: Optional[nn.Module],
               norm: Optional[nn.Module], start: int = 0) -> Tensor:
        """x = Dropout(Norm(E[tokens] * scale + P[start:start+L])), Norm only with model.embed_norm."""
        x = table(tokens) * self.embed_scale  # (B, L, d_model)
        if positions is not None:
            x = x + positions(tokens.size(1), start, device=tokens.device).to(x.dtype)
        if norm is not None:
            x = norm(x)
        return self.dropout(x)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, S) token ids -> (h_enc (B, S, d_model), src_mask (B, 1, 1, S))."""
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        mask = src_mask
        if self.enc_rel_bias is not None:
            S = src.size(1)
            mask = src_mask + self.enc_rel_bias(S, S, device=src.device)  # (B, heads, S, S)
        x = self._embed(src, self.src_embed, self.enc_positions, self.enc_embed_norm)
        for layer in self.encoder_layers:
            x = layer(x, mask)
        return self.enc_final_norm(x), src_mask

    def _self_mask(self, T_q: int, T_k: int, start: int, device) -> Optional[Tensor]:
        """Causal mask for queries start..start+T_q-1 over keys 0..T_k-1 (+ T5 bias)."""
        if T_q == 1 and start == T_k - 1:
            mask = None  # one new query sees every cached key: nothing to block
        else:
            mask = causal_mask(T_q, device, T_k, start)  # (T_q, T_k)
        if self.dec_rel_bias is not None:
            bias = self.dec_rel_bias(T_q, T_k, start, device=device)  # (1, heads, T_q, T_k)
            mask = bias if mask is None else bias + mask
        return mask

    def logits(self, h: Tensor) -> Tensor:
        """z_t = (s h_t) W_U + b_U, with W_U = E^T when tied, s = 1/sqrt(d) with
        model.scale_output (else 1), b_U with model.output_bias.   (B, T, d) -> (B, T, V)."""
        if self.output_scale != 1.0:
            h = h * self.output_scale
        z = h @ self.tgt_embed.weight.t() if self.output_proj is None else self.output_proj(h)
        return z if self.output_bias is None else z + self.output_bias

    def copy_log_probs(self, z: Tensor, h: Tensor, x_in: Tensor, a: Tensor, h_enc: Tensor,
                       src: Tensor) -> Tensor:
        """The pointer-generator's output distribution (docs/model.md (41)), as log-probabilities:

            P(w)  = p_gen P_vocab(w) + (1 - p_gen) sum_{j: x_j = w} a_tj
            p_gen = sigmoid(w_p . [h_t; ctx_t; x_t] + b_p),   ctx_t = sum_j a_tj H_enc_j

        z (B, T, V) logits, h (B, T, d) decoder states, x_in (B, T, d) decoder
        input embeddings, a (B, T, S) copy attention, h_enc (B, S, d), src (B, S)
        -> log P (B, T, V).  Computed in fp32 as log(p_gen P_vocab) (+) log((1 - p_gen) copy);
        P is normalized, so softmax and cross-entropy over it leave it unchanged.
        """
        a = a.float()
        ctx = a @ h_enc.float()  # (B, T, d)
        g = self.p_gen_proj(torch.cat([h, ctx.to(h.dtype), x_in], dim=-1)).float()  # (B, T, 1)
        log_gen = torch.log_softmax(z.float(), dim=-1) + F.logsigmoid(g)
        copy = torch.zeros_like(log_gen).scatter_add_(2, src[:, None, :].expand(-1, a.size(1), -1), a)
        seen = copy > 0  # log 0 = -inf without a NaN gradient
        log_copy = torch.where(seen, torch.log(torch.where(seen, copy, torch.ones_like(copy))),
                               float("-inf")) + F.logsigmoid(-g)
        return torch.logaddexp(log_gen, log_copy)

    @property
    def needs_attention(self) -> bool:
        """Copy and coverage use the last decoder layer's cross-attention."""
        return self.cfg.copy or self.cfg.coverage

    def _decoder_stack(self, x: Tensor, cross_kv: list, self_mask: Optional[Tensor], src_mask: Tensor,
                       caches: list, need_weights: bool, need_last: bool,
                       coverage: Optional[Tensor], group: int = 1) -> tuple[Tensor, list, Optional[Tensor]]:
        weights = []
        last = len(self.decoder_layers) - 1
        for i, (layer, (k, v), lc) in enumerate(zip(self.decoder_layers, cross_kv, caches)):
            x, A, cov = layer(x, k, v, self_mask, src_mask, cache=lc,
                              need_weights=need_weights or (need_last and i == last),
                              coverage=coverage if i == last else None, group=group)
            weights.append(A)
        return self.dec_final_norm(x), weights, cov

    def decode(self, tgt_in: Tensor, h_enc: Tensor, src_mask: Tensor, need_weights: bool = False,
               src: Optional[Tensor] = None, keep: Optional[Tensor] = None) -> tuple[Tensor, list]:
        """Teacher-forced decoder over the whole shifted target at once.

        tgt_in (B, T) -> scores (B, T, V) and, with ``need_weights``, the
        cross-attention weights of every layer [(B, heads, T, S)].  The scores
        are the logits z, or with ``model.copy`` the log-probabilities log P
        of the pointer-generator (which needs the source ids ``src``).  With
        ``keep`` (B, T) bool, only the scores (n, V) of the n kept positions (the
        real, non-pad targets): the output projection skips the padding.
        """
        B, T = tgt_in.shape
        self_mask = self._self_mask(T, T, 0, tgt_in.device)
        x_in = self._embed(tgt_in, self.tgt_embed, self.dec_positions, self.dec_embed_norm)
        cross_kv = [layer.cross_attn.project_kv(h_enc) for layer in self.decoder_layers]  # (B, heads, S, d_head)
        coverage = h_enc.new_zeros(B, h_enc.size(1), dtype=torch.float32) if self.cfg.coverage else None
        h, weights, _ = self._decoder_stack(x_in, cross_kv, self_mask, src_mask, [None] * len(cross_kv),
                                            need_weights, self.needs_attention, coverage)
        if keep is not None and not self.cfg.copy:
            return self.logits(h[keep]), weights  # (n, V)
        scores = self._scores(h, x_in, weights[-1], h_enc, src)
        return (scores if keep is None else scores[keep]), weights

    def _scores(self, h: Tensor, x_in: Tensor, A_last: Optional[Tensor], h_enc: Tensor,
                src: Optional[Tensor]) -> Tensor:
        z = self.logits(h)
        if not self.cfg.copy:
            return z
        if src is None:
            raise ValueError("model.copy: the decoder needs the source ids")
        return self.copy_log_probs(z, h, x_in, A_last.mean(1), h_enc, src)

    def forward(self, src: Tensor, tgt_in: Tensor, return_attention: bool = False,
                keep: Optional[Tensor] = None):
        """Teacher forcing: scores (B, T, V) of P(y_t | y_<t, x) for every t at once
        (logits, or log P with copy); with ``keep`` (B, T) bool only those positions' (n, V).
        With ``return_attention`` also the last decoder layer's cross-attention averaged
        over heads, a (B, T, S), for the coverage loss."""
        h_enc, src_mask = self.encode(src)
        if not return_attention:
            return self.decode(tgt_in, h_enc, src_mask, src=src, keep=keep)[0]
        scores, weights = self.decode(tgt_in, h_enc, src_mask, need_weights=not self.needs_attention,
                                      src=src, keep=keep)
        return scores, weights[-1].mean(1)

    # ------------------------------------------------------------------ #
    def start_decoding(self, h_enc: Tensor, src_mask: Tensor, src: Optional[Tensor] = None) -> DecoderCache:
        """Cross-attention K/V of every layer, computed once from H_enc (and, for copy
        and coverage, the source ids, H_enc and the coverage c^0 = 0)."""
        layers = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(h_enc)  # (B, heads, S, d_head)
            layers.append(LayerCache(cross_k=k, cross_v=v))
        cache = DecoderCache(layers=layers, src_mask=src_mask)
        if self.cfg.copy:
            cache.src, cache.h_enc = src, h_enc
        if self.cfg.coverage:
            cache.coverage = h_enc.new_zeros(h_enc.shape[:2], dtype=torch.float32)
        return cache

    def decode_step(self, y_prev: Tensor, cache: DecoderCache, need_weights: bool = False,
                    need_last: bool = False) -> tuple[Tensor, list]:
        """One incremental step.

        y_prev (B, 1): the token at position t = cache.step (bos at t = 0).
        Returns the scores (B, V) for position t+1 (logits, or log P with copy)
        and, with ``need_weights``, the cross-attention weights of every layer
        [(B, heads, 1, S)] (with ``need_last``, the last layer's only).  The cache's self-attention K/V grow by one
        position; the cross K/V are reused; the coverage adds this step's attention.
        """
        t = cache.step
        self_mask = self._self_mask(1, t + 1, t, y_prev.device)
        x_in = self._embed(y_prev, self.tgt_embed, self.dec_positions, self.dec_embed_norm, start=t)  # (B, 1, d_model)
        cross_kv = [(lc.cross_k, lc.cross_v) for lc in cache.layers]
        h, weights, cache.coverage = self._decoder_stack(x_in, cross_kv, self_mask, cache.src_mask,
                                                         cache.layers, need_weights,
                                                         need_last or self.needs_attention,
                                                         cache.coverage, cache.group)
        cache.step += 1
        return self._scores(h, x_in, weights[-1], cache.h_enc, cache.src)[:, -1], weights


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied/shared matrix counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
