"""Search tested against a scripted decoder that replays fixed probabilities."""

import math

import pytest
import torch

from s2s.config import DecodeConfig, ModelConfig
from s2s.model import Seq2SeqTransformer
from s2s.search import (
    ModelDecoder,
    SpecialIds,
    beam_search,
    best_tokens,
    greedy_search,
    largest_k,
    length_penalty,
    row_bucket,
    rows_leaving,
    search,
)

PAD, UNK, BOS, EOS, A, B = 0, 1, 2, 3, 4, 5
V = 6


class ScriptedDecoder:
    """Next-token probabilities looked up by the prefix generated so far.

    Unscripted prefixes end the sentence (</s> with probability 1).
    """

    def __init__(self, script: dict, batch: int = 1):
        self.script = script
        self.prefixes = [() for _ in range(batch)]
        self.started = False
        self.steps = 0

    def step(self, y_prev):
        self.steps += 1
        if self.started:
            self.prefixes = [p + (int(y),) for p, y in zip(self.prefixes, y_prev[:, 0])]
        self.started = True
        out = torch.full((len(self.prefixes), V), float("-inf"))
        for row, prefix in enumerate(self.prefixes):
            for tok, p in self.script.get(prefix, {EOS: 1.0}).items():
                out[row, tok] = math.log(p)
        return out

    def select(self, index, group=None):
        self.prefixes = [self.prefixes[i] for i in index.tolist()]


SCRIPT = {
    (): {A: 0.6, B: 0.4},
    (A,): {EOS: 0.1, A: 0.4, B: 0.5},
    (B,): {EOS: 0.85, A: 0.1, B: 0.05},
}


IDS = SpecialIds(bos_id=BOS, eos_id=EOS, pad_id=PAD)


def settings(**kw) -> DecodeConfig:
    base = dict(beam=2, nbest=2, alpha=0.0, length_penalty="gnmt")
    base.update(kw)
    return DecodeConfig(**base)


def test_length_penalty_formula():
    # lp(m) = ((5+m)/6)^alpha, docs/model.md (31) (Sockeye checks 7**0.2 / 6**0.2 the same way)
    assert length_penalty(2, 0.2) == pytest.approx(7 ** 0.2 / 6 ** 0.2)
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(10, 1.0) == pytest.approx(15 / 6)
    assert length_penalty(3, 0.0) == 1.0
    assert length_penalty(4, 0.5, "power") == pytest.approx(2.0)
    assert length_penalty(7, 0.9, "none") == 1.0
    m = torch.tensor([1.0, 2.0])
    assert torch.allclose(length_penalty(m, 1.0), (5 + m) / 6)


def test_beam_exact_hypotheses_without_length_penalty():
    hyps = beam_search(ScriptedDecoder(SCRIPT), torch.tensor([10]), settings(), IDS)[0]
    # "b </s>" = 0.4 * 0.85 = 0.34 beats "a b </s>" = 0.6 * 0.5 * 1.0 = 0.30
    assert [h.tokens for h in hyps] == [[B], [A, B]]
    assert hyps[0].log_prob == pytest.approx(math.log(0.34), abs=1e-6)
    assert hyps[1].log_prob == pytest.approx(math.log(0.30), abs=1e-6)
    assert hyps[0].score == pytest.approx(math.log(0.34), abs=1e-6)


def test_beam_length_penalty_changes_the_winner():
    alpha = 2.0
    hyps = beam_search(ScriptedDecoder(SCRIPT), torch.tensor([10]), settings(alpha=alpha), IDS)[0]
    # score(y) = log P(y) / lp(m), m counts </s>: "a b </s>" has m = 3, "b </s>" has m = 2
    s_ab = math.log(0.30) / ((5 + 3) / 6) ** alpha
    s_b = math.log(0.34) / ((5 + 2) / 6) ** alpha
    assert s_ab > s_b
    assert [h.tokens for h in hyps] == [[A, B], [B]]
    assert hyps[0].score == pytest.approx(s_ab, abs=1e-6)
    assert hyps[1].score == pytest.approx(s_b, abs=1e-6)


