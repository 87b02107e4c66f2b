"""Summarization: the pointer-generator copy, coverage, ROUGE, and `s2s summarize`."""

import json

import pytest
import torch

from s2s.config import DecodeConfig, ModelConfig
from s2s.model import Seq2SeqTransformer
from s2s.search import ModelDecoder, SpecialIds, beam_search
from s2s.trainer import coverage_loss

V, PAD, EOS = 20, 0, 3


def copy_model(coverage: bool = False, seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=1, dec_layers=2, d_ff=64, dropout=0.0,
                      copy=True, coverage=coverage)
    model = Seq2SeqTransformer(cfg, V, V, PAD).eval()
    if coverage:
        with torch.no_grad():
            model.decoder_layers[-1].w_cov.copy_(torch.tensor([2.0, -1.0, 0.5, -3.0]))
    return model


def batch():
    src = torch.tensor([[5, 6, 7, 5, EOS], [8, 9, EOS, PAD, PAD]])
    tgt_in = torch.tensor([[2, 5, 11, 7], [2, 9, 9, PAD]])
    return src, tgt_in


def test_pointer_generator_is_a_distribution():
    model = copy_model()
    src, tgt_in = batch()
    P = model(src, tgt_in).exp()  # (B, T, V)
    assert (P >= 0).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(2, 4))


def _copy_attention(model, src, tgt_in):
    _, weights = model.decode(tgt_in, model.encode(src), need_weights=True)
    return weights[-1].mean(1)  # (B, T, S): the last layer's cross-attention, mean over heads


@pytest.mark.parametrize("coverage", [False, True])
def test_p_gen_zero_is_the_attention_weighted_copy_distribution(coverage):
    model = copy_model(coverage)
    with torch.no_grad():  # p_gen = sigmoid(-1e4) = 0
        model.p_gen_proj.weight.zero_()
        model.p_gen_proj.bias.fill_(-1e4)
    src, tgt_in = batch()
    P = model(src, tgt_in).exp()
    a = _copy_attention(model, src, tgt_in)
    expected = torch.zeros(2, 4, V)
    for b in range(2):
        for t in range(4):
            for j in range(src.size(1)):
                expected[b, t, src[b, j]] += a[b, t, j]  # sum over j with x_j = w
    torch.testing.assert_close(P, expected)
    assert P[0, :, 6].gt(0).all() and P[0, :, 12].eq(0).all()  # only source tokens can be copied


def test_p_gen_one_is_the_vocabulary_distribution():
    model = copy_model()
    with torch.no_grad():
        model.p_gen_proj.weight.zero_()
        model.p_gen_proj.bias.fill_(1e4)
    src, tgt_in = batch()
    x = model._embed(tgt_in, model.tgt_embed, model.dec_positions, model.dec_embed_norm)
    cache = model.start_decoding(model.encode(src))
    h, _ = model._decoder_stack(x, model._self_mask(4, 4, 0, None), cache, need_weights=False, need_last=False)
    torch.testing.assert_close(model(src, tgt_in), torch.log_softmax(model.logits(h), -1))


def test_coverage_loss_by_hand():
    a = torch.tensor([[[0.7, 0.3, 0.0], [0.5, 0.4, 0.1], [0.2, 0.2, 0.6]]])  # (1, T=3, S=3)
    # c^1 = 0; c^2 = (0.7, 0.3, 0); c^3 = (1.2, 0.7, 0.1)
    # t=2: min(0.5,0.7)+min(0.4,0.3)+min(0.1,0) = 0.8;  t=3: 0.2+0.2+0.1 = 0.5
    assert float(coverage_loss(a, torch.ones(1, 3, dtype=torch.bool))) == pytest.approx(1.3)
    assert float(coverage_loss(a, torch.tensor([[True, True, False]]))) == pytest.approx(0.8)


def test_coverage_is_fed_to_the_attention():
    """c^t enters the last layer's scores: with w_cov != 0 the attention after the first step changes."""
    src, tgt_in = batch()
    with_cov = _copy_attention(copy_model(coverage=True), src, tgt_in)
    plain = copy_model(coverage=True)
    with torch.no_grad():
        plain.decoder_layers[-1].w_cov.zero_()
    without = _copy_attention(plain, src, tgt_in)
    torch.testing.assert_close(with_cov[:, 0], without[:, 0])  # c^1 = 0: the first step is equal
    assert not torch.allclose(with_cov[:, 1:], without[:, 1:])


