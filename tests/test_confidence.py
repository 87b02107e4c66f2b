"""Confidence (s2s.output): --scores, --format jsonl, and the score recomputed by teacher forcing."""

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from s2s.cli import app
from s2s.output import OutputFormat, confidence, format_translation, mean_log_prob
from s2s.search import Hypothesis, length_penalty
from s2s.workers import TranslatorSpec, translate_stream
from tests.conftest import untrained_model_dir

runner = CliRunner()
CAP = {"max_len_a": 0.0, "max_len_b": 8}  # random weights never stop: cap them
LINES = ["Clipboard management", "", "port scanner for discovering services", "a\x00b NUL bytes",
         "émoji 🙂 and עברית", "   ", "last one"]


@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory) -> Path:
    """An untrained model directory of the tiny config."""
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("confidence") / "model")


def stream(model_dir, workers=1, line_by_line=False, overrides=None, **spec) -> str:
    s = TranslatorSpec((str(model_dir),), {**CAP, **(overrides or {})}, device="cpu", threads=1, **spec)
    out = io.StringIO()
    translate_stream(s, LINES * 2, out, workers=workers, line_by_line=line_by_line, chunk_lines=3)
    return out.getvalue()


def test_mean_log_prob_is_the_formula():
    """(51): (1/m) sum_t log p(y_t), m counting </s>: p = 0.5, 0.4, 0.25 -> log(0.05) / 3."""
    assert mean_log_prob(math.log(0.05), 3) == pytest.approx(math.log(0.5 * 0.4 * 0.25) / 3)
    h = Hypothesis(tokens=[7, 8, 9], score=-9.0, log_prob=-2.0)  # m = 4 with </s>
    assert confidence(h) == pytest.approx(-0.5)
    assert confidence(None) == 0.0  # an empty input: the empty output, log 1
    joined = Hypothesis(tokens=[7, 8, 9, 10], score=-9.0, log_prob=-3.0, m=6)  # two sentences: 4 + 2 </s>
    assert confidence(joined) == pytest.approx(-0.5)


def test_score_is_the_searchs_own_recomputed_by_teacher_forcing(model_dir):
    """Every hypothesis of a beam search: teacher forcing its tokens and </s> through the model
    gives its log p; --scores' score is that / m, the search's score that / lp(m)."""
    import torch

    from s2s.data import teacher_forcing_input
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir, "cpu", beam=3, nbest=3, **CAP)
    tok, model = tr.tok, tr.model
    found = tr.translate_chunk(LINES)
    checked = 0
    for line, t in zip(LINES, found):
        if not line.strip():
            assert t.hypotheses == [] and t.confidence == 0.0
            continue
        src = torch.tensor(tr.encode_lines([line], 1))  # (1, S)
        for h in t.hypotheses:
            y = h.tokens + [tok.eos_id]  # m tokens, </s> included
            with torch.no_grad():
                logp = torch.log_softmax(model(src, teacher_forcing_input([y], tok.pad_id, tok.bos_id)).float(), -1)
            log_p = float(logp[0, torch.arange(len(y)), torch.tensor(y)].sum())
            assert h.log_prob == pytest.approx(log_p, abs=1e-4)
            assert confidence(h) == pytest.approx(log_p / len(y), abs=1e-5)
            d = tr.decode
            assert h.score == pytest.approx(log_p / length_penalty(len(y), d.alpha, d.length_penalty), abs=1e-4)
            checked += 1
        assert t.confidence == confidence(t.hypotheses[0])
    assert checked >= 10


def test_a_line_of_several_sentences_counts_each_ones_end(model_dir):
    """--split-sentences: a line's confidence is its sentences' log p over all their tokens,
    each sentence's </s> included: (sum_i log p_i) / (sum_i m_i)."""
    from s2s.translate import Translator

    line = "Clipboard management. Port scanner for discovering services."
    tr = Translator.from_dir(model_dir, "cpu", beam=2, split_sentences=True, **CAP)
    joined = tr.translate_chunk([line])[0]
    sentences = Translator.from_dir(model_dir, "cpu", beam=2, **CAP).translate_chunk(
        ["Clipboard management.", "Port scanner for discovering services."])
    best = [t.hypotheses[0] for t in sentences]
    assert joined.hypotheses[0].m == sum(len(h.tokens) + 1 for h in best)
    assert joined.confidence == pytest.approx(sum(h.log_prob for h in best) / sum(len(h.tokens) + 1 for h in best))