def test_stop_rules_exact_and_early():
    """</s> first (0.7) beats the live "a" (0.3) at the next length, so early stops at once;
    a long, near-certain "a a a" still wins under lp(m) = m, which only exact finds."""
    script = {(): {EOS: 0.7, A: 0.3}, (A,): {A: 0.99, EOS: 0.01}, (A, A): {A: 0.99, EOS: 0.01}}
    s = dict(beam=2, nbest=1, alpha=1.0, length_penalty="power")
    exact_dec, early_dec = ScriptedDecoder(script), ScriptedDecoder(script)
    exact = beam_search(exact_dec, torch.tensor([8]), settings(**s, stop="exact"), IDS)[0][0]
    early = beam_search(early_dec, torch.tensor([8]), settings(**s, stop="early"), IDS)[0][0]
    assert exact.tokens == [A, A, A]
    assert exact.score == pytest.approx((math.log(0.3) + 2 * math.log(0.99)) / 4, abs=1e-6)
    assert early.tokens == [] and early.score == pytest.approx(math.log(0.7), abs=1e-6)
    assert early_dec.steps == 1 < exact_dec.steps


def test_nbest_sorted_by_score():
    script = {(): {A: 0.5, B: 0.3, UNK: 0.2}, (A,): {EOS: 0.5, B: 0.5}, (B,): {EOS: 0.9, A: 0.1},
              (UNK,): {EOS: 1.0}}
    hyps = beam_search(ScriptedDecoder(script), torch.tensor([6]), settings(beam=3, nbest=3, alpha=0.6), IDS)[0]
    scores = [h.score for h in hyps]
    assert len(hyps) == 3 and scores == sorted(scores, reverse=True)


def test_greedy_follows_argmax():
    hyps = greedy_search(ScriptedDecoder(SCRIPT), torch.tensor([10]), settings(beam=1, nbest=1), IDS)[0]
    assert hyps[0].tokens == [A, B]
    assert hyps[0].log_prob == pytest.approx(math.log(0.3), abs=1e-6)


def test_max_len_forces_eos():
    never_ends = {}
    for n in range(12):
        for prefix in [(A,) * n]:
            never_ends[prefix] = {A: 0.99, EOS: 0.01}
    for fn, s in ((beam_search, settings()), (greedy_search, settings(beam=1, nbest=1))):
        hyps = fn(ScriptedDecoder(never_ends), torch.tensor([5]), s, IDS)[0]
        assert len(hyps[0].tokens) <= 4  # m <= max_len = 5, </s> included
        assert hyps[0].tokens == [A] * 4 or fn is beam_search


def test_min_len_blocks_eos():
    script = {(): {EOS: 0.9, A: 0.1}, (A,): {EOS: 0.9, A: 0.1}, (A, A): {EOS: 0.9, A: 0.1}}
    hyps = greedy_search(ScriptedDecoder(script), torch.tensor([10]), settings(beam=1, nbest=1, min_len=2), IDS)[0]
    assert hyps[0].tokens == [A, A]
    hyps = beam_search(ScriptedDecoder(script), torch.tensor([10]), settings(min_len=2), IDS)[0]
    assert len(hyps[0].tokens) >= 2


def test_beam_batch_equals_one_by_one():
    """Sentences leave the batch at different steps; results must not depend on batching."""
    scripts = [SCRIPT, {(): {EOS: 1.0}}, {(): {A: 1.0}, (A,): {A: 0.7, EOS: 0.3}}]

    class Multi(ScriptedDecoder):
        def __init__(self):
            super().__init__({}, batch=3)
            self.which = [0, 1, 2]

        def step(self, y_prev):
            if self.started:
                self.prefixes = [p + (int(y),) for p, y in zip(self.prefixes, y_prev[:, 0])]
            self.started = True
            out = torch.full((len(self.prefixes), V), float("-inf"))
            for row, (w, prefix) in enumerate(zip(self.which, self.prefixes)):
                for tok, p in scripts[w].get(prefix, {EOS: 1.0}).items():
                    out[row, tok] = math.log(p)
            return out

        def select(self, index, group=None):
            super().select(index)
            self.which = [self.which[i] for i in index.tolist()]

    together = beam_search(Multi(), torch.tensor([8, 8, 8]), settings(alpha=0.6), IDS)
    for i, script in enumerate(scripts):
        alone = beam_search(ScriptedDecoder(script), torch.tensor([8]), settings(alpha=0.6), IDS)[0]
        assert [(h.tokens, round(h.score, 6)) for h in together[i]] == \
               [(h.tokens, round(h.score, 6)) for h in alone]


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=2, dec_layers=2, d_ff=64, dropout=0.0)
    return Seq2SeqTransformer(cfg, 40, 40).double().eval()


