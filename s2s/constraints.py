"""Lexically constrained decoding by dynamic beam allocation (DBA).

    Matt Post and David Vilar. 2018. Fast Lexically Constrained Decoding with Dynamic
    Beam Allocation for Neural Machine Translation. NAACL-HLT 2018.

Sentence n must produce its constraints c_1 .. c_M (token sequences: a glossary's
target terms as pieces) each as a contiguous run of its output; C = sum_j |c_j|
constraint tokens in all.  Grid beam search (Hokamp and Liu 2017) would keep one
beam of K per number of constraint tokens met, (C + 1) K hypotheses; DBA keeps
one beam of K and divides it among those C + 1 *banks*, so the cost of a step
does not grow with C.  Each hypothesis h (a row) carries its progress as tensors:

    met (R, M) bool    met_j: c_j already occurs in h
    cur (R,)   long    the constraint h is in the middle of, -1 none
    off (R,)   long    tokens of c_cur generated so far (0 when cur = -1)

    bank(h) = sum_j met_j |c_j| + off        the constraint tokens h has generated, 0..C

A step t of :func:`constrained_beam_search` (numbered as in the code):

1. the rules of :func:`s2s.search.constrain`; and </s> is forbidden while
   bank(h) < C, except at the last step max_len allows, where </s> is the only
   choice: a constraint that cannot be met within max_len is given up there
   (the finished hypotheses that meet every constraint rank first, and when there
   is one, those that miss one are not returned; the caller checks the outputs
   and warns, see ``Translator.translate_chunk``);
2. the candidates (beam k, token v) of a sentence: the 2K best extensions
   overall (those of unconstrained beam search), each beam's 2 best tokens, and
   each beam's next constraint tokens (:func:`next_constraint_tokens`);
3. each candidate's progress after v (:func:`advance`), hence its bank;
4. finish: a </s> candidate that :func:`bank_allocation` gives a slot joins the
   sentence's finished hypotheses; continue: ``bank_allocation`` over the other
   candidates picks the K live beams;
5. stop as :func:`s2s.search.beam_search` does (the exact or early bound on the
   live beams); at K = 1 without a coverage penalty, at the first </s>, as greedy
   search does: constrained greedy decoding is DBA with one beam.

A sentence without constraints has C = 0, one bank, and its candidates include
the 2K best: it gets exactly the hypotheses of unconstrained beam search (of
greedy search at K = 1), so a batch may mix sentences with and without
constraints.  The unconstrained search never runs any of this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from s2s.config import DecodeConfig
from s2s.search import (
    NEG_INF,
    Hypothesis,
    SpecialIds,
    StepDecoder,
    beam_stop_bound,
    constrain,
    coverage_penalty,
    forced_tokens,
    largest_k,
    length_penalty,
    start_beams,
    still_searching,
)


def pad_constraints(constraint_ids: Sequence[Sequence[Sequence[int]]]) -> Optional[Tensor]:
    """Each sentence's constraints as token ids -> (B, M, L) long, -1 padded
    (M constraints of at most L tokens); None when no sentence has one."""
    kept = [[list(c) for c in cs if len(c)] for cs in constraint_ids]
    M = max((len(cs) for cs in kept), default=0)
    if M == 0:
        return None
    L = max(len(c) for cs in kept for c in cs)
    out = torch.full((len(kept), M, L), -1, dtype=torch.long)
    for n, cs in enumerate(kept):
        for j, c in enumerate(cs):
            out[n, j, :len(c)] = torch.tensor(c, dtype=torch.long)
    return out


def room_for_constraints(max_len: Tensor, constraints: Tensor, cap: int) -> Tensor:
    """max_len(x) raised to C + 1 (every constraint token, then </s>) where it is shorter,
    but not past ``cap`` (the longest output the model allows)."""
    C = (constraints >= 0).sum((1, 2))  # (B,)
    return torch.maximum(max_len, (C + 1).clamp(max=cap))


def unmet_constraints(tokens: Sequence[int], constraints: Sequence[Sequence[int]]) -> list[int]:
    """The indices j of the constraints c_j that do not occur in ``tokens`` as a contiguous run."""
    def occurs(c: Sequence[int]) -> bool:
        n = len(c)
        return any(list(tokens[i:i + n]) == list(c) for i in range(len(tokens) - n + 1))

    return [j for j, c in enumerate(constraints) if len(c) and not occurs(c)]


@dataclass
class ConstraintProgress:
    """Each row's progress through its sentence's constraints (see the module docstring)."""

    met: Tensor  # (R, M) bool
    cur: Tensor  # (R,) long, -1: inside no constraint
    off: Tensor  # (R,) long

    @classmethod
    def start(cls, rows: int, M: int, device: torch.device) -> "ConstraintProgress":
        return cls(torch.zeros((rows, M), dtype=torch.bool, device=device),
                   torch.full((rows,), -1, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device))

    def select(self, index: Tensor) -> "ConstraintProgress":
        return ConstraintProgress(self.met[index], self.cur[index], self.off[index])


def bank(p: ConstraintProgress, lengths: Tensor) -> Tensor:
    """bank(h) = sum_j met_j |c_j| + off: the constraint tokens each row has generated.
    lengths (R, M): |c_j| of each row's sentence (0 for no constraint)."""
    return (p.met * lengths).sum(-1) + p.off