def test_scores_rows_cut_f1_is_the_plain_output(model_dir):
    """--scores: each row is the row without it, a TAB and the score (4 decimals); one row per
    input line, and with --nbest one per hypothesis, each with its own score."""
    from s2s.translate import Translator

    plain = stream(model_dir)
    scored = stream(model_dir, scores=True)
    rows = scored.splitlines()
    assert len(rows) == len(LINES) * 2 and all(row.count("\t") == 1 for row in rows)
    assert "".join(row.split("\t")[0] + "\n" for row in rows) == plain
    want = Translator.from_dir(model_dir, "cpu", **CAP).translate_chunk(LINES * 2)
    assert [row.split("\t")[1] for row in rows] == [f"{t.confidence:.4f}" for t in want]
    assert rows[1] == "\t0.0000"  # an empty line: the empty output, log 1

    nbest = {"beam": 3, "nbest": 2}
    rows = stream(model_dir, overrides=nbest, scores=True).splitlines()
    want = Translator.from_dir(model_dir, "cpu", **nbest, **CAP).translate_chunk(LINES * 2)
    expected = []
    for t in want:
        hyps = list(zip(t.texts, t.hypotheses)) or [("", None)]
        expected += [f"{t.line_no - 1} ||| {text} ||| {h.score if h else 0.0:.4f}\t{confidence(h):.4f}"
                     for text, h in hyps]
    assert rows == expected and len({r.split(" ||| ")[0] for r in rows}) == len(LINES) * 2

    plain = stream(model_dir, overrides=nbest, alignments=True)  # alignments stay before the TAB
    scored = stream(model_dir, overrides=nbest, alignments=True, scores=True)
    assert "".join(row.split("\t")[0] + "\n" for row in scored.splitlines()) == plain


def test_greedy_without_a_score_to_show_skips_the_normalization(model_dir, monkeypatch):
    """Text rows without --scores: the greedy search's steps return the scores z, not log p (the
    same argmax), and its rows are --scores' rows without the score; a score shown (--scores,
    JSON, n-best rows) keeps every step normalized."""
    from s2s import search

    normalized = []
    make = search.ModelDecoder.__init__

    def spy(self, *args, **kwargs):
        make(self, *args, **kwargs)
        normalized.append(self.normalized)
    monkeypatch.setattr(search.ModelDecoder, "__init__", spy)
    greedy = {"beam": 1}
    plain = stream(model_dir, overrides=greedy)
    assert normalized and not any(normalized)
    for spec in ({"scores": True}, {"output_format": "jsonl"}, {"nbest_rows": True}):
        normalized.clear()
        stream(model_dir, overrides=greedy, **spec)
        assert normalized and all(normalized), spec
    rows = stream(model_dir, overrides=greedy, scores=True).splitlines()
    assert [row.split("\t")[0] for row in rows] == plain.splitlines()
    assert not any(math.isnan(float(row.split("\t")[1])) for row in rows)
    normalized.clear()
    stream(model_dir, overrides={"beam": 2})
    assert normalized and all(normalized)  # a beam search compares log p


def test_jsonl_one_object_per_input_line(model_dir):
    """--format jsonl: one object per input line (empty and hostile lines included) with text,
    score, alignment and the n-best list, equal to the text rows' fields."""
    from s2s.translate import Translator

    settings = {"beam": 3, "nbest": 2}
    out = stream(model_dir, overrides=settings, alignments=True, output_format="jsonl")
    objects = [json.loads(row) for row in out.splitlines()]
    assert len(objects) == len(LINES) * 2 and out.endswith("\n")
    tr = Translator.from_dir(model_dir, "cpu", **settings, **CAP)
    tr.alignments = True
    for o, t in zip(objects, tr.translate_chunk(LINES * 2)):
        assert list(o) == ["text", "score", "alignment", "nbest"]
        assert o["text"] == t.text and o["score"] == round(t.confidence, 4)  # 4 decimals, as --scores
        assert all(list(n) == ["text", "score", "alignment"] for n in o["nbest"])
        assert [n["text"] for n in o["nbest"]] == (t.texts or [""])
        assert [n["score"] for n in o["nbest"]] == [round(confidence(h), 4) for h in t.hypotheses or [None]]
        assert o["alignment"] == o["nbest"][0]["alignment"]
        assert all(isinstance(j, int) and isinstance(k, int) for j, k in o["alignment"])
    assert objects[1] == {"text": "", "score": 0.0, "alignment": [], "nbest": [{"text": "", "score": 0.0,
                                                                                "alignment": []}]}

    plain = [json.loads(row) for row in stream(model_dir, output_format="jsonl").splitlines()]
    assert all(list(o) == ["text", "score"] for o in plain)  # no nbest, no alignment unless asked