def test_beam_one_equals_greedy_on_a_model(device):
    model = _tiny_model().to(device)
    src = torch.randint(4, 40, (5, 9))
    src[1, 6:] = PAD
    src[:, -1] = EOS
    src = src.to(device)
    max_len = torch.full((5,), 12, device=device)
    s = settings(beam=1, nbest=1, alpha=0.0)
    with torch.no_grad():
        greedy = greedy_search(ModelDecoder(model, src), max_len, s, IDS)
        beam = beam_search(ModelDecoder(model, src), max_len, s, IDS)
    for g, b in zip(greedy, beam):
        assert g[0].tokens == b[0].tokens
        assert g[0].score == pytest.approx(b[0].score, abs=1e-5)


def test_greedy_without_normalizing_takes_the_same_tokens(device):
    """ModelDecoder(normalized=False) steps return the scores z, not log p = z - log sum exp z:
    greedy search takes the same token at every step (with min_len, no_repeat_ngram, a forced
    prefix and max_len's forced </s>) and leaves the hypotheses' scores NaN; a beam search,
    which compares log p across rows, refuses such a decoder."""
    model = _tiny_model(2).to(device)
    src = torch.randint(4, 40, (6, 9))
    src[2, 5:] = PAD
    src[:, -1] = EOS
    src = src.to(device)
    max_len = torch.tensor([3, 12, 12, 5, 12, 12], device=device)
    prefix = torch.tensor([[7, 8], [9, -1], [-1, -1], [7, -1], [-1, -1], [11, 12]], device=device)
    cases = [(settings(beam=1, nbest=1), None), (settings(beam=1, nbest=1, min_len=3, no_repeat_ngram=2), None),
             (settings(beam=1, nbest=1), prefix)]
    for s, forced in cases:
        with torch.no_grad():
            want = greedy_search(ModelDecoder(model, src), max_len, s, IDS, forced)
            got = greedy_search(ModelDecoder(model, src, normalized=False), max_len, s, IDS, forced)
        assert [h[0].tokens for h in got] == [h[0].tokens for h in want]
        assert all(math.isnan(h[0].score) and math.isnan(h[0].log_prob) for h in got)
        assert not any(math.isnan(h[0].log_prob) for h in want)
    assert len(got[0][0].tokens) <= 2 and got[0][0].tokens[:2] == [7, 8][:len(got[0][0].tokens)]
    with pytest.raises(ValueError, match="normalize"):
        search(ModelDecoder(model, src, normalized=False), max_len, settings(beam=2, nbest=1), IDS)
    with pytest.raises(ValueError, match="normalize"):
        search(ModelDecoder(model, src, normalized=False), max_len, settings(beam=1, nbest=1, sampling=True), IDS)


def test_search_on_model_batch_invariance(device):
    model = _tiny_model(1).to(device)
    src = torch.randint(4, 40, (4, 7))
    src[:, -1] = EOS
    src = src.to(device)
    max_len = torch.full((4,), 10, device=device)
    s = settings(beam=3, nbest=1, alpha=0.6)
    with torch.no_grad():
        batch = search(ModelDecoder(model, src), max_len, s, IDS)
        for i in range(4):
            alone = search(ModelDecoder(model, src[i:i + 1]), max_len[:1], s, IDS)
            assert alone[0][0].tokens == batch[i][0].tokens
            assert alone[0][0].score == pytest.approx(batch[i][0].score, abs=1e-5)