def next_constraint_tokens(p: ConstraintProgress, cons: Tensor) -> Tensor:
    """The tokens that advance each row, (R, M), -1 elsewhere: inside c_cur, its next
    token c_cur[off] (in column cur); else the first token c_j[0] of each unmet c_j.
    cons (R, M, L): each row's sentence's constraints, -1 padded."""
    R, M, L = cons.shape
    rows = torch.arange(R, device=cons.device)
    first = cons[:, :, 0].masked_fill(p.met, -1)  # (R, M); -1 already for absent constraints
    cur = p.cur.clamp(min=0)
    following = cons[rows, cur, p.off.clamp(max=L - 1)]  # (R,)
    inside = torch.full_like(first, -1).scatter(1, cur[:, None], following[:, None])
    return torch.where((p.cur >= 0)[:, None], inside, first)


def advance(p: ConstraintProgress, cons: Tensor, lengths: Tensor, y: Tensor) -> ConstraintProgress:
    """The progress after each row generates y (R,):

        inside c_cur and y = c_cur[off]   ->  off + 1, and met_cur once off = |c_cur|
        otherwise                         ->  the partial progress is lost; if y = c_j[0] for an
                                              unmet c_j, the first such j starts (off = 1; met at
                                              once when |c_j| = 1)

    cons (R, M, L), -1 padded; lengths (R, M) = |c_j|."""
    R, M, L = cons.shape
    rows = torch.arange(R, device=cons.device)
    cur = p.cur.clamp(min=0)
    continues = (p.cur >= 0) & (cons[rows, cur, p.off.clamp(max=L - 1)] == y)  # (R,)
    opens = ~p.met & (cons[:, :, 0] == y[:, None]) & (lengths > 0)  # (R, M)
    starts = ~continues & opens.any(-1)
    new_cur = torch.where(continues, p.cur, torch.where(starts, opens.int().argmax(-1), -1))
    new_off = torch.where(continues, p.off + 1, starts.long())
    done = (new_cur >= 0) & (new_off == lengths[rows, new_cur.clamp(min=0)])
    met = p.met | (F.one_hot(new_cur.clamp(min=0), M).bool() & done[:, None])
    return ConstraintProgress(met, new_cur.masked_fill(done, -1), new_off.masked_fill(done, 0))


def bank_allocation(score: Tensor, banks: Tensor, K: int, n_banks: int) -> Tensor:
    """Dynamic beam allocation: the K candidates of each sentence that get a beam slot.

    score (N, Q) candidates' cumulative log p, banks (N, Q) their banks (< n_banks) ->
    (N, K) candidate indices.  The K slots go round robin over the banks, from the one
    with most constraint tokens met down, each bank's candidates best first: candidate i
    gets a slot when its key

        key(i) = rank(i) * n_banks + (n_banks - 1 - bank(i)),
        rank(i) = #{candidates of bank(i) scoring better than i (ties: the earlier one)}

    is among the K smallest.  Every bank with candidates thus gets an equal share of the
    K slots (Post and Vilar's allocation), a bank with fewer candidates than its share
    leaves the rest to the others, and the remainder goes to the banks further along the
    constraints.  -inf candidates come after every finite one.  With one bank (no
    constraints) these are the K best candidates.
    """
    N, Q = score.shape
    order = score.argsort(dim=1, descending=True, stable=True)  # (N, Q) best first
    bank_sorted = banks.gather(1, order)
    one_hot = F.one_hot(bank_sorted, n_banks)  # (N, Q, n_banks)
    rank = ((one_hot.cumsum(1) - 1) * one_hot).sum(-1)  # (N, Q): rank within its bank
    key = rank * n_banks + (n_banks - 1 - bank_sorted)
    last = Q * n_banks + torch.arange(Q, device=score.device)  # past every finite candidate's key
    key = torch.where(torch.isfinite(score.gather(1, order)), key, last)
    slots = key.topk(K, dim=1, largest=False).indices  # (N, K) positions in ``order``
    return order.gather(1, slots)