@pytest.mark.parametrize("coverage", [False, True])
def test_incremental_decoding_matches_teacher_forcing(coverage):
    """decode_step with the cache (src, H_enc, coverage) gives the teacher-forced scores, also after
    the rows are reordered as beam search does."""
    model = copy_model(coverage)
    src, tgt_in = batch()
    full = model(src, tgt_in)
    cache = model.start_decoding(model.encode(src))
    for t in range(2):
        torch.testing.assert_close(model.decode_step(tgt_in[:, t:t + 1], cache)[0], full[:, t],
                                   rtol=1e-4, atol=1e-5)
    cache.select(torch.tensor([1, 0]))  # swap the rows
    swapped = tgt_in[[1, 0]]
    for t in range(2, 4):
        got = model.decode_step(swapped[:, t:t + 1], cache)[0]
        torch.testing.assert_close(got[1], full[0, t], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_coverage_lives_in_the_last_layer_cache_entry():
    """c^t = sum_{t' < t} mean_heads(A_t'): after two steps the last layer's cache entry holds the
    sum of the first two teacher-forced attention rows, also after the rows are reordered;
    no other entry holds coverage."""
    model = copy_model(coverage=True)
    src, tgt_in = batch()
    a = _copy_attention(model, src, tgt_in)  # (B, T, S)
    cache = model.start_decoding(model.encode(src))
    assert [lc.coverage is None for lc in cache.layers] == [True, False]
    torch.testing.assert_close(cache.layers[-1].coverage, torch.zeros(2, 5))  # c^1 = 0
    for t in range(2):
        model.decode_step(tgt_in[:, t:t + 1], cache)
    torch.testing.assert_close(cache.layers[-1].coverage, a[:, :2].sum(1))
    cache.select(torch.tensor([1, 0]))
    torch.testing.assert_close(cache.layers[-1].coverage, a[[1, 0], :2].sum(1))
    assert cache.layers[0].coverage is None


def test_beam_search_on_a_copy_model():
    model = copy_model(coverage=True)
    src, _ = batch()
    s = DecodeConfig(beam=3, nbest=3, alpha=0.6)
    hyps = beam_search(ModelDecoder(model, src), torch.tensor([6, 6]), s, SpecialIds(bos_id=2, eos_id=EOS, pad_id=PAD))
    for h in hyps:
        assert h and all(x.log_prob <= 0 for x in h)
        assert [x.score for x in h] == sorted((x.score for x in h), reverse=True)


def test_rouge_of_identical_strings_is_one():
    from s2s.metrics import corpus_scores

    lines = ["recursively compute hashsums or piecewise hashings", "Execute commands over SSH"]
    scores = {s.name: s.score for s in corpus_scores(lines, [lines], ["rouge"])}
    assert scores == {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0}
    partial = {s.name: s.score for s in corpus_scores(["the cat sat"], [["the cats sat down"]], ["rouge"])}
    # stemming: cats -> cat; unigram P 3/3, R 3/4 -> F1 6/7
    assert partial["rouge1"] == pytest.approx(100 * 6 / 7, abs=0.01)


def test_rouge_keeps_every_script():
    """rouge-score's default tokenizer keeps only a-z0-9: Cyrillic and Chinese lines became empty
    (scored 0) and three identical lines scored 33.33.  Every script counts now, and says so."""
    from s2s.metrics import AllScriptsTokenizer, corpus_scores

    lines = ["Привет, как у тебя дела сегодня?", "我爱北京天安门", "Die Straße ist heute sehr schön"]
    scores = corpus_scores(lines, [lines], ["rouge"])
    assert {s.name: s.score for s in scores} == {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0}
    assert "tokenizer:unicode-words+cjk-chars" in scores[0].signature
    tok = AllScriptsTokenizer()
    assert tok.tokenize("Straße, мир! 北京") == ["straße", "мир", "北", "京"]
    # one Chinese character of four differs: unigram F1 3/4, bigram F1 2/3 (two of three bigrams shared)
    zh = {s.name: s.score for s in corpus_scores(["北京天门"], [["北京天安"]], ["rouge"])}
    assert zh["rouge1"] == pytest.approx(75.0) and zh["rouge2"] == pytest.approx(100 * 2 / 3, abs=0.01)


SUMM_YAML = """\
seed: 1
tokenizer: {{vocab_size: 400}}
data: {{src_lang: doc, tgt_lang: sum, train: {d}/train, dev: {d}/dev, dir: {d}/prep,
       max_length_ratio: 0, max_src_tokens: 48}}
model: {{d_model: 32, heads: 2, enc_layers: 1, dec_layers: 1, d_ff: 64, copy: true, coverage: true}}
train: {{max_steps: 4, validate_every: 2, log_every: 1, dev_bleu_sentences: 4, warmup_steps: 2,
        max_tokens: 1500, threads: 1, coverage_weight: 1.0}}
decode: {{beam: 2, max_len_a: 0.0, max_len_b: 12}}
"""

DOCS = ["Perl module to cache and expire key value pairs. It stores data in memory and on disk "
        "so that expensive computations run once.",
        "command-line music player that remembers songs between sessions and shuffles them.",
        "Font for Arabic-based writing systems in the Kano region, with several weights."]
SUMS = ["Perl module to cache and expire key/value pairs", "command-line shuffle music player",
        "Font for Arabic-based writing systems"]


def test_summarization_end_to_end(tmp_path):
    """prepare keeps long-to-short pairs and cuts sources; copy + coverage train; summarize and
    score --metric rouge through the CLI."""
    import subprocess
    import sys

    import numpy as np

    for split, k in (("train", 60), ("dev", 2)):
        (tmp_path / f"{split}.doc").write_text("\n".join(DOCS * (k // 3 + 1)) + "\n")
        (tmp_path / f"{split}.sum").write_text("\n".join(SUMS * (k // 3 + 1)) + "\n")
    cfg = tmp_path / "summ.yaml"
    cfg.write_text(SUMM_YAML.format(d=tmp_path))

    def s2s(*args, input=None):
        r = subprocess.run([sys.executable, "-m", "s2s", *map(str, args)], input=input,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    s2s("tokenizer", "train", cfg, "--set", "data.dedupe=false")
    s2s("prepare", cfg, "--set", "data.dedupe=false")
    lengths = np.diff(np.load(tmp_path / "prep" / "train.src.idx.npy"))
    assert lengths.max() <= 48 and len(lengths) == 63  # nothing dropped for its length ratio
    s2s("train", cfg, "-o", tmp_path / "run", "--set", "data.dedupe=false")
    out = s2s("summarize", "-m", tmp_path / "run", input="\n".join(DOCS + [""]) + "\n")
    assert len(out.split("\n")) == 5 and out.split("\n")[3] == ""
    ref = tmp_path / "ref.sum"
    ref.write_text("\n".join(SUMS + [""]) + "\n")
    scores = json.loads(s2s("score", "-", ref, "--metric", "rouge", "--json", input=out))
    assert set(scores) == {"rouge1", "rouge2", "rougeL"}