def test_row_buckets():
    """A search steps a few row counts: multiples of 8, or 1, 2, 4, 8 below (oneDNN builds a kernel
    per new row count); rows_leaving lets ended rows step on until a bucket's worth can go, and
    keeps the first ended rows (which do not move) to fill the bucket."""
    sizes = (1, 2, 3, 4, 5, 8, 9, 16, 17, 57, 64, 65)
    assert [row_bucket(n) for n in sizes] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 64, 64, 72]
    ended = torch.tensor([False, True, False, True, True, False, False, False, False, False])  # 7 live of 10
    assert rows_leaving(ended, 7).tolist() == [False] * 3 + [True, True] + [False] * 5  # row 1 fills the 8
    assert rows_leaving(torch.tensor([True] * 3 + [False] * 5), 5) is None  # 8 rows: already a bucket
    ended = torch.tensor([True] * 6 + [False] * 4 + [True] * 2)  # 12 rows, 4 live: a bucket of 4
    assert rows_leaving(ended, 4).tolist() == [True] * 6 + [False] * 4 + [True] * 2
    ended = torch.tensor([True] * 3 + [False] * 5 + [True] * 4)  # 12 rows, 5 live: a bucket of 8
    assert rows_leaving(ended, 5).tolist() == [False] * 8 + [True] * 4
    assert rows_leaving(torch.tensor([False, True]), 1).tolist() == [False, True]


