"""Property-based checks: tokenizer round trips, masks, translate's line invariants, batching,
and bad bytes never crash."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from s2s.cli import app
from s2s.data import token_batches
from s2s.errors import S2SError

# text a user may pipe in: any printable Unicode (emoji, RTL, CJK, combining marks), no newlines
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what splitlines() splits at
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=LINE_BREAKS), max_size=40)


@pytest.fixture(scope="module")
def translator(prepared, tmp_path_factory):
    from s2s.config import load_config
    from s2s.trainer import train
    from s2s.translate import Translator

    run = train(load_config(prepared, ["train.max_steps=2", "train.validate_every=2"]),
                tmp_path_factory.mktemp("prop") / "run", show_progress=False)
    return Translator.from_dir(run, beam=2, max_len_a=0.5, max_len_b=4)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(line_text, st.sampled_from(["", "   ", "\t", "🙂🙂", "שלום עולם", "a\x00b",
                                                            "package " * 3000, "ü" * 20000])),
                      max_size=8))
def test_translate_one_line_out_per_line_in_order(translator, lines):
    out = list(translator.translate_lines(lines, chunk_lines=3))
    assert [t.line_no for t in out] == list(range(1, len(lines) + 1))
    for line, t in zip(lines, out):
        assert "\n" not in t.text
        if not line.strip():
            assert t.text == "" and t.hypotheses == []
    # order and batching do not change any line's translation
    alone = [translator.translate([line])[0] for line in lines]
    assert [t.text for t in out] == alone


@settings(max_examples=50, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 80)), min_size=1, max_size=200),
       max_tokens=st.integers(1, 500), seed=st.integers(0, 2 ** 16))
def test_token_batches_partition_within_budget(lens, max_tokens, seed):
    src = np.array([a for a, _ in lens])
    tgt = np.array([b for _, b in lens])
    batches = token_batches(src, tgt, max_tokens, np.random.default_rng(seed))
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lens)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(src[b].max(), tgt[b].max()) <= max_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_score_random_bytes_never_crash(tmp_path, data):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    hyp.write_bytes(data)
    ref.write_bytes(data[::-1])
    r = CliRunner().invoke(app, ["score", str(hyp), str(ref)])
    # either a score, or one of s2s's own one-line errors: never another exception
    assert r.exception is None or isinstance(r.exception, (S2SError, SystemExit)), repr(r.exception)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400))
def test_translate_random_bytes(translator, tmp_path, data):
    """Any bytes: strict decoding is a one-line error naming a line, replace keeps every line."""
    from s2s.textio import read_lines

    f = tmp_path / "in.txt"
    f.write_bytes(data)
    n_lines = data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))  # lines end at \n
    try:
        out = list(translator.translate_lines(read_lines(f), chunk_lines=4))
        assert len(out) == n_lines
    except S2SError as e:
        assert f"{f}:" in str(e) and "invalid UTF-8" in str(e)
    out = list(translator.translate_lines(read_lines(f, errors="replace"), chunk_lines=4))
    assert len(out) == n_lines


# --------------------------------------------------------------------------- #
# Tokenizer round trips
# --------------------------------------------------------------------------- #

any_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)  # every code point but lone surrogates


def _tokenizer(corpus, out, **settings):
    from s2s.config import DataConfig, TokenizerConfig
    from s2s.tokenizer import Tokenizer, train_tokenizer

    data = DataConfig(src_lang="en", tgt_lang="de", train=str(corpus / "train"), dir=str(out))
    tok = TokenizerConfig(vocab_size=400, **settings)
    train_tokenizer(tok, data)
    return Tokenizer.load(out, tok, data)


@pytest.fixture(scope="module")
def exact_tokenizer(corpus, tmp_path_factory):
    return _tokenizer(corpus, tmp_path_factory.mktemp("tok-id"), byte_fallback=True, normalization="identity")


@pytest.fixture(scope="module")
def nfkc_tokenizer(corpus, tmp_path_factory):
    return _tokenizer(corpus, tmp_path_factory.mktemp("tok-nfkc"), byte_fallback=True)


def _round_trip(tok, text: str) -> str:
    return tok.decode_tgt(tok.encode_tgt([text])[0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=any_text)
def test_identity_tokenizer_round_trips_any_unicode(exact_tokenizer, text):
    """normalization: identity + byte_fallback: decode(encode(x)) == x, byte for byte."""
    ids = exact_tokenizer.encode_tgt([text])[0]
    assert 1 not in ids  # no <unk>: unseen characters are spelled as bytes
    assert _round_trip(exact_tokenizer, text) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=any_text)
def test_nfkc_tokenizer_round_trip_is_a_projection(nfkc_tokenizer, text):
    """The default normalization changes text once (NFKC, whitespace), then never again."""
    once = _round_trip(nfkc_tokenizer, text)
    assert 1 not in nfkc_tokenizer.encode_tgt([text])[0]
    assert _round_trip(nfkc_tokenizer, once) == once


def test_default_tokenizer_round_trips_the_corpus(corpus, tmp_path):
    """Real text is already normal: every dev line comes back exactly."""
    tok = _tokenizer(corpus, tmp_path)
    for lang in ("en", "de"):
        for line in (corpus / f"dev.{lang}").read_text(encoding="utf-8").splitlines():
            assert _round_trip(tok, line) == " ".join(line.split())


# --------------------------------------------------------------------------- #
# Masks
# --------------------------------------------------------------------------- #

@settings(max_examples=100, deadline=None)
@given(T=st.integers(1, 12), extra=st.integers(0, 12), start=st.integers(0, 12))
def test_causal_mask_cells(T, extra, start):
    """Query i (at position start+i) sees key j iff j <= start+i, whatever the cache offset."""
    from s2s.model.attention import causal_mask

    T_k = start + T + extra
    m = causal_mask(T, None, T_k, start)
    assert m.shape == (T, T_k)
    for i in range(T):
        for j in range(T_k):
            assert (m[i, j] == 0) == (j <= start + i) and (m[i, j] == 0 or m[i, j] == float("-inf"))


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 10), min_size=1, max_size=6))
def test_padding_mask_blocks_exactly_the_padding(lens):
    from s2s.data import pad_sequences
    from s2s.model.attention import padding_mask

    seqs = [[5 + k for k in range(n)] for n in lens]
    tokens = pad_sequences(seqs)
    m = padding_mask(tokens, 0)
    assert m.shape == (len(lens), 1, 1, max(lens))
    for b, n in enumerate(lens):
        assert (m[b, 0, 0, :n] == 0).all() and (m[b, 0, 0, n:] == float("-inf")).all()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.binary(max_size=200),
                      st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
                      st.sampled_from([b"model: {d_model: 32\n", b"train:\n  lr: [1,\n", b"- a\n- b\n",
                                       b"model:\n  heads: 0\n", b"decode: {beam: 1e9}\n"])))
def test_random_config_bytes_give_a_config_error(tmp_path, data):
    """Whatever a config file holds, loading it is a valid config or a ConfigError naming it."""
    from s2s.config import load_config
    from s2s.errors import ConfigError

    f = tmp_path / "fuzz.yaml"
    f.write_bytes(data)
    try:
        load_config(f)
    except ConfigError as e:
        assert str(f) in str(e) and "\n" not in str(e)
