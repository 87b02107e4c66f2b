"""Search: greedy and beam decoding with the length-normalized score.

    score(y) = (1 / lp(m)) * sum_{t=1}^{m} log p(y_t | y_<t, x)       (docs/model.md (30))

m counts every scored token of y, the final </s> included.  Both searches
drive a :class:`StepDecoder` — anything with ``step`` (log-probabilities of
the next token for each row) and ``select`` (keep/reorder rows) — so the
same code runs a real model (:class:`ModelDecoder`, which owns the
encoder output's K/V cache) or a scripted decoder in the tests.

Beam search is vectorized over sentences and beams: the N active sentences
hold K beams each as rows n*K + k; finished hypotheses stay in fixed-size
tensors per sentence; a sentence stops when no live beam can still beat its
n-best finished ones (``stop``: exact, at any length up to the cap; early,
if it ended at the next step), and leaves the batch (its rows are dropped
from the cache) so the remaining sentences run on a smaller batch.

Sentences (greedy search: rows) that end leave in groups: they step on, their
outputs unread, until the live ones fit :func:`row_bucket`'s next smaller row
count, so a batch's steps multiply a few row counts (64, 56, ..., 8, 4, 2, 1)
instead of every one from the batch size down (not when sampling: an ended row
would draw, and move the seed's draws).  oneDNN builds its bf16 kernels per row
count the first time it meets one (0.35-0.8 ms each on an Intel Xeon with AMX);
there, with 2 workers and --precision auto (bf16), a whole ``s2s translate`` of
1,000 lines took 0.89-0.92 of its time for greedy search and 0.96 for beam 5, the
same outputs (README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import Tensor

from s2s.config import DecodeConfig
from s2s.hypotheses import Hypothesis, length_penalty  # noqa: F401 (importable from here too)
from s2s.model.cache import sentence_rows
from s2s.model.interface import S2SModel

NEG_INF = float("-inf")


def best_tokens(logp: Tensor) -> tuple[Tensor, Tensor]:
    """(max_v logp[n, v], argmax_v logp[n, v]) of each row n of logp (N, V), the first
    maximum on ties, as ``logp.max(dim=-1)``.

    On the CPU the index comes from numpy's argmax: torch's CPU max-with-index (and
    argmax, topk(1)) scans a row with scalar code, 434 us for (64, 4000) on an AMD
    EPYC core where numpy takes 37; the max itself is then a gather.  bf16 scores (a greedy
    step's, left unconverted) go to the C kernel's argmax (s2s.model.native.argmax_rows),
    else are widened to fp32 first (exactly: the same maximum and index).
    """
    if logp.device.type != "cpu":
        return logp.max(dim=-1)
    if logp.dtype == torch.bfloat16:  # a greedy step's unconverted bf16 scores (ModelDecoder.step)
        from s2s.model.native import argmax_rows

        found = argmax_rows(logp)
        if found is not None:
            return found
        logp = logp.float()  # (exact)
    if logp.dtype not in (torch.float32, torch.float64):
        return logp.max(dim=-1)
    import numpy as np  # torch's own dependency

    y = torch.from_numpy(np.argmax(logp.detach().contiguous().numpy(), axis=-1))
    return logp.gather(-1, y[:, None]).squeeze(-1), y


# entries per group in largest_k (the rows of its grid): the k best groups' c k entries are
# few, and the groups' maxima are c passes over contiguous rows (c = 16 measured fastest
# among 4-32 for beam 5's candidates)
TOPK_GROUP_ROWS = 16


def largest_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest entries of each row of x (N, n), best first,
    as ``x.topk(k, dim=-1)`` (ties aside, where either may pick).

    Exact by a bound: split a row into G = n // c groups of c entries (x[j::G] within
    the first G c; the tail of n mod c entries always stays in the running).  An entry e outside the k groups
    with the largest maxima is beaten by those k maxima, so it is not among the k
    largest; the k largest therefore lie among the k best groups' c k entries (plus
    the tail), and one small topk over those finds them.  The groups' maxima are one
    vectorized pass, where torch's CPU topk runs a scalar selection over all n:
    (64, 20,000), k = 10 (beam 5's candidates over a 4,000-piece vocabulary) takes
    2.5 ms with topk and 0.54 ms this way on an AMD EPYC core.
    """
    N, n = x.shape
    c = TOPK_GROUP_ROWS
    G = n // c
    if x.device.type != "cpu" or G <= 4 * k:
        return x.topk(k, dim=-1)
    x = x.contiguous()
    grid = x[:, :G * c].view(N, c, G)  # entry (r, j) = x[r * G + j]: group j is column j
    best_groups = grid.amax(dim=1).topk(k, dim=-1).indices  # (N, k)
    picked = grid.gather(2, best_groups[:, None, :].expand(N, c, k)).reshape(N, c * k)
    tail = n - G * c
    if tail:
        picked = torch.cat([picked, x[:, G * c:]], dim=1)
    values, j = picked.topk(k, dim=-1)  # j < c k: row j // k of group best_groups[j % k]
    in_groups = j < c * k
    j_in = torch.where(in_groups, j, 0)
    index = torch.div(j_in, k, rounding_mode="floor") * G + best_groups.gather(1, j_in % k)
    return values, torch.where(in_groups, index, j - c * k + G * c)


@dataclass(frozen=True)
class SpecialIds:
    """The tokenizer's special token ids the search needs (the settings come from DecodeConfig)."""

    bos_id: int  # y_0, the first decoder input
    eos_id: int  # </s>: a hypothesis ends with it
    pad_id: int  # never generated


class StepDecoder(Protocol):
    def step(self, y_prev: Tensor) -> Tensor:
        """y_prev (N, 1) -> log-probabilities (N, V) of the next token."""

    def select(self, index: Tensor, group: Optional[int] = None) -> None:
        """Keep rows ``index`` of the decoding state, in that order.  ``group`` K:
        from now on the rows are sentences' K beams (rows n*K .. n*K+K-1), which a
        decoder may use to share per-sentence state (see :class:`DecoderCache`)."""

    # for the coverage penalty, a decoder also offers (after each step):
    #   attention() -> (N, S) the step's cross-attention over the source
    #   source_mask() -> (N, S) bool, true at real (non-pad) source positions


class ModelDecoder:
    """A :class:`StepDecoder` over a model: encodes once, then one step at a time.

    With ``track_attention`` each step also keeps the last decoder layer's
    cross-attention averaged over heads (for the coverage penalty).  With
    ``vocab_subset`` (V',) ascending target ids (a shortlist), the search runs
    over the subset: token i of the search is target id vocab_subset[i], the
    log-probs are (N, V') and normalized over the subset.  With ``greedy_kv_dtype`` the
    attention K/V are kept in that dtype (a greedy search's, see
    :meth:`~s2s.model.cache.DecoderCache.narrow_kv`), unless attention weights are read.

    With ``normalized`` False a step returns the scores z (N, V) themselves, not
    log p = z - log sum_v exp z_v: the same argmax, for a greedy search whose hypotheses
    need no log-probability (:func:`greedy_search` then leaves their scores NaN).  The
    normalization is an exp over every row's V scores, about 5% of a greedy translation
    (CTranslate2's greedy search skips it too unless scores are asked for).  A bf16 model's
    z stay bf16 on the CPU (:func:`best_tokens` reads them so): converting 64 x 8,000 of them
    to fp32 took 182 us a step on an Intel Xeon with AMX, 0.94-0.97 of greedy's time without it."""

    def __init__(self, model: S2SModel, src: Tensor, track_attention: bool = False,
                 vocab_subset: Optional[Tensor] = None, normalized: bool = True,
                 greedy_kv_dtype: Optional[torch.dtype] = None):
        self.model = model
        self.track_attention = track_attention
        self.normalized = normalized
        self._attention: Optional[Tensor] = None
        self.cache = model.start_decoding(model.encode(src))  # the source's K/V, once
        if greedy_kv_dtype is not None and not track_attention and not model.needs_attention:
            self.cache.narrow_kv(greedy_kv_dtype)  # (no attention weights are read from them)
        self.ids = vocab_subset
        if vocab_subset is not None:
            self.cache.vocab_subset = model.vocab_subset(vocab_subset)  # W_U's rows, once

    def step(self, y_prev: Tensor) -> Tensor:
        if self.ids is not None:
            y_prev = self.ids[y_prev]  # subset positions -> target ids
        logits, weights = self.model.decode_step(y_prev, self.cache, need_last=self.track_attention)
        if self.track_attention:
            self._attention = weights[-1][:, :, -1].float().mean(1)  # (N, S)
        if not self.normalized and logits.dtype == torch.bfloat16 and logits.device.type == "cpu":
            return logits  # bf16 z as the output projection made it: best_tokens reads them so
        z = logits.float()  # (N, V): this step's own tensor, which nothing else holds
        if not self.normalized:
            return z
        if z.device.type == "cpu":
            # in place, no second (N, V) tensor: 1.6 against 2.0 ms for beam 5's 320 x 8,000 (a Zen 5 core)
            return torch.log_softmax(z, dim=-1, out=z)
        return torch.log_softmax(z, dim=-1)

    def select(self, index: Tensor, group: Optional[int] = None) -> None:
        self.cache.select(index, group)

    def attention(self) -> Tensor:
        return self._attention

    def source_mask(self) -> Tensor:
        return self.cache.src_mask[:, 0, 0, :] == 0


class EnsembleDecoder:
    """Several models decoding together, their probabilities linearly interpolated
    (docs/model.md (36)):

        log p(v) = log sum_i w_i p_i(v),   w_i = weight_i / sum_j weight_j

    (equal weights by default: the mean of their probabilities, as fairseq's ensembles);
    the attention is the same weighted mean of theirs."""

    def __init__(self, decoders: list[ModelDecoder], weights: Optional[list[float]] = None):
        self.decoders = decoders
        self.log_w = ensemble_log_weights(weights or [1.0] * len(decoders))  # (n,)

    def step(self, y_prev: Tensor) -> Tensor:
        logps = torch.stack([d.step(y_prev) for d in self.decoders])  # (n, N, V)
        return torch.logsumexp(logps + self.log_w.to(logps.device)[:, None, None], dim=0)

    def select(self, index: Tensor, group: Optional[int] = None) -> None:
        for d in self.decoders:
            d.select(index, group)

    def attention(self) -> Tensor:
        a = torch.stack([d.attention() for d in self.decoders])  # (n, N, S)
        return (a * self.log_w.exp().to(a.device)[:, None, None]).sum(0)

    def source_mask(self) -> Tensor:
        return self.decoders[0].source_mask()


def ensemble_log_weights(weights: list[float]) -> Tensor:
    """log w_i with w_i = weight_i / sum_j weight_j: ensemble weights normalized to sum to 1."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if w.numel() == 0 or not bool(torch.isfinite(w).all()) or bool((w <= 0).any()):
        raise ValueError(f"ensemble weights must be positive numbers, got {weights}")
    return (w / w.sum()).log().float()


def coverage_penalty(attention_sum: Tensor, source_mask: Tensor, beta: float) -> Tensor:
    """cp(X; Y) = beta * sum_j log(min(sum_t A_tj, 1))   (Wu et al. 2016), per row.

    attention_sum (N, S): the attention each source position received over the
    hypothesis; only real source positions count; a position never attended
    contributes log(1e-9) rather than -inf."""
    covered = attention_sum.clamp(min=1e-9, max=1.0).log()
    return beta * (covered * source_mask).sum(-1)


def block_repeated_ngrams(logp: Tensor, tokens: Tensor, n: int) -> Tensor:
    """Set log p(v) = -inf where (y_{t-n+2}, ..., y_t, v) already occurs in the row, in place.

    logp (N, V), tokens (N, t): the hypotheses so far.  Vectorized: every
    n-gram window of each row is compared with the row's last n-1 tokens.
    """
    t = tokens.size(1)
    if n <= 0 or t < n:  # no complete n-gram yet
        return logp
    if n == 1:
        return logp.scatter_(1, tokens, NEG_INF)
    windows = tokens.unfold(1, n, 1)  # (N, t-n+1, n)
    last = tokens[:, t - n + 1:]  # (N, n-1)
    match = (windows[:, :, :-1] == last[:, None, :]).all(-1)  # (N, t-n+1)
    rows, starts = match.nonzero(as_tuple=True)
    logp[rows, windows[rows, starts, -1]] = NEG_INF
    return logp


def constrain(logp: Tensor, t: int, max_len: Tensor, s: DecodeConfig, ids: SpecialIds,
              tokens: Optional[Tensor] = None, forced: Optional[Tensor] = None) -> Tensor:
    """Apply the search rules to step t's log-probs (N, V), in place.

    pad and the start symbol are never generated (unless it is </s> itself); </s> is blocked while t < min_len and is
    the only choice at t = max_len - 1, so every hypothesis has m <= max_len;
    with ``no_repeat_ngram`` and the hypotheses so far (``tokens`` (N, t)),
    no n-gram repeats; ``forced`` (N,) a token id per row (-1: free) is the
    only choice of that row, with the model's log p (a forced target prefix).
    """
    if forced is not None:
        rows = (forced >= 0).nonzero().flatten()
        kept = logp[rows, forced[rows]].clone()
    logp[:, ids.pad_id] = NEG_INF
    if ids.bos_id != ids.eos_id:  # BART starts the decoder with </s>
        logp[:, ids.bos_id] = NEG_INF
    if t < s.min_len:
        logp[:, ids.eos_id] = NEG_INF
    if s.no_repeat_ngram and tokens is not None:
        block_repeated_ngrams(logp, tokens, s.no_repeat_ngram)
    at_max = max_len <= t + 1  # (N,)
    if logp.device.type != "cpu" or bool(at_max.any()):  # no host sync on an accelerator
        eos_lp = logp[:, ids.eos_id].clone()
        logp.masked_fill_(at_max[:, None], NEG_INF)
        logp[:, ids.eos_id] = torch.where(at_max, torch.where(torch.isinf(eos_lp), 0.0, eos_lp), logp[:, ids.eos_id])
    if forced is not None and rows.numel():
        logp[rows] = NEG_INF
        logp[rows, forced[rows]] = kept
    return logp


def forced_tokens(prefix: Optional[Tensor], t: int, sentence_of_row: Tensor) -> Optional[Tensor]:
    """The prefix token each row must take at step t, or -1.  prefix (B, P), -1 padded."""
    if prefix is None or t >= prefix.size(1):
        return None
    return prefix[sentence_of_row, t]


def sampling_distribution(logp: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """q(v) ∝ exp(log p(v) / T), restricted to the k most probable tokens (top_k > 0)
    and to the smallest most-probable set whose mass under q reaches top_p (nucleus).

    logp (N, V) -> log q (N, V), -inf outside the kept set; the most probable
    token is always kept.
    """
    logq = torch.log_softmax(logp / temperature, dim=-1)
    if top_k and top_k < logq.size(-1):
        kth = logq.topk(top_k, dim=-1).values[:, -1:]
        logq = logq.masked_fill(logq < kth, NEG_INF)
    if top_p < 1.0:
        sorted_lq, order = logq.sort(dim=-1, descending=True)
        mass_before = sorted_lq.exp().cumsum(-1) - sorted_lq.exp()  # mass of the better tokens
        drop = mass_before >= top_p
        drop[:, 0] = False
        logq = logq.masked_fill(drop.scatter(1, order, drop), NEG_INF)
    return torch.log_softmax(logq, dim=-1)


def tail_filled(done: Tensor) -> Tensor:
    """The rows (or sentences) that go on when those ``done`` (B,) bool have ended, as the index
    of a select keeping n: each one that goes on stays where it is when that is below n, and
    the others (past n) fill the ended ones' places below n, so that a cache moves only
    those (:func:`s2s.model.cache.tail_moves`) instead of every row."""
    going_on = ~done
    n = int(going_on.sum())
    index = torch.arange(n, device=done.device)
    index[done[:n].nonzero().flatten()] = going_on[n:].nonzero().flatten() + n
    return index


def row_bucket(n: int) -> int:
    """The rows a search steps for n live ones: n rounded up to a multiple of 8, or to 1, 2, 4 or
    8 below that.  A step's products then take a few row counts, not every one from the batch
    size down to 1: oneDNN builds its bf16 kernel for each new row count the first time it
    sees it (0.35-0.8 ms each on an Intel Xeon with AMX, against 35 us a call after), 64 x 6
    of them in the decoder layers of a greedy search of batches of 64."""
    return -(-n // 8) * 8 if n > 8 else 1 << (n - 1).bit_length()


def rows_leaving(ended: Tensor, live: int) -> Optional[Tensor]:
    """Which rows leave the batch now, (N,) bool, where its N rows, ``ended`` (N,) bool of them
    ended, are more than :func:`row_bucket` of the ``live`` ones; else None (the ended rows
    step on, their tokens unread).  The ended rows that stay are the first ones, which do not
    move (:func:`tail_filled`)."""
    rows = ended.numel()
    target = row_bucket(live)
    if target >= rows:
        return None
    out = ended.clone()
    spare = ended.nonzero().flatten()[:target - live]  # ended rows kept to fill the bucket
    out[spare] = False
    return out


@torch.no_grad()
def greedy_search(decoder: StepDecoder, max_len: Tensor, s: DecodeConfig, ids: SpecialIds,
                  prefix: Optional[Tensor] = None) -> list[list[Hypothesis]]:
    """y_t = argmax_v log p(v | y_<t, x) until </s>; one hypothesis per sentence.

    With ``s.sampling``, y_t ~ q instead (see :func:`sampling_distribution`),
    drawn from a generator seeded with ``s.seed``; the hypothesis's score is
    still the model's log p of the drawn tokens.  Sampling draws ``s.nbest``
    independent samples per sentence (rows n*K + k, as a beam's), returned
    best score first.  A decoder whose steps are not normalized (``normalized``
    False: scores z, not log p) gives the same tokens, and hypotheses whose
    score and log_prob are NaN.
    """
    scored = getattr(decoder, "normalized", True)  # log p (else z: the same argmax, no score)
    if s.sampling and not scored:
        raise ValueError("sampling draws from log p: its decoder must normalize its steps")
    B = max_len.size(0)
    device = max_len.device
    K = s.nbest if s.sampling else 1  # samples per sentence
    if K > 1:
        decoder.select(torch.arange(B, device=device).repeat_interleave(K), group=K)  # (B*K) rows
        max_len = max_len.repeat_interleave(K)
    rows_out: list[Optional[Hypothesis]] = [None] * (B * K)
    active = torch.arange(B * K, device=device)  # original row (sentence * K + sample) of each row
    y = torch.full((B * K, 1), ids.bos_id, dtype=torch.long, device=device)
    tokens = torch.empty((B * K, 0), dtype=torch.long, device=device)
    log_prob = torch.zeros(B * K, device=device)
    gen = torch.Generator(device=device).manual_seed(s.seed) if s.sampling else None
    row_max = max_len  # (N,) max_len of each active row, narrowed as rows leave
    ended = torch.zeros(B * K, dtype=torch.bool, device=device)  # rows whose hypothesis is made, still stepping
    for t in range(int(max_len.max())):
        forced = None if prefix is None else forced_tokens(prefix, t, torch.div(active, K, rounding_mode="floor"))
        logp = constrain(decoder.step(y), t, row_max, s, ids, tokens, forced)  # (N, V)
        if gen is None:
            best_lp, y_t = best_tokens(logp)  # (N,)
        else:
            q = sampling_distribution(logp, s.temperature, s.top_k, s.top_p).exp()
            y_t = torch.multinomial(q, 1, generator=gen).squeeze(1)
            best_lp = logp.gather(1, y_t[:, None]).squeeze(1)
        log_prob = log_prob + best_lp
        tokens = torch.cat([tokens, y_t[:, None]], dim=1)
        done = (y_t == ids.eos_id) & ~ended
        if bool(done.any()):
            m = t + 1
            norm = length_penalty(float(m), s.alpha, s.length_penalty)
            for row in done.nonzero().flatten().tolist():
                lp = float(log_prob[row]) if scored else math.nan
                rows_out[int(active[row])] = Hypothesis(tokens[row, :-1].tolist(), lp / norm, lp)
            ended |= done
            live = int((~ended).sum())
            if live == 0:
                break
            # sampling draws for every row it holds: rows leave as they end, so that a seed's
            # draws and the rows they go to stay as they were (and an ended row never draws)
            leaving = ended if gen is not None else rows_leaving(ended, live)
            if leaving is not None:
                keep = tail_filled(leaving)
                decoder.select(keep, group=1)  # rows leave on their own: no longer K per sentence
                active, row_max, tokens, ended = active[keep], row_max[keep], tokens[keep], ended[keep]
                log_prob, y_t = log_prob[keep], y_t[keep]
        y = y_t[:, None]
    return [sorted((h for h in rows_out[b * K:(b + 1) * K] if h is not None), key=lambda h: -h.score)
            for b in range(B)]


@torch.no_grad()
def beam_search(decoder: StepDecoder, max_len: Tensor, s: DecodeConfig, ids: SpecialIds,
                prefix: Optional[Tensor] = None) -> list[list[Hypothesis]]:
    """Beam search of width K = s.beam; returns the s.nbest best per sentence, best first.

    The decoder starts with one row per sentence; rows are expanded to K
    beams (row n*K + k) by the first ``select``.  A finished hypothesis scores
    log p / lp(m), plus the coverage penalty cp when ``s.coverage_penalty`` > 0;
    ``prefix`` (B, P) forces each sentence's first tokens (-1 padded).
    """
    K, device = s.beam, max_len.device
    B = max_len.size(0)
    L = int(max_len.max())
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)  # original sentence of each active sentence
    scores, tokens, fin_scores, fin_logp, fin_len, fin_tokens = start_beams(decoder, B, K, L, device)
    y = torch.full((B * K, 1), ids.bos_id, dtype=torch.long, device=device)
    beta = s.coverage_penalty
    attn_sum: Optional[Tensor] = None  # (N*K, S) attention received so far, per row
    # per-sentence and per-row state that changes only when sentences leave (not every step)
    sent_max = max_len  # (N,) max_len of each active sentence
    row_max = max_len.repeat_interleave(K)  # (N*K,) max_len of each row's sentence
    first_row = (torch.arange(B, device=device) * K)[:, None]  # (B, 1): row n*K, sentence n's first beam
    ended = torch.zeros(B, dtype=torch.bool, device=device)  # sentences whose hypotheses are made, still stepping

    for t in range(L):
        N = active.size(0)
        forced = None if prefix is None else forced_tokens(prefix, t, active.repeat_interleave(K))
        logp = constrain(decoder.step(y), t, row_max, s, ids, tokens, forced)  # (N*K, V)
        if beta:
            a = decoder.attention()  # (N*K, S): this step's attention of each row
            attn_sum = a if attn_sum is None else attn_sum + a
            cp_row = coverage_penalty(attn_sum, decoder.source_mask(), beta)  # (N*K,)
        V = logp.size(-1)
        cand = logp.add_(scores.view(N * K, 1)).view(N, K * V)  # in place: no second (N*K, V) tensor
        cand_scores, cand_idx = largest_k(cand, 2 * K)  # (N, 2K), best first
        cand_beam = torch.div(cand_idx, V, rounding_mode="floor")  # (N, 2K)
        cand_tok = cand_idx % V
        cand_row = cand_beam + first_row[:N]  # rows in N*K
        m = t + 1  # length of a hypothesis ending at this step, </s> included

        # 1. finish: </s> among the top-K candidates joins the sentence's finished set
        is_eos = (cand_tok == ids.eos_id) & torch.isfinite(cand_scores)
        is_eos[:, K:] = False
        if bool(is_eos.any()):
            norm = cand_scores / length_penalty(float(m), s.alpha, s.length_penalty)
            if beta:
                norm = norm + cp_row[cand_row]  # cp <= 0: the live-beam bound below stays valid
            new_norm = torch.where(is_eos, norm, NEG_INF)
            new_tokens = torch.zeros((N, 2 * K, L), dtype=torch.long, device=device)
            new_tokens[:, :, :t] = tokens[cand_row.flatten()].view(N, 2 * K, t)
            all_scores = torch.cat([fin_scores, new_norm], dim=1)  # (N, 3K)
            fin_scores, pick = all_scores.topk(K, dim=-1)
            fin_logp = torch.cat([fin_logp, cand_scores], 1).gather(1, pick)
            fin_len = torch.cat([fin_len, torch.full_like(cand_scores, m, dtype=torch.long)],
                                1).gather(1, pick)
            fin_tokens = torch.cat([fin_tokens, new_tokens], 1).gather(
                1, pick[:, :, None].expand(N, K, L))

        # 2. continue: the K best candidates that did not end
        live = torch.where(cand_tok == ids.eos_id, NEG_INF, cand_scores)
        scores, pick = live.topk(K, dim=-1)  # (N, K)
        rows = cand_row.gather(1, pick).flatten()  # (N*K,) surviving beams' rows
        y_t = cand_tok.gather(1, pick).flatten()
        tokens = torch.cat([tokens[rows], y_t[:, None]], dim=1)  # (N*K, t+1)
        decoder.select(rows)
        if beta:
            attn_sum = attn_sum[rows]

        # 3. stop a sentence when no live beam can beat its n-best finished ones
        bound = beam_stop_bound(scores[:, 0], m, sent_max, s)
        done = ((fin_scores[:, s.nbest - 1] >= bound) | (sent_max <= m)) & ~ended
        if bool(done.any()):
            for n in done.nonzero().flatten().tolist():
                hyps = []
                for k in range(s.nbest):
                    score = float(fin_scores[n, k])
                    if math.isfinite(score):
                        length = int(fin_len[n, k])
                        hyps.append(Hypothesis(fin_tokens[n, k, :length - 1].tolist(), score,
                                               float(fin_logp[n, k])))
                results[int(active[n])] = hyps
            ended |= done
            live = int((~ended).sum())
            if live == 0:
                break
            leaving = rows_leaving(ended, live)  # ended sentences step on until a bucket's worth leave
            if leaving is not None:
                keep, keep_rows = still_searching(decoder, leaving, K)
                active, scores, sent_max, row_max = active[keep], scores[keep], sent_max[keep], row_max[keep_rows]
                fin_scores, fin_logp, fin_len = fin_scores[keep], fin_logp[keep], fin_len[keep]
                fin_tokens, ended = fin_tokens[keep], ended[keep]
                tokens, y_t = tokens[keep_rows], y_t[keep_rows]
                if beta:
                    attn_sum = attn_sum[keep_rows]
        y = y_t[:, None]
    return results


def start_beams(decoder: StepDecoder, B: int, K: int, L: int,
                device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Each sentence's one decoder row made K beams (row n*K + k) and the empty state of a
    beam search of outputs up to L tokens: (cumulative log p of the live beams (B, K), only
    beam 0 live since all start identical; their tokens (B*K, 0); the finished hypotheses'
    normalized scores (B, K), best first, -inf: none yet; their log p (B, K); their lengths
    (B, K); their tokens (B, K, L))."""
    decoder.select(torch.arange(B, device=device).repeat_interleave(K), group=K)  # (B*K) rows
    scores = torch.full((B, K), NEG_INF, device=device)
    scores[:, 0] = 0.0
    return (scores, torch.empty((B * K, 0), dtype=torch.long, device=device),
            torch.full((B, K), NEG_INF, device=device), torch.zeros((B, K), device=device),
            torch.zeros((B, K), dtype=torch.long, device=device),
            torch.zeros((B, K, L), dtype=torch.long, device=device))


def still_searching(decoder: StepDecoder, done: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """The sentences not ``done`` (N,) bool, (N',) positions in :func:`tail_filled`'s order, and
    their beams' rows (N'*K,): sentence n's rows n*K .. n*K+K-1; the decoder keeps only those
    rows (none: nothing left)."""
    keep = tail_filled(done)  # the last sentences fill the places of those that ended
    keep_rows = sentence_rows(keep, K)
    if keep.numel():
        decoder.select(keep_rows)
    return keep, keep_rows


def beam_stop_bound(best_live: Tensor, m: int, max_len: Tensor, s: DecodeConfig) -> Tensor:
    """The best normalized score the live beams (best cumulative log p ``best_live`` (N,),
    m tokens so far) may still reach; a sentence stops once its n-best finished beat it.

    exact: log p only falls as a beam grows, so the bound is max over m' in
           (m, max_len] of best_live / lp(m') = max(best_live / lp(m+1), best_live / lp(max_len))
           (lp grows with m, best_live <= 0): no better hypothesis is ever cut off
           (Hugging Face's early_stopping="never").
    early: best_live / lp(m+1), as if the best live beam ended at the next step
           (Hugging Face's default; CTranslate2 stops when its top beam has ended):
           fewer steps, the search no longer provably exact.
    """
    lp_next = length_penalty(torch.full_like(best_live, m + 1), s.alpha, s.length_penalty)
    bound = best_live / lp_next
    if s.stop == "exact":
        lp_last = length_penalty(max_len.float(), s.alpha, s.length_penalty)
        bound = torch.maximum(bound, best_live / lp_last)
    elif s.stop != "early":
        raise ValueError(f"unknown stop rule {s.stop!r}")
    return torch.where(torch.isfinite(best_live), bound, NEG_INF)


def search(decoder: StepDecoder, max_len: Tensor, s: DecodeConfig, ids: SpecialIds,
           prefix: Optional[Tensor] = None, constraints: Optional[Tensor] = None) -> list[list[Hypothesis]]:
    """Greedy (or sampling) when beam = 1, else beam search.

    A coverage penalty rescores finished hypotheses, which greedy search never
    compares: with one, beam = 1 is a beam search of width 1 (a finished
    hypothesis scores log p / lp(m) + cp and competes with the live one, as at
    any width), not greedy.  ``constraints`` (B, M, L), token sequences -1 padded,
    that each output must contain: lexically constrained beam search at any width
    (s2s.constraints, dynamic beam allocation)."""
    if s.sampling and s.beam != 1:
        raise ValueError("sampling draws one token per step: use beam = 1")
    if not greedy_search_runs(s, constraints) and not getattr(decoder, "normalized", True):
        raise ValueError("a beam search compares log p: its decoder must normalize its steps")
    if s.sampling and s.coverage_penalty:
        raise ValueError("sampling does not rescore hypotheses: no coverage penalty")
    if constraints is not None:
        if s.sampling:
            raise ValueError("sampling draws tokens: it cannot keep lexical constraints")
        from s2s.constraints import constrained_beam_search  # it builds on this module

        return constrained_beam_search(decoder, max_len, s, ids, constraints, prefix)
    if greedy_search_runs(s, constraints):
        return greedy_search(decoder, max_len, s, ids, prefix)
    return beam_search(decoder, max_len, s, ids, prefix)


def greedy_search_runs(s: DecodeConfig, constraints: Optional[Tensor] = None) -> bool:
    """Whether :func:`search` runs :func:`greedy_search` (or sampling) for these settings: beam 1,
    no lexical constraints, and no coverage penalty unless sampling (see :func:`search`)."""
    return s.beam == 1 and constraints is None and (s.sampling or not s.coverage_penalty)