@pytest.mark.parametrize("beam", [1, 4])
def test_search_steps_bucketed_rows_and_keeps_each_sentences_output(beam):
    """Sentences that end step on (their outputs unread) until a bucket's worth of rows can
    leave: every step runs the batch's rows or row_bucket(n) x beam of them, and each sentence's
    output is the one it gets decoded alone."""
    model = _tiny_model(3)
    torch.manual_seed(3)
    n = 21
    src = torch.randint(4, 40, (n, 8))
    src[:, -1] = EOS
    max_len = torch.randint(2, 14, (n,))  # sentences end at many different steps
    s = settings(beam=beam, nbest=1, alpha=0.6)
    rows = []

    class Recording(ModelDecoder):
        def step(self, y_prev):
            rows.append(y_prev.size(0))
            return super().step(y_prev)

    with torch.no_grad():
        batch = search(Recording(model, src), max_len, s, IDS)
        alone = [search(ModelDecoder(model, src[i:i + 1]), max_len[i:i + 1], s, IDS)[0] for i in range(n)]
    assert [h[0].tokens for h in batch] == [h[0].tokens for h in alone]
    assert [h[0].score for h in batch] == pytest.approx([h[0].score for h in alone], abs=1e-6)
    assert rows[0] == n * beam and len(set(rows)) > 2
    assert all(r == n * beam or (r % beam == 0 and row_bucket(r // beam) == r // beam) for r in rows), rows


def test_sampling_draws_for_live_rows_only(monkeypatch):
    """Sampling keeps no ended row (a row would draw, moving the seed's draws, and could draw
    from nothing): each step draws for the samples whose </s> is still to come, even where a
    tiny vocabulary and no_repeat_ngram=1 leave an ended row no token to take."""
    torch.manual_seed(0)
    model = Seq2SeqTransformer(ModelConfig(d_model=32, heads=4, enc_layers=1, dec_layers=1, d_ff=64, dropout=0.0),
                               8, 8).double().eval()
    src = torch.randint(4, 8, (4, 5))
    src[:, -1] = EOS
    prefix = torch.full((4, 10), 4)
    prefix[1] = -1  # rows 0, 2 and 3 forced on for 10 steps; row 1 free to end early
    drawn, multinomial = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda q, *a, **kw: drawn.append(q.size(0)) or multinomial(q, *a, **kw))
    for s, forced in ((settings(beam=1, nbest=1, no_repeat_ngram=1, sampling=True, seed=1), prefix),
                      (settings(beam=1, nbest=3, sampling=True, seed=2), None)):
        drawn.clear()
        with torch.no_grad():
            found = search(ModelDecoder(model, src), torch.full((4,), 20), s, IDS, forced)
        lengths = [len(h.tokens) + 1 for hyps in found for h in hyps]  # m: the steps each sample took
        assert len(lengths) == 4 * s.nbest
        assert drawn == [sum(m > t for m in lengths) for t in range(len(drawn))]


@pytest.mark.parametrize("seed", range(5))
def test_wide_beam_finds_the_exhaustive_optimum(seed):
    """With a beam as wide as the hypothesis space, beam search is exact."""
    import itertools

    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=32, dropout=0.0)
    model = Seq2SeqTransformer(cfg, 6, 6).double().eval()
    src = torch.tensor([[4, 5, 4, EOS]])
    L, alpha = 4, 0.8
    best = None
    with torch.no_grad():
        enc = model.encode(src)
        for n in range(L):
            for body in itertools.product([UNK, A, B], repeat=n):
                y = [BOS, *body]
                logits, _ = model.decode(torch.tensor([y]), enc)
                logp = torch.log_softmax(logits[0].float(), -1)
                logp[:, [PAD, BOS]] = float("-inf")
                lp_sum = sum(float(logp[t, tok]) for t, tok in enumerate([*body, EOS]))
                score = lp_sum / length_penalty(n + 1, alpha)
                if best is None or score > best[0]:
                    best = (score, list(body))
        hyps = beam_search(ModelDecoder(model, src), torch.tensor([L]),
                           settings(beam=27, nbest=1, alpha=alpha), IDS)[0]
    assert hyps[0].tokens == best[1]
    assert hyps[0].score == pytest.approx(best[0], abs=1e-5)


# --------------------------------------------------------------------------- #
# no-repeat n-gram and sampling
# --------------------------------------------------------------------------- #

def test_block_repeated_ngrams_by_hand():
    from s2s.search import block_repeated_ngrams

    logp = torch.zeros(2, 8)
    tokens = torch.tensor([[4, 5, 4, 6, 4], [7, 7, 7, 7, 7]])
    out = block_repeated_ngrams(logp.clone(), tokens, 2)
    # row 0 ends in 4; 4 was followed by 5 and by 6: both banned, nothing else
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [5, 6]
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [7]
    out = block_repeated_ngrams(logp.clone(), tokens, 3)  # (6, 4) occurred once, followed by nothing yet
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == []
    out = block_repeated_ngrams(logp.clone(), torch.tensor([[4, 5, 6, 4, 5]]), 3)
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [6]
    out = block_repeated_ngrams(logp.clone(), tokens, 1)  # unigrams: every used token
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [4, 5, 6]


@pytest.mark.parametrize("n, beam", [(2, 1), (2, 4), (3, 4)])
def test_no_repeat_ngram_holds_on_a_random_model(n, beam):
    """A random model repeats itself freely; with no_repeat_ngram = n no n-gram occurs twice."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, heads=2, enc_layers=1, dec_layers=1, d_ff=64, dropout=0.0)
    model = Seq2SeqTransformer(cfg, 12, 12, PAD).eval()
    src = torch.randint(4, 12, (6, 7))
    hyps = search(ModelDecoder(model, src), torch.full((6,), 25), settings(beam=beam, nbest=1,
                                                                           no_repeat_ngram=n), IDS)
    for h in hyps:
        toks = h[0].tokens
        grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
        assert len(grams) == len(set(grams)), toks
    plain = search(ModelDecoder(model, src), torch.full((6,), 25), settings(beam=beam, nbest=1), IDS)
    assert any(len({tuple(h[0].tokens[i:i + n]) for i in range(len(h[0].tokens) - n + 1)})
               < len(h[0].tokens) - n + 1 for h in plain), "the random model should repeat without the rule"


def test_sampling_distribution_filters():
    from s2s.search import sampling_distribution

    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert torch.allclose(sampling_distribution(logp, 1.0, 0, 1.0).exp(), logp.exp())
    top2 = sampling_distribution(logp, 1.0, 2, 1.0).exp()
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # nucleus: the smallest most-probable set with mass >= p
    assert torch.allclose(sampling_distribution(logp, 1.0, 0, 0.45).exp(), torch.tensor([[1.0, 0, 0, 0]]))
    assert torch.allclose(sampling_distribution(logp, 1.0, 0, 0.75).exp(), top2)
    three = sampling_distribution(logp, 1.0, 0, 0.85).exp()
    assert three[0, 3] == 0 and torch.allclose(three[0, :3].sum(), torch.tensor(1.0))
    hot = sampling_distribution(logp, 2.0, 0, 1.0).exp()  # q ∝ p^(1/2)
    expected = logp.exp().sqrt() / logp.exp().sqrt().sum()
    assert torch.allclose(hot, expected)


def test_sampling_draws_from_p_and_is_seeded():
    script = {(): {A: 0.7, B: 0.3}}
    n = 4000
    s = settings(beam=1, nbest=1, sampling=True, seed=3)
    hyps = greedy_search(ScriptedDecoder(script, batch=n), torch.full((n,), 5), s, IDS)
    share_a = sum(h[0].tokens == [A] for h in hyps) / n
    assert abs(share_a - 0.7) < 0.03  # 4 sigma of a binomial(4000, 0.7)
    assert hyps[0][0].log_prob == pytest.approx(math.log(0.7 if hyps[0][0].tokens == [A] else 0.3))
    again = greedy_search(ScriptedDecoder(script, batch=n), torch.full((n,), 5), s, IDS)
    assert [h[0].tokens for h in again] == [h[0].tokens for h in hyps]
    other = greedy_search(ScriptedDecoder(script, batch=n), torch.full((n,), 5), settings(
        beam=1, nbest=1, sampling=True, seed=4), IDS)
    assert [h[0].tokens for h in other] != [h[0].tokens for h in hyps]
    top1 = greedy_search(ScriptedDecoder(SCRIPT, batch=1), torch.full((1,), 5),
                         settings(beam=1, nbest=1, sampling=True, top_k=1), IDS)
    assert top1[0][0].tokens == greedy_search(ScriptedDecoder(SCRIPT), torch.full((1,), 5),
                                              settings(beam=1, nbest=1), IDS)[0][0].tokens


# --------------------------------------------------------------------------- #
# coverage penalty, forced prefixes, ensembles
# --------------------------------------------------------------------------- #

def _random_model(seed=0, vocab=12):
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, heads=2, enc_layers=1, dec_layers=2, d_ff=64, dropout=0.0)
    return Seq2SeqTransformer(cfg, vocab, vocab, PAD).eval()


def test_coverage_penalty_formula():
    from s2s.search import coverage_penalty

    attn = torch.tensor([[0.5, 1.5, 0.0, 0.7]])
    mask = torch.tensor([[True, True, True, False]])
    expected = 0.4 * (math.log(0.5) + math.log(1.0) + math.log(1e-9))
    assert float(coverage_penalty(attn, mask, 0.4)) == pytest.approx(expected)


def test_beam_scores_include_the_coverage_penalty():
    """Each finished hypothesis scores log p / lp(m) + beta sum_j log min(sum_t A_tj, 1), with A
    the last layer's head-mean cross-attention of that very hypothesis (teacher-forced)."""
    from s2s.translate import cross_attention

    model = _random_model()
    src = torch.tensor([[5, 6, 7, 8, EOS], [9, 10, EOS, PAD, PAD]])
    s = settings(beam=3, nbest=3, alpha=0.6, coverage_penalty=0.5)
    hyps = beam_search(ModelDecoder(model, src, track_attention=True), torch.tensor([6, 6]), s, IDS)
    for b, sent in enumerate(hyps):
        for h in sent:
            tgt = torch.tensor([h.tokens + [EOS]])
            A = cross_attention(model, src[b:b + 1], tgt, -1)[0]  # (m, S)
            real = src[b] != PAD
            cp = 0.5 * A.sum(0)[real].clamp(1e-9, 1.0).log().sum()
            lp = length_penalty(len(h.tokens) + 1, 0.6)
            assert h.score == pytest.approx(h.log_prob / lp + float(cp), abs=1e-4)


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_prefix_starts_every_hypothesis(beam):
    model = _random_model(1)
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    prefix = torch.tensor([[10, 11, 4], [7, -1, -1]])
    s = settings(beam=beam, nbest=beam, alpha=0.0)
    hyps = search(ModelDecoder(model, src), torch.tensor([8, 8]), s, IDS, prefix)
    for sent, want in zip(hyps, ([10, 11, 4], [7])):
        assert sent
        for h in sent:
            assert h.tokens[:len(want)] == want
            # the forced tokens are scored by the model like any other
            tgt = torch.tensor([[2] + h.tokens])
            with torch.no_grad():
                logp = torch.log_softmax(model(src[:1] if want[0] == 10 else src[1:], tgt), -1)[0]
            total = sum(float(logp[t, y]) for t, y in enumerate(h.tokens + [EOS]))
            assert h.log_prob == pytest.approx(total, abs=1e-4)


def test_ensemble_averages_probabilities():
    from s2s.search import EnsembleDecoder

    a, b = _random_model(2), _random_model(3)
    src = torch.tensor([[5, 6, 7, EOS]])
    y = torch.full((1, 1), BOS)
    ens = EnsembleDecoder([ModelDecoder(a, src), ModelDecoder(b, src)])
    got = ens.step(y)
    pa = ModelDecoder(a, src).step(y).exp()
    pb = ModelDecoder(b, src).step(y).exp()
    torch.testing.assert_close(got, ((pa + pb) / 2).log())
    same = EnsembleDecoder([ModelDecoder(a, src), ModelDecoder(a, src)])
    s = settings(beam=2, nbest=1)
    assert (beam_search(same, torch.tensor([6]), s, IDS)[0][0].tokens
            == beam_search(ModelDecoder(a, src), torch.tensor([6]), s, IDS)[0][0].tokens)


def test_coverage_penalty_applies_at_beam_one():
    """--beam 1 with a coverage penalty is a 1-beam search: the hypothesis scores
    log p / lp(m) + cp, not greedy's log p / lp(m) (which ignored the penalty)."""
    from s2s.translate import cross_attention

    model = _random_model(4)
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, EOS], [9, 10, 11, 5, 6, 7, EOS, PAD, PAD, PAD, PAD]])
    s = settings(beam=1, nbest=1, alpha=0.6, coverage_penalty=0.7)
    hyps = search(ModelDecoder(model, src, track_attention=True), torch.tensor([4, 4]), s, IDS)
    for b, sent in enumerate(hyps):
        (h,) = sent
        A = cross_attention(model, src[b:b + 1], torch.tensor([h.tokens + [EOS]]), -1)[0]
        cp = 0.7 * A.sum(0)[src[b] != PAD].clamp(1e-9, 1.0).log().sum()
        assert float(cp) < -1e-3  # the penalty is not zero here: the check can tell
        lp = length_penalty(len(h.tokens) + 1, 0.6)
        assert h.score == pytest.approx(h.log_prob / lp + float(cp), abs=1e-4)
    # the same as a beam search of width 1 called directly
    direct = beam_search(ModelDecoder(model, src, track_attention=True), torch.tensor([4, 4]), s, IDS)
    assert [[h.tokens for h in x] for x in direct] == [[h.tokens for h in x] for x in hyps]