@pytest.mark.parametrize("spec", [{"output_format": "jsonl", "alignments": True, "nbest_rows": True},
                                  {"scores": True, "overrides": {"beam": 2, "nbest": 2}}])
def test_two_workers_and_unbuffered_write_what_one_process_writes(model_dir, spec):
    one = stream(model_dir, **spec)
    assert stream(model_dir, workers=2, **spec) == one
    assert stream(model_dir, line_by_line=True, **spec) == one


def test_cli_scores_and_format(model_dir):
    """Through the command line (translate and summarize share the options)."""
    args = ["-m", str(model_dir), "--device", "cpu", "--workers", "1", "--max-len-a", "0", "--max-len-b", "6"]
    text = "\n".join(LINES) + "\n"
    plain = runner.invoke(app, ["translate", *args], input=text)
    scored = runner.invoke(app, ["translate", *args, "--scores"], input=text)
    assert plain.exit_code == 0 and scored.exit_code == 0, scored.output
    assert [row.split("\t")[0] for row in scored.stdout.splitlines()] == plain.stdout.splitlines()
    jsonl = runner.invoke(app, ["summarize", *args, "--format", "jsonl", "--nbest", "1"], input=text)
    assert jsonl.exit_code == 0, jsonl.output
    objects = [json.loads(row) for row in jsonl.stdout.splitlines()]
    assert len(objects) == len(LINES) and all(list(o) == ["text", "score", "nbest"] for o in objects)
    assert "--scores" in runner.invoke(app, ["translate", "--help"]).stdout


def test_cli_bad_format_is_one_error_line(model_dir):
    r = subprocess.run([sys.executable, "-m", "s2s", "translate", "-m", str(model_dir), "--format", "xml"],
                       input="hello\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == "s2s: error: --format: 'xml' is not text or jsonl"


def test_output_format_checks_its_name():
    from s2s.errors import S2SError

    with pytest.raises(S2SError, match="--format: 'csv' is not text or jsonl"):
        OutputFormat(format="csv")


def test_jsonl_keeps_utf8_and_rows_keep_their_fields():
    from s2s.translate import Translation

    t = Translation(3, [Hypothesis([5, 6], score=-1.5, log_prob=-1.5, alignment=[(0, 0), (1, 1)])], ["é 🙂"])
    assert format_translation(t, OutputFormat(format="jsonl")) == '{"text": "é 🙂", "score": -0.5}\n'
    assert format_translation(t, OutputFormat(alignments=True, scores=True)) == "é 🙂 ||| 0-0 1-1\t-0.5000\n"
    assert format_translation(t, OutputFormat(nbest=True, scores=True)) == "2 ||| é 🙂 ||| -1.5000\t-0.5000\n"


def test_a_jsonl_row_is_one_line_to_every_line_reader():
    """U+2028, U+2029 and U+0085 (from a --markup attribute, say) end lines for str.splitlines."""
    from s2s.translate import Translation

    text = "a\u2028b\u2029c\x85d\x0be"
    row = format_translation(Translation(1, [Hypothesis([5], -1.0, -1.0)], [text]), OutputFormat(format="jsonl"))
    assert len(row.splitlines()) == 1 and json.loads(row)["text"] == text


def test_benchmark_ranks_spearman_and_tenths(monkeypatch):
    """benchmarks/confidence.py's statistics, from their formulas."""
    from tests.conftest import load_benchmark

    bench = load_benchmark("confidence", monkeypatch)
    assert bench.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]  # the tie shares ranks 3 and 4
    x = [0.1, 0.5, 0.2, 0.9, 0.4]
    assert bench.spearman(x, [v ** 3 for v in x]) == pytest.approx(1.0)  # any increasing map: 1
    assert bench.spearman(x, [-v for v in x]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) and (1, 3, 2): sum of centred products 1 / sqrt(2 * 2) = 0.5 = 1 - 6 * 2 / (3 * 8)
    assert bench.spearman([1.0, 2.0, 3.0], [10.0, 30.0, 20.0]) == pytest.approx(0.5)
    assert bench.spearman([1.0, 1.0], [1.0, 2.0]) == 0.0
    score = [float(i) for i in range(20)]  # line i scores i
    quality = [100.0 if i >= 18 else 0.0 if i < 2 else 50.0 for i in range(20)]
    assert bench.tenths(score, quality) == (100.0, 0.0, 50.0)
