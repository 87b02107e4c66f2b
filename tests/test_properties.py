"""Property-based checks: translate's line invariants, batching, and bad bytes never crash."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from s2s.cli import app
from s2s.data import token_batches
from s2s.errors import S2SError

# text a user may pipe in: any printable Unicode (emoji, RTL, CJK, combining marks), no newlines
line_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"),
                    max_size=40)


@pytest.fixture(scope="module")
def translator(prepared, tmp_path_factory):
    from s2s.config import load_config
    from s2s.trainer import train
    from s2s.translate import Translator

    run = train(load_config(prepared, ["train.max_steps=2", "train.validate_every=2"]),
                tmp_path_factory.mktemp("prop") / "run", show_progress=False)
    return Translator.from_dir(run, beam=2, max_len_a=0.5, max_len_b=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.one_of(line_text, st.sampled_from(["", "   ", "\t", "🙂🙂", "שלום עולם"])),
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