def test_coverage_penalty_changes_the_beam_one_output():
    """On a script where greedy stops early with the source half covered, the 1-beam search
    with a coverage penalty keeps the longer hypothesis that covers it all."""

    class Attending(ScriptedDecoder):  # step t attends to source position t (of 3)
        def step(self, y_prev):
            out = super().step(y_prev)
            self._t = len(self.prefixes[0])
            return out

        def attention(self):
            a = torch.zeros(len(self.prefixes), 3)
            a[:, min(self._t, 2)] = 1.0
            return a

        def source_mask(self):
            return torch.ones(len(self.prefixes), 3, dtype=torch.bool)

    script = {(): {A: 1.0}, (A,): {EOS: 0.6, B: 0.4}, (A, B): {EOS: 1.0}}
    greedy = search(Attending(script), torch.tensor([5]), settings(beam=1, nbest=1), IDS)
    assert greedy[0][0].tokens == [A]
    covered = search(Attending(script), torch.tensor([5]), settings(beam=1, nbest=1, coverage_penalty=0.1), IDS)
    assert covered[0][0].tokens == [A, B]


def test_sampling_draws_nbest_samples_per_sentence():
    """nbest with sampling: n independent draws per sentence, each scored by the model's
    log p, best first; the first sentence's samples do not depend on the batch."""
    script = {(): {A: 0.5, B: 0.5}, (A,): {A: 0.5, EOS: 0.5}, (B,): {B: 0.5, EOS: 0.5}}
    n, B_ = 8, 3
    s = settings(beam=1, nbest=n, sampling=True, seed=5)
    hyps = search(ScriptedDecoder(script, batch=B_), torch.full((B_,), 6), s, IDS)
    assert [len(h) for h in hyps] == [n] * B_
    for sent in hyps:
        assert [h.score for h in sent] == sorted((h.score for h in sent), reverse=True)
        for h in sent:
            y = h.tokens + [EOS]
            logp = sum(math.log(script.get(tuple(y[:t]), {EOS: 1.0})[y[t]]) for t in range(len(y)))
            assert h.log_prob == pytest.approx(logp)
        assert len({tuple(h.tokens) for h in sent}) > 1  # n draws, not one repeated
    assert [h.tokens for h in hyps[0]] != [h.tokens for h in hyps[1]]


