"""The encoder-decoder transformer (docs/model.md (1)-(21)).

    Enc: x -> H_enc (B, S, d_model)                      runs once per input
    Dec: (y_<t, H_enc) -> p_t = softmax(h_t W_U)        runs per output token

The entry points of :class:`~s2s.model.interface.S2SModel`, no hidden state:
    encode(src)                      -> EncoderState        H_enc (B, S, d_model), src_mask
    forward(src, tgt_in)             -> logits (B, T, V)    teacher forcing
    start_decoding(enc)              -> DecoderCache        cross-attn K/V, once
    decode_step(y_prev, cache)       -> logits (B, V)       one step, cache grows
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor, nn

from s2s.config import ModelConfig
from s2s.model.attention import causal_mask, padding_mask
from s2s.model.base import ModelBase
from s2s.model.cache import DecoderCache, LayerCache
from s2s.model.copy import CopyHead
from s2s.model.interface import EncoderState
from s2s.model.layers import DecoderLayer, EncoderLayer, make_norm
from s2s.model.packing import Packing
from s2s.model.positions import LearnedPositions, RelativePositionBias, SinusoidalPositions
from s2s.model.step_script import run_step_script, script_step
from s2s.params import parameter_budget  # noqa: F401 (its home is s2s.params; re-exported)

log = logging.getLogger("s2s")


class Seq2SeqTransformer(ModelBase):
    # decode_step as one TorchScript program (script_step); not a submodule: no keys in the state
    step_script: Optional[torch.jit.ScriptModule] = None

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
        # the pointer-generator (model.copy): its gate p_gen = sigmoid(w_p . [h_t; ctx_t; x_t] + b_p)
        self.p_gen_proj = nn.Linear(3 * d, 1) if cfg.copy else None
        self.copy_head = CopyHead() if cfg.copy else None
        # pre-norm stacks end with a norm (their residual stream is never normalized otherwise)
        self.enc_final_norm = make_norm(cfg) if pre_norm else nn.Identity()
        self.dec_final_norm = make_norm(cfg) if pre_norm else nn.Identity()
        self.build_embedding_and_output(cfg, tgt_vocab)
        self.reset_parameters()

    def step_layers(self) -> nn.ModuleList:
        return self.decoder_layers

    def embedding_tables(self) -> list[nn.Embedding]:
        return list({id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values())

    # ------------------------------------------------------------------ #
    def _embed(self, tokens: Tensor, table: nn.Embedding, positions: Optional[nn.Module],
               norm: Optional[nn.Module], start: int = 0) -> Tensor:
        """x = Dropout(Norm(E[tokens] s_E + P[start:start+L])) of one stack (see ModelBase.embed)."""
        P = None if positions is None else positions(tokens.size(1), start, device=tokens.device)  # (L, d_model)
        return self.embed(tokens, table, P, norm)

    def encode(self, src: Tensor) -> EncoderState:
        """src (B, S) token ids -> H_enc (B, S, d_model) and src_mask (B, 1, 1, S).

        Without autograd (decoding, evaluation) a batch with enough padding runs its
        position-wise layers on the real positions only (s2s.model.packing); H_enc is 0 at
        the padded positions then, which the padding mask keeps every attention from reading."""
        src_mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        mask = src_mask
        if self.enc_rel_bias is not None:
            S = src.size(1)
            mask = src_mask + self.enc_rel_bias(S, S, device=src.device)  # (B, heads, S, S)
        x = self._embed(src, self.src_embed, self.enc_positions, self.enc_embed_norm)
        packing = None if torch.is_grad_enabled() else Packing.of(src, self.pad_id)
        if packing is not None:
            x = packing.pack(x)  # (N, d_model)
        for layer in self.encoder_layers:
            x = layer(x, mask, packing=packing)
        h_enc = self.enc_final_norm(x)
        return EncoderState(src=src, src_mask=src_mask, h_enc=h_enc if packing is None else packing.pad(h_enc))

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

    def _decoder_stack(self, x: Tensor, self_mask: Optional[Tensor], cache: DecoderCache, need_weights: bool,
                       need_last: bool, packing: Optional[Packing] = None) -> tuple[Tensor, list[Optional[Tensor]]]:
        """The decoder blocks over x (B, T, d_model), each with its cache entry -> the final
        states (B, T, d_model) and each layer's cross-attention A (B, heads, T, S): every
        layer's with ``need_weights``; the last one's with ``need_last`` or when copy or
        coverage reads it; None elsewhere.  With ``packing``, x and the states are the real
        positions only (N, d_model) (DecoderLayer.forward)."""
        last = len(self.decoder_layers) - 1
        want_last = need_last or self.needs_attention
        weights = []
        for i, (layer, lc) in enumerate(zip(self.decoder_layers, cache.layers)):
            x, A = layer(x, self_mask, cache.src_mask, lc, cache.group, need_weights or (want_last and i == last),
                         packing)
            weights.append(A)
        return self.dec_final_norm(x), weights

    def decode(self, tgt_in: Tensor, enc: EncoderState, need_weights: bool = False,
               keep: Optional[Tensor] = None, head: bool = True) -> tuple[Tensor, list]:
        """Teacher-forced decoder over the whole shifted target at once.

        tgt_in (B, T) -> scores (B, T, V) and, with ``need_weights``, the
        cross-attention weights of every layer [(B, heads, T, S)].  The scores
        are the logits z, or with ``model.copy`` the log-probabilities log P
        of the pointer-generator (which reads the source ids ``enc.src``).  With
        ``keep`` (B, T) bool, only the scores (n, V) of the n kept positions (the
        real, non-pad targets): the output projection skips the padding.  With ``head``
        False, the last decoder states h (n, d_model) of the kept positions instead of their
        scores (for :meth:`head_nll`; needs ``keep``, and a model without copy).
        """
        T = tgt_in.size(1)
        self_mask = self._self_mask(T, T, 0, tgt_in.device)
        x_in = self._embed(tgt_in, self.tgt_embed, self.dec_positions, self.dec_embed_norm)
        cache = self.start_decoding(enc)  # all T positions in one step
        if not head:
            if keep is None or self.cfg.copy:
                raise ValueError("decode: head=False takes the kept positions of a model without copy")
            # the position-wise layers on the kept positions only (s2s.model.packing): a target's
            # real positions in tgt_in are its kept ones in tgt_out (one shift apart, same length),
            # a prefix of its row, so no kept query attends to a position left out
            packing = None if self.cfg.coverage or need_weights else Packing.of_real(keep)
            x = x_in if packing is None else packing.pack(x_in)
            h, weights = self._decoder_stack(x, self_mask, cache, need_weights, False, packing)
            return (h[keep] if packing is None else h), weights  # (n, d_model)
        h, weights = self._decoder_stack(x_in, self_mask, cache, need_weights, need_last=False)
        if keep is not None and not self.cfg.copy:
            return self.logits(h[keep]), weights  # (n, V)
        scores = self._scores(h, x_in, weights[-1], cache)
        return (scores if keep is None else scores[keep]), weights

    def _scores(self, h: Tensor, x_in: Tensor, A_last: Optional[Tensor], cache: DecoderCache) -> Tensor:
        """z = logits(h), or with model.copy the pointer-generator's log P over the last layer's
        attention averaged over heads."""
        z = self.logits(h, cache.vocab_subset)
        if self.copy_head is None:
            return z
        if cache.vocab_subset is not None:
            raise ValueError("a copy model scores its whole vocabulary and its source: no vocabulary subset")
        return self.copy_head(self.p_gen_proj, z, h, x_in, A_last.mean(1), cache.h_enc, cache.src)

    def forward(self, src: Tensor, tgt_in: Tensor, return_attention: bool = False,
                keep: Optional[Tensor] = None, head: bool = True):
        """Teacher forcing: scores (B, T, V) of P(y_t | y_<t, x) for every t at once
        (logits, or log P with copy); with ``keep`` (B, T) bool only those positions' (n, V),
        and with ``head`` False too their last decoder states h (n, d_model) instead (no copy).
        With ``return_attention`` also the last decoder layer's cross-attention averaged
        over heads, a (B, T, S), for the coverage loss."""
        enc = self.encode(src)
        if not return_attention:
            return self.decode(tgt_in, enc, keep=keep, head=head)[0]
        scores, weights = self.decode(tgt_in, enc, need_weights=not self.needs_attention, keep=keep)
        return scores, weights[-1].mean(1)

    # ------------------------------------------------------------------ #
    def start_decoding(self, enc: EncoderState) -> DecoderCache:
        """Cross-attention K/V of every layer, computed once from H_enc (and, for copy,
        the source ids and H_enc; for coverage, c^0 = 0 in the last layer's entry)."""
        h_enc = enc.h_enc
        layers = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(h_enc)  # (B, heads, S, d_head)
            layers.append(LayerCache(cross_k=k, cross_v=v))
        if self.cfg.coverage:
            layers[-1].coverage = h_enc.new_zeros(h_enc.shape[:2], dtype=torch.float32)  # (B, S)
        # the cache's own source mask (a select may move its rows in place: DecoderCache.select), in
        # H_enc's dtype (0 and -inf either way), so that a bf16 step's attention does not convert it
        cache = DecoderCache(layers=layers, src_mask=enc.src_mask.to(h_enc.dtype, copy=True), beam_slots=True,
                             slot_dtype=self.beam_slot_dtype)
        if self.cfg.copy:
            cache.src, cache.h_enc = enc.src, h_enc
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
        # inference on the CPU, no attention weights read: what the script and the kernel take
        decoding = not (need_weights or self.training or torch.is_grad_enabled() or y_prev.device.type != "cpu"
                        or torch.compiler.is_compiling())
        scripted = decoding and not need_last and self.step_script is not None
        position_mask = self._self_mask(1, t + 1, t, y_prev.device)
        # beams in slots through the attention kernel: each reads its own ancestors' columns alone
        # (DecoderCache.self_columns), no mask; the scripted and the Python step alike
        if decoding and cache.slots > 1 and position_mask is None and self.decoder_layers[0].self_attn.native:
            cache.record_slots()
            self_mask, columns = None, cache.self_columns()
        else:
            self_mask, columns = cache.self_attention_mask(position_mask), None
        for lc in cache.layers:
            lc.columns = columns
        if scripted:
            z = self._scripted_step(y_prev, cache, self_mask, columns)
            if z is not None:
                return z, [None] * len(self.decoder_layers)
        x_in = self._embed(y_prev, self.tgt_embed, self.dec_positions, self.dec_embed_norm, start=t)  # (B, 1, d_model)
        h, weights = self._decoder_stack(x_in, self_mask, cache, need_weights, need_last)
        cache.step += 1
        return self._scores(h, x_in, weights[-1], cache)[:, -1], weights

    def _scripted_step(self, y_prev: Tensor, cache: DecoderCache, self_mask: Optional[Tensor],
                       self_columns: Optional[Tensor] = None) -> Optional[Tensor]:
        """decode_step through :attr:`step_script` (s2s.model.step_script): the same scores; None
        where the script fails (then nothing of this step is kept, and the steps run in Python
        from now on)."""
        B, first = y_prev.size(0), cache.layers[0]
        sa = self.decoder_layers[0].self_attn
        like = cache.src_mask  # the model's dtype and device (the cross K/V may be narrower: narrow_kv)
        for layer in cache.layers:  # room for this position's K/V, which the script writes
            layer.reserve(B // first.slots, first.slots, sa.heads, sa.d_head, like)
        P = None if self.dec_positions is None else self.dec_positions(1, cache.step, device=y_prev.device)
        try:
            h = run_step_script(self.step_script, y_prev, P, self_mask, cache, self_columns)  # (B, 1, d_model)
        except RuntimeError as e:  # TorchScript's errors too: a torch that scripts but cannot run it
            log.warning("the scripted decoder step failed (%s); decoding in Python",
                        str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
            object.__setattr__(self, "step_script", None)
            return None
        for layer in cache.layers:  # the script wrote this position's K/V at column t
            layer.advance(B // first.slots)
        cache.step += 1
        return self.logits(h, cache.vocab_subset)[:, -1]

    def script_step(self) -> bool:
        """Run decode_step through one TorchScript program from now on, where it can be
        (s2s.model.step_script): for decoding, after the arithmetic is set.  Returns whether."""
        object.__setattr__(self, "step_script", script_step(self))  # not registered as a submodule
        return self.step_script is not None


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied/shared matrix counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
