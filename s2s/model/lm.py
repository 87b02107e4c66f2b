"""One decoder stack over [x; y]: the prefix-LM and the decoder-only architectures
(docs/model.md (8)).

    prefix_lm:     M_ij = 0 if j <= n (bidirectional over the prefix x, n = |x|)
                          0 if n < j <= i (causal over the suffix y)
                          -inf otherwise
    decoder_only:  M_ij = 0 if j <= i, else -inf (causal everywhere)

The stack has enc_layers + dec_layers blocks of self-attention and FFN (so the
three architectures of one config have about the same size; no cross-attention).
The loss is taken over the suffix only, as for the encoder-decoder, and the
entry points are the encoder-decoder's, so training, search and scoring run
unchanged:

    encode(src)                        -> EncoderState: the prefix's K/V in every layer (one pass)
    start_decoding(enc)                -> DecoderCache holding them
    decode_step(y_prev, cache)         -> logits (B, V); the cache grows by one position
    forward(src, tgt_in)               -> logits (B, T, V), teacher forcing over [x; y]

A padded prefix leaves pads between x and y; they are masked as keys, and
positions count real tokens only (y_t sits at position n_b + t in row b), so
a sentence's output never depends on what it is batched with.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.model.attention import NEG_INF, padding_mask
from s2s.model.base import ModelBase
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.interface import EncoderState
from s2s.model.layers import EncoderLayer, make_norm
from s2s.model.positions import sinusoidal_table


def prefix_lm_mask(n: int, L: int, device=None) -> Tensor:
    """M^prefix (L, L) for a prefix of n positions (docs/model.md (8)): 0 where j < n or j <= i (0-based)."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    return torch.zeros(L, L, device=device).masked_fill((j > i) & (j >= n), NEG_INF)


def lm_mask(arch: str, n: int, L: int, device=None) -> Tensor:
    """The self-attention mask of ``arch`` over [x; y] with |x| = n (padding aside)."""
    return prefix_lm_mask(n if arch == "prefix_lm" else 0, L, device)


class DecoderOnlyLM(ModelBase):
    def __init__(self, cfg: ModelConfig, vocab: int, pad_id: int = 0):
        super().__init__()
        self.cfg = cfg
        self.pad_id = pad_id
        d = cfg.d_model
        self.tgt_embed = nn.Embedding(vocab, d, padding_idx=pad_id)
        self.src_embed = self.tgt_embed  # one vocabulary, one table for x and y
        self.positions = (nn.Embedding(cfg.max_positions + cfg.position_offset, d)
                          if cfg.positions == "learned" else None)
        self.embed_norm = make_norm(cfg) if cfg.embed_norm else None
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers + cfg.dec_layers))
        self.final_norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()
        self.build_embedding_and_output(cfg, vocab)
        self.reset_parameters()

    def step_layers(self) -> nn.ModuleList:
        return self.layers

    def embedding_tables(self) -> list[nn.Embedding]:
        return [self.tgt_embed] + ([self.positions] if self.positions is not None else [])

    # ------------------------------------------------------------------ #
    def _embed(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """x = Dropout(Norm(E[tokens] s_E + P[pos])) (see ModelBase.embed); pos (B, L) position ids."""
        if self.positions is None:
            P = sinusoidal_table(pos.reshape(-1), self.cfg.d_model).view(*pos.shape, -1)  # (B, L, d_model)
        else:
            if int(pos.max()) >= self.cfg.max_positions:
                raise ValueError(f"position {int(pos.max())} exceeds model.max_positions={self.cfg.max_positions}")
            P = self.positions(pos + self.cfg.position_offset)  # (B, L, d_model)
        return self.embed(tokens, self.tgt_embed, P, self.embed_norm)

    def _stack(self, x: Tensor, mask: Tensor, caches: Optional[list[LayerCache]] = None) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, caches[i] if caches is not None else None)
        return self.final_norm(x)

    def forward(self, src: Tensor, tgt_in: Tensor, return_attention: bool = False,
                keep: Optional[Tensor] = None, head: bool = True) -> Tensor:
        """Teacher forcing over [x; y_in]: logits (B, T, V) of the suffix positions
        (with ``keep`` (B, T) bool, only those positions': (n, V); with ``head`` False
        their last states h (n, d_model) instead, for :meth:`head_nll`)."""
        if return_attention:
            raise ValueError(f"model.arch: {self.cfg.arch} has no cross-attention")
        B, S = src.shape
        T = tgt_in.size(1)
        src_len = (src != self.pad_id).sum(1)  # (B,)
        pos = torch.cat([torch.arange(S, device=src.device).expand(B, S),
                         src_len[:, None] + torch.arange(T, device=src.device)], dim=1)  # (B, S+T)
        keys = torch.cat([padding_mask(src, self.pad_id), src.new_zeros(B, 1, 1, T, dtype=torch.float)], -1)
        mask = lm_mask(self.cfg.arch, S, S + T, src.device) + keys  # (B, 1, S+T, S+T)
        h = self._stack(self._embed(torch.cat([src, tgt_in], 1), pos), mask)[:, S:]
        if not head:
            if keep is None:
                raise ValueError("forward: head=False takes the kept positions")
            return h[keep]  # (n, d_model)
        return self.logits(h if keep is None else h[keep])

    # ------------------------------------------------------------------ #
    def encode(self, src: Tensor) -> EncoderState:
        """Run the prefix once: every layer's cache then holds its K/V, which decoding reuses."""
        B, S = src.shape
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        pos = torch.arange(S, device=src.device).expand(B, S)
        caches = [LayerCache(cross_k=None, cross_v=None) for _ in self.layers]
        self._stack(self._embed(src, pos), lm_mask(self.cfg.arch, S, S, src.device) + src_mask, caches)
        return EncoderState(src=src, src_mask=src_mask, prefix=caches)

    def start_decoding(self, enc: EncoderState) -> DecoderCache:
        """The prefix's caches, its padding mask and real lengths (where y's positions start)."""
        src_len = (enc.src_mask[:, 0, 0, :] == 0).sum(1)  # (B,)
        return DecoderCache(layers=enc.prefix, src_mask=enc.src_mask, src_len=src_len)

    def decode_step(self, y_prev: Tensor, cache: DecoderCache, need_weights: bool = False,
                    need_last: bool = False) -> tuple[Tensor, list]:
        """y_prev (B, 1) at suffix position t = cache.step -> logits (B, V) for t + 1."""
        if need_weights:
            raise ValueError(f"model.arch: {self.cfg.arch} has no cross-attention to return")
        t = cache.step
        B = y_prev.size(0)
        pos = (cache.src_len + t)[:, None]  # (B, 1)
        keys = torch.cat([cache.src_mask, cache.src_mask.new_zeros(B, 1, 1, t + 1)], dim=-1)  # (B, 1, 1, S+t+1)
        h = self._stack(self._embed(y_prev, pos), keys, cache.layers)
        cache.step += 1
        return self.logits(h, cache.vocab_subset)[:, -1], []