def test_ensemble_weights_interpolate_probabilities():
    from s2s.search import EnsembleDecoder

    a, b = _random_model(2), _random_model(3)
    src = torch.tensor([[5, 6, 7, EOS]])
    y = torch.full((1, 1), BOS)
    ens = EnsembleDecoder([ModelDecoder(a, src, True), ModelDecoder(b, src, True)], [0.7, 0.3])
    got = ens.step(y)
    da, db = ModelDecoder(a, src, True), ModelDecoder(b, src, True)
    pa, pb = da.step(y).exp(), db.step(y).exp()
    torch.testing.assert_close(got, (0.7 * pa + 0.3 * pb).log())
    torch.testing.assert_close(ens.attention(), 0.7 * da.attention() + 0.3 * db.attention())
    scaled = EnsembleDecoder([ModelDecoder(a, src), ModelDecoder(b, src)], [7, 3])  # normalized
    torch.testing.assert_close(scaled.step(y), got)
    with pytest.raises(ValueError):
        EnsembleDecoder([ModelDecoder(a, src), ModelDecoder(b, src)], [1.0, 0.0])


def test_sampling_nbest_on_a_model_scores_each_sample_by_its_own_sentence():
    """nbest samples of a real model: samples finish at different steps (rows leave one at
    a time, not a sentence's K together), and each sample's log p is the model's log p of
    its tokens given its own source (teacher forcing)."""
    model = _tiny_model(2)
    src = torch.randint(4, 40, (3, 7))
    src[:, -1] = EOS
    s = settings(beam=1, nbest=4, sampling=True, seed=3, temperature=2.0)
    with torch.no_grad():
        hyps = search(ModelDecoder(model, src), torch.tensor([9, 4, 7]), s, IDS)
        assert [len(h) for h in hyps] == [4, 4, 4]
        assert len({len(h.tokens) for sent in hyps for h in sent}) > 1  # rows left at different steps
        for i, sent in enumerate(hyps):
            for h in sent:
                y = [BOS, *h.tokens, EOS]
                logits, _ = model.decode(torch.tensor([y[:-1]]), model.encode(src[i:i + 1]))
                logp = torch.log_softmax(logits[0].float(), -1)
                want = sum(float(logp[t, tok]) for t, tok in enumerate(y[1:]))
                assert h.log_prob == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("n", [20000, 20007, 4000, 1500, 200])