def rank_finished(score: Tensor, complete: Tensor, K: int) -> Tensor:
    """The K best finished hypotheses (N, Q) -> (N, K) indices: those that meet every
    constraint first, each group by normalized score, best first."""
    complete = complete & torch.isfinite(score)
    order = score.argsort(dim=1, descending=True, stable=True)
    order = order.gather(1, complete.gather(1, order).int().argsort(dim=1, descending=True, stable=True))
    return order[:, :K]


def repeated_entries(x: Tensor) -> Tensor:
    """(N, Q) -> bool (N, Q): true where the entry equals an earlier one of its row."""
    sorted_x, order = x.sort(dim=1, stable=True)
    repeat = torch.zeros_like(x, dtype=torch.bool)
    repeat[:, 1:] = sorted_x[:, 1:] == sorted_x[:, :-1]
    return torch.zeros_like(repeat).scatter(1, order, repeat)


@torch.no_grad()
def constrained_beam_search(decoder: StepDecoder, max_len: Tensor, s: DecodeConfig, ids: SpecialIds,
                            constraints: Tensor, prefix: Optional[Tensor] = None) -> list[list[Hypothesis]]:
    """Beam search of width K = s.beam (1 included) in which sentence n's output contains
    each of its constraints ``constraints[n]`` (M, L), token ids -1 padded, by dynamic beam
    allocation (see the module docstring); returns the s.nbest best per sentence, best first.

    Scores are those of :func:`s2s.search.beam_search`: log p / lp(m), plus cp with a
    coverage penalty; ``prefix`` (B, P) forces each sentence's first tokens (-1 padded).
    """
    K, device = s.beam, max_len.device
    B = max_len.size(0)
    L = int(max_len.max())
    cons = constraints.to(device)  # (B, M, Lc)
    M = cons.size(1)
    lengths = (cons >= 0).sum(-1)  # (B, M): |c_j|
    C = lengths.sum(-1)  # (B,): constraint tokens of each sentence
    n_banks = int(C.max()) + 1
    greedy = K == 1 and not s.coverage_penalty
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)  # original sentence of each active sentence
    # the finished ones' scores: complete ones first, best first
    scores, tokens, fin_scores, fin_logp, fin_len, fin_tokens = start_beams(decoder, B, K, L, device)
    progress = ConstraintProgress.start(B * K, M, device)
    fin_complete = torch.zeros((B, K), dtype=torch.bool, device=device)  # every constraint met
    y = torch.full((B * K, 1), ids.bos_id, dtype=torch.long, device=device)
    beta = s.coverage_penalty
    attn_sum: Optional[Tensor] = None  # (N*K, S) attention received so far, per row

    for t in range(L):
        N = active.size(0)
        sent_max = max_len[active]  # (N,)
        row_sent = active.repeat_interleave(K)  # (N*K,) each row's sentence
        row_max = sent_max.repeat_interleave(K)
        row_cons, row_len = cons[row_sent], lengths[row_sent]  # (N*K, M, Lc), (N*K, M)
        m = t + 1  # length of a hypothesis ending at this step, </s> included

        # 1. the search rules; </s> waits for every constraint, except at the last step
        logp = constrain(decoder.step(y), t, row_max, s, ids, tokens,
                         forced_tokens(prefix, t, row_sent))  # (N*K, V)
        waiting = (bank(progress, row_len) < C[row_sent]) & (row_max > m)
        logp[:, ids.eos_id] = logp[:, ids.eos_id].masked_fill(waiting, NEG_INF)
        if beta:
            a = decoder.attention()  # (N*K, S): this step's attention of each row
            attn_sum = a if attn_sum is None else attn_sum + a
            cp_row = coverage_penalty(attn_sum, decoder.source_mask(), beta)  # (N*K,)
        V = logp.size(-1)
        total = scores.view(N * K, 1) + logp  # (N*K, V) cumulative log p of every extension
        flat = total.view(N, K * V)  # candidate index k*V + v

        # 2. candidates: the 2K best, each beam's 2 best, each beam's next constraint tokens
        beam_start = (torch.arange(K, device=device) * V).view(1, K, 1)
        best = largest_k(flat, min(2 * K, K * V))[1]  # (N, 2K)
        beam_best = total.topk(min(2, V), dim=-1).indices.view(N, K, -1) + beam_start  # (N, K, 2)
        wanted = next_constraint_tokens(progress, row_cons).view(N, K, M)
        wanted = torch.where(wanted >= 0, wanted + beam_start, -1)  # (N, K, M)
        idx = torch.cat([best, beam_best.flatten(1), wanted.flatten(1)], dim=1)  # (N, Q), -1: none
        cand_scores = flat.gather(1, idx.clamp(min=0)).masked_fill((idx < 0) | repeated_entries(idx), NEG_INF)
        cand_beam = torch.div(idx.clamp(min=0), V, rounding_mode="floor")  # (N, Q)
        cand_tok = idx.clamp(min=0) % V
        cand_row = cand_beam + (torch.arange(N, device=device) * K)[:, None]  # rows in N*K
        Q = idx.size(1)

        # 3. each candidate's progress and bank
        parent = cand_row.flatten()  # (N*Q,)
        cand_progress = advance(progress.select(parent), row_cons[parent], row_len[parent], cand_tok.flatten())
        cand_bank = bank(cand_progress, row_len[parent]).view(N, Q)
        is_eos = (cand_tok == ids.eos_id) & torch.isfinite(cand_scores)

        # 4a. finish: the </s> candidates the allocation gives a slot
        if bool(is_eos.any()):
            slot = bank_allocation(cand_scores, cand_bank, K, n_banks)  # (N, K)
            ends = is_eos.gather(1, slot)
            end_scores = cand_scores.gather(1, slot)
            norm = end_scores / length_penalty(float(m), s.alpha, s.length_penalty)
            if beta:
                norm = norm + cp_row[cand_row.gather(1, slot)]
            new_tokens = torch.zeros((N, K, L), dtype=torch.long, device=device)
            new_tokens[:, :, :t] = tokens[cand_row.gather(1, slot).flatten()].view(N, K, t)
            all_scores = torch.cat([fin_scores, torch.where(ends, norm, NEG_INF)], dim=1)  # (N, 2K)
            all_complete = torch.cat([fin_complete, cand_bank.gather(1, slot) == C[active][:, None]], dim=1)
            pick = rank_finished(all_scores, all_complete, K)
            fin_scores, fin_complete = all_scores.gather(1, pick), all_complete.gather(1, pick)
            fin_logp = torch.cat([fin_logp, end_scores], 1).gather(1, pick)
            fin_len = torch.cat([fin_len, torch.full_like(fin_len, m)], 1).gather(1, pick)
            fin_tokens = torch.cat([fin_tokens, new_tokens], 1).gather(1, pick[:, :, None].expand(N, K, L))

        # 4b. continue: the allocation over the candidates that did not end, best first
        live = cand_scores.masked_fill(cand_tok == ids.eos_id, NEG_INF)
        pick = bank_allocation(live, cand_bank, K, n_banks)  # (N, K)
        pick = pick.gather(1, live.gather(1, pick).argsort(dim=1, descending=True, stable=True))
        scores = live.gather(1, pick)
        chosen = (pick + (torch.arange(N, device=device) * Q)[:, None]).flatten()  # (N*K,) in N*Q
        rows = parent[chosen]  # surviving beams' rows
        y_t = cand_tok.flatten()[chosen]
        tokens = torch.cat([tokens[rows], y_t[:, None]], dim=1)  # (N*K, t+1)
        progress = cand_progress.select(chosen)
        decoder.select(rows)
        if beta:
            attn_sum = attn_sum[rows]

        # 5. stop a sentence when no live beam can beat its n-best finished ones
        if greedy:
            done = torch.isfinite(fin_scores[:, 0]) | (sent_max <= m)
        else:
            bound = beam_stop_bound(scores[:, 0], m, sent_max, s)
            done = (fin_scores[:, s.nbest - 1] >= bound) | (sent_max <= m)
        if bool(done.any()):
            for n in done.nonzero().flatten().tolist():
                hyps = []
                complete_only = bool(fin_complete[n, 0])  # none that misses a constraint beside one that keeps all
                for k in range(s.nbest):
                    score = float(fin_scores[n, k])
                    if math.isfinite(score) and (bool(fin_complete[n, k]) or not complete_only):
                        length, logp_y = int(fin_len[n, k]), float(fin_logp[n, k])
                        if greedy:  # greedy search's arithmetic: log p / lp(m) in double precision
                            score = logp_y / length_penalty(float(length), s.alpha, s.length_penalty)
                        hyps.append(Hypothesis(fin_tokens[n, k, :length - 1].tolist(), score, logp_y))
                results[int(active[n])] = hyps
            keep, keep_rows = still_searching(decoder, done, K)
            if keep.numel() == 0:
                break
            active, scores = active[keep], scores[keep]
            fin_scores, fin_logp, fin_len = fin_scores[keep], fin_logp[keep], fin_len[keep]
            fin_tokens, fin_complete = fin_tokens[keep], fin_complete[keep]
            tokens, y_t = tokens[keep_rows], y_t[keep_rows]
            progress = progress.select(keep_rows)
            if beta:
                attn_sum = attn_sum[keep_rows]
        y = y_t[:, None]
    return results