def test_largest_k_equals_topk(n):
    """The grouped bound picks exactly torch's topk, values and indices, best first:
    with and without a tail of n mod 16 entries, down to rows too short to group
    (among tied -inf entries either may pick any)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(37, n, generator=g)
    x[3, 5:] = float("-inf")  # a row with few finite entries (a sentence's dead beams)
    x[4, -3:] = 100.0 + torch.arange(3.0)  # the best entries all in the tail
    for k in (1, 2, 10):
        values, index = largest_k(x, k)
        want = x.topk(k, dim=-1)
        finite = torch.isfinite(want.values)
        assert torch.equal(values, want.values) and torch.equal(x.gather(1, index), values), k
        assert torch.equal(index[finite], want.indices[finite]), k
        assert index[3].unique().numel() == k  # no entry picked twice
    y = x[5:, 1:]  # not contiguous
    assert largest_k(y, 10)[1].equal(y.topk(10, dim=-1).indices)


def test_best_tokens_equals_max():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(64, 4000, generator=g), dim=-1)
    logp[7, 11] = logp[7, 12] = 1.0  # a tie: the first maximum, as torch's max
    best, y = best_tokens(logp)
    want = logp.max(dim=-1)
    assert torch.equal(best, want.values) and torch.equal(y, want.indices)
    assert int(y[7]) == 11


def test_model_decoder_step_is_log_softmax_of_the_models_scores():
    """A step's log-probs (normalized in place over the step's own scores) equal log_softmax of
    decode_step's scores, and the next step is unaffected by that."""
    model = _tiny_model(3).float()
    src = torch.randint(4, 40, (3, 6))
    src[:, -1] = EOS
    y = torch.full((3, 1), BOS)
    with torch.no_grad():
        ref = model.start_decoding(model.encode(src))
        dec = ModelDecoder(model, src)
        for _ in range(3):
            z = model.decode_step(y, ref)[0]
            want = torch.log_softmax(z.clone(), dim=-1)
            got = dec.step(y)
            assert torch.equal(got, want)
            y = got.argmax(-1, keepdim=True)
