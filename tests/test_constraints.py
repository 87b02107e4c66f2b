"""Terminology: glossary files, lexically constrained beam search (dynamic beam allocation),
and --glossary through the Translator and the command line."""

import logging
import math
from pathlib import Path

import pytest
import torch

from s2s.config import DecodeConfig
from s2s.constraints import (
    ConstraintProgress,
    advance,
    bank,
    bank_allocation,
    constrained_beam_search,
    next_constraint_tokens,
    pad_constraints,
    rank_finished,
    repeated_entries,
    room_for_constraints,
    unmet_constraints,
)
from s2s.errors import ConfigError, S2SError
from s2s.glossary import Glossary, load_glossary
from s2s.search import SpecialIds, beam_search, greedy_search, search
from tests.conftest import untrained_model_dir

PAD, UNK, BOS, EOS, A, B, C, D = range(8)
V = 8
IDS = SpecialIds(bos_id=BOS, eos_id=EOS, pad_id=PAD)
NEG = float("-inf")
# unscripted prefixes: </s> is likeliest, C and D unlikely
DEFAULT = {EOS: 0.6, A: 0.3, B: 0.06, C: 0.02, D: 0.02}


class Scripted:
    """Next-token probabilities looked up by sentence and prefix; unscripted prefixes get the
    script's "*" entry, else DEFAULT."""

    def __init__(self, scripts: list[dict]):
        self.scripts = scripts
        self.which = list(range(len(scripts)))
        self.prefixes = [() for _ in scripts]
        self.started = False

    def step(self, y_prev):
        if self.started:
            self.prefixes = [p + (int(y),) for p, y in zip(self.prefixes, y_prev[:, 0])]
        self.started = True
        out = torch.full((len(self.prefixes), V), NEG)
        for row, (w, prefix) in enumerate(zip(self.which, self.prefixes)):
            script = self.scripts[w]
            for tok, p in script.get(prefix, script.get("*", DEFAULT)).items():
                out[row, tok] = math.log(p)
        return out

    def select(self, index, group=None):
        self.prefixes = [self.prefixes[i] for i in index.tolist()]
        self.which = [self.which[i] for i in index.tolist()]


def settings(**kw) -> DecodeConfig:
    return DecodeConfig(**{"beam": 2, "nbest": 1, "alpha": 0.0, **kw})


def contains(tokens, c) -> bool:
    return not unmet_constraints(tokens, [c])


# --------------------------------------------------------------------------- #
# the pieces of the algorithm, against their formulas
# --------------------------------------------------------------------------- #

def test_pad_constraints_and_room():
    cons = pad_constraints([[[A, B], [C]], [], [[D, D, D]]])
    assert cons.tolist() == [[[A, B, -1], [C, -1, -1]], [[-1] * 3] * 2, [[D, D, D], [-1] * 3]]
    assert pad_constraints([[], []]) is None and pad_constraints([[[]]]) is None
    # C + 1: every constraint token and </s>, capped
    assert room_for_constraints(torch.tensor([2, 9, 2]), cons, cap=100).tolist() == [4, 9, 4]
    assert room_for_constraints(torch.tensor([2, 9, 2]), cons, cap=3).tolist() == [3, 9, 3]


def test_unmet_constraints_are_the_ones_not_in_a_row():
    assert unmet_constraints([A, B, C], [[A, B], [B, C], [A, C], [D], [C]]) == [2, 3]
    assert unmet_constraints([], [[A]]) == [0]


def test_advance_and_next_tokens_follow_the_progress_rules():
    cons = torch.tensor([[[A, B, C], [B, -1, -1]]])  # c_1 = A B C, c_2 = B
    lengths = (cons >= 0).sum(-1)
    p = ConstraintProgress.start(1, 2, torch.device("cpu"))
    assert next_constraint_tokens(p, cons).tolist() == [[A, B]]  # the first token of each unmet c_j

    def step(p, y):
        return advance(p, cons, lengths, torch.tensor([y]))

    p = step(p, A)  # starts c_1
    assert (p.cur.item(), p.off.item(), p.met.tolist(), bank(p, lengths).item()) == (0, 1, [[False, False]], 1)
    assert next_constraint_tokens(p, cons).tolist() == [[B, -1]]  # inside c_1: only its next token
    p = step(p, B)
    assert (p.cur.item(), p.off.item(), bank(p, lengths).item()) == (0, 2, 2)
    broken = step(p, D)  # leaving c_1 loses its progress
    assert (broken.cur.item(), broken.off.item(), bank(broken, lengths).item()) == (-1, 0, 0)
    restart = step(p, A)  # ... and a first token starts it again
    assert (restart.cur.item(), restart.off.item()) == (0, 1)
    p = step(p, C)  # c_1 met
    assert (p.cur.item(), p.off.item(), p.met.tolist(), bank(p, lengths).item()) == (-1, 0, [[True, False]], 3)
    assert next_constraint_tokens(p, cons).tolist() == [[-1, B]]
    p = step(p, B)  # a one-token constraint is met at once
    assert (p.cur.item(), p.met.tolist(), bank(p, lengths).item()) == (-1, [[True, True]], 4)
    assert next_constraint_tokens(p, cons).tolist() == [[-1, -1]]


def test_bank_allocation_goes_round_robin_from_the_fullest_bank():
    """key(i) = rank(i) * n_banks + (n_banks - 1 - bank(i)); the K smallest win."""
    score = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, NEG]])
    banks = torch.tensor([[0, 0, 0, 2, 1, 2, 2]])
    n_banks = 3
    rank = [0, 1, 2, 0, 0, 1, 2]  # within each bank, best first
    key = [r * n_banks + (n_banks - 1 - b) for r, b in zip(rank, banks[0].tolist())]
    key[6] = 99  # -inf comes last
    for K in range(1, 8):
        want = sorted(range(7), key=lambda i: key[i])[:K]
        assert bank_allocation(score, banks, K, n_banks)[0].tolist() == want, K
    # one bank: the K best
    assert bank_allocation(score, torch.zeros_like(banks), 3, 1)[0].tolist() == [0, 1, 2]


def test_rank_finished_puts_complete_hypotheses_first():
    score = torch.tensor([[-1.0, -2.0, -3.0, NEG]])
    complete = torch.tensor([[False, True, True, True]])
    assert rank_finished(score, complete, 4)[0].tolist() == [1, 2, 0, 3]


def test_repeated_entries_mark_all_but_the_first():
    x = torch.tensor([[5, 3, 5, -1, 3, -1, 7]])
    assert repeated_entries(x)[0].tolist() == [False, False, True, False, True, True, False]


# --------------------------------------------------------------------------- #
# the search against scripted decoders: exact hypotheses and scores
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("beam", [1, 2, 3])
def test_an_unlikely_constraint_is_produced_at_the_best_place(beam):
    # unconstrained, </s> at once wins; with C required: [C] </s> (0.02 * 0.6) beats [A C] </s>
    cons = pad_constraints([[[C]]])
    got = search(Scripted([{}]), torch.tensor([6]), settings(beam=beam), IDS, constraints=cons)[0]
    assert got[0].tokens == [C]
    assert got[0].log_prob == pytest.approx(math.log(0.02) + math.log(0.6))
    assert got[0].score == pytest.approx(got[0].log_prob)  # alpha 0: lp(m) = 1
    assert search(Scripted([{}]), torch.tensor([6]), settings(beam=beam), IDS)[0][0].tokens == []


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_every_hypothesis_holds_every_constraint(beam):
    constraints = [[B, C], [A], [D, B]]
    cons = pad_constraints([constraints])
    s = settings(beam=beam, nbest=beam, alpha=0.6)
    got = constrained_beam_search(Scripted([{}]), torch.tensor([12]), s, IDS, cons)[0]
    assert len(got) == beam
    for h in got:
        assert not unmet_constraints(h.tokens, constraints), h.tokens
    assert [h.score for h in got] == sorted((h.score for h in got), reverse=True)
    for h in got:  # scores are the model's: sum of log p over the tokens and </s>, over lp(m)
        logp = sum(math.log(DEFAULT[tok]) for tok in h.tokens + [EOS])
        assert h.log_prob == pytest.approx(logp, abs=1e-4)
        assert h.score == pytest.approx(logp / ((5 + len(h.tokens) + 1) / 6) ** 0.6, abs=1e-4)


def test_a_constraint_too_long_for_max_len_falls_back_to_a_plain_hypothesis():
    cons = pad_constraints([[[A, B, C, D]]])
    got = constrained_beam_search(Scripted([{}]), torch.tensor([3]), settings(beam=2), IDS, cons)[0]
    assert got and len(got[0].tokens) <= 2 and unmet_constraints(got[0].tokens, [[A, B, C, D]]) == [0]


@pytest.mark.parametrize("beam", [1, 2, 3])
def test_sentences_without_constraints_are_searched_as_without_any(beam):
    scripts = [{(): {A: 0.6, B: 0.4}, (A,): {EOS: 0.1, A: 0.4, B: 0.5}, (B,): {EOS: 0.85, A: 0.1, B: 0.05},
                "*": {EOS: 1.0}},
               {}, {(): {B: 0.55, A: 0.45}, (A,): {A: 0.7, EOS: 0.3}, "*": {EOS: 1.0}}]
    s = settings(beam=beam, nbest=beam, alpha=0.6)
    max_len = torch.tensor([7, 7, 5])
    plain = (greedy_search if beam == 1 else beam_search)(Scripted(scripts), max_len, s, IDS)
    cons = pad_constraints([[], [[C, D]], []])
    mixed = constrained_beam_search(Scripted(scripts), max_len, s, IDS, cons)
    for n in (0, 2):
        assert [(h.tokens, h.score, h.log_prob) for h in mixed[n]] == \
               [(h.tokens, h.score, h.log_prob) for h in plain[n]], n
    assert all(contains(h.tokens, [C, D]) for h in mixed[1])


def test_a_forced_prefix_and_a_constraint_together():
    cons = pad_constraints([[[C]]])
    prefix = torch.tensor([[B, A]])
    got = search(Scripted([{}]), torch.tensor([8]), settings(beam=2), IDS, prefix, cons)[0][0]
    assert got.tokens[:2] == [B, A] and C in got.tokens[2:]


def test_sampling_refuses_a_glossary():
    with pytest.raises(ConfigError, match="decode.glossary: constrains searched hypotheses"):
        DecodeConfig(beam=1, sampling=True, glossary="terms.tsv")


# --------------------------------------------------------------------------- #
# glossary files
# --------------------------------------------------------------------------- #

def test_glossary_terms_match_whole_words_case_sensitively(tmp_path):
    f = tmp_path / "g.tsv"
    f.write_text("file\tDatei\nfile manager\tDateimanager\n C++ \t C++ \n\nTotal\tGesamt\n", encoding="utf-8")
    g = load_glossary(f)
    assert dict(g.terms) == {"file": "Datei", "file manager": "Dateimanager", "C++": "C++", "Total": "Gesamt"}
    assert g.targets_in("A file manager for files.") == ["Datei", "Dateimanager"]
    assert g.targets_in("files, profile, File") == []
    assert g.targets_in("written in C++.") == ["C++"]
    assert g.targets_in("Total Commander (file)") == ["Datei", "Gesamt"]
    assert Glossary({"a": "X", "b": "X"}).targets_in("a b") == ["X"]  # one constraint per target term
    merged = g.merged({"file": "Akte"}, "request")
    assert merged.targets_in("file") == ["Akte"] and len(merged) == 4


BAD_GLOSSARIES = [
    (b"file\tDatei\nfolder Ordner\n", ":2: expected 'source term<TAB>target term', found no tab"),
    (b"a\tb\tc\n", ":1: expected 'source term<TAB>target term', found 3 tab-separated fields"),
    (b"ok\tgut\n \tleer\n", ":2: empty source term"),
    (b"ok\t \n", ":1: empty target term for 'ok'"),
    (b"file\tDatei\nx\ty\nfile\tAkte\n", ":3: source term 'file' is already translated as 'Datei' (line 1)"),
    (b"file\tDatei\n\xff\tx\n", ":2: invalid UTF-8"),
    (b"\n  \n", ": no glossary entries"),
]


@pytest.mark.parametrize("content,message", BAD_GLOSSARIES)
def test_bad_glossary_lines_name_file_and_line(tmp_path, content, message):
    f = tmp_path / "g.tsv"
    f.write_bytes(content)
    with pytest.raises(S2SError) as e:
        load_glossary(f)
    assert str(e.value) == f"{f}{message}" or str(e.value).startswith(f"{f}{message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_repeated_identical_entry_is_fine(tmp_path):
    f = tmp_path / "g.tsv"
    f.write_text("file\tDatei\nfile\tDatei\n", encoding="utf-8")
    assert dict(load_glossary(f).terms) == {"file": "Datei"}


def test_missing_glossary_and_directory(tmp_path):
    with pytest.raises(S2SError, match="nope.tsv: no such file"):
        load_glossary(tmp_path / "nope.tsv")
    with pytest.raises(S2SError, match="is a directory"):
        load_glossary(tmp_path)


# --------------------------------------------------------------------------- #
# a tiny model (random weights): every constraint appears, the rest is unchanged
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory):
    """An untrained model directory on the tiny prepared data (constraints hold whatever the weights)."""
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("glossary") / "model")


SOURCES = ["A simple file manager for the desktop.", "Hello world", "",
           "Tools to convert files and print them.", "The program shows the time.",
           "file", "Library for reading and writing image files"]
GLOSSARY = "file\tDatei\nprint\tdrucken\nimage files\tBilddateien\nHello\tHallo Welt\n"


@pytest.fixture()
def glossary_file(tmp_path) -> Path:
    f = tmp_path / "terms.tsv"
    f.write_text(GLOSSARY, encoding="utf-8")
    return f


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_every_glossary_term_appears_and_other_lines_are_unchanged(model_dir, glossary_file, beam):
    from s2s.translate import Translator

    plain = Translator.from_dir(model_dir, beam=beam, nbest=beam)
    want = plain.translate_chunk(SOURCES)
    termed = Translator.from_dir(model_dir, beam=beam, nbest=beam, glossary=str(glossary_file))
    got = termed.translate_chunk(SOURCES)
    g = load_glossary(glossary_file)
    constrained = 0
    for line, w, t in zip(SOURCES, want, got):
        targets = g.targets_in(line)
        if not targets:  # no term: exactly the hypotheses of the search without a glossary
            assert [(h.tokens, h.score) for h in t.hypotheses] == [(h.tokens, h.score) for h in w.hypotheses]
            continue
        constrained += 1
        pieces = [x[:-1] for x in termed.tok.encode_tgt(targets)]
        assert 1 <= len(t.hypotheses) <= beam
        for h, text in zip(t.hypotheses, t.texts):
            assert not unmet_constraints(h.tokens, pieces), (line, text)
            for term in targets:
                assert term in text, (line, term, text)
    assert constrained == 5


@pytest.mark.parametrize("members,decode", [(1, {"coverage_penalty": 0.2, "beam": 1}),
                                             (1, {"coverage_penalty": 0.2, "beam": 3}),
                                             (2, {"beam": 2, "no_repeat_ngram": 2})])
def test_glossary_with_coverage_penalty_ensembles_and_ngram_blocking(model_dir, glossary_file, members, decode):
    from s2s.translate import Translator

    tr = Translator.from_dirs([model_dir] * members, decode={**decode, "glossary": str(glossary_file)})
    g = load_glossary(glossary_file)
    for line, t in zip(SOURCES, tr.translate_chunk(SOURCES)):
        for term in g.targets_in(line):
            assert term in t.text, (line, t.text)


def test_glossary_with_a_shortlist_keeps_the_terms(model_dir, glossary_file):
    from s2s.shortlist import Shortlist
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir, beam=2, shortlist=True, glossary=str(glossary_file))
    V_src = tr.model.src_embed.num_embeddings
    tr.shortlist = Shortlist(torch.full((V_src, 1), -1, dtype=torch.int32),
                             torch.tensor([5, 6, 7], dtype=torch.int32), {})
    for line, t in zip(SOURCES, tr.translate_chunk(SOURCES)):
        for term in load_glossary(glossary_file).targets_in(line):
            assert term in t.text, (line, t.text)


def test_a_term_that_cannot_fit_is_a_warning_not_an_error(model_dir, tmp_path, caplog):
    from s2s.translate import Translator

    f = tmp_path / "long.tsv"
    f.write_text("world\tWeltweite Zusammenarbeit der Entwicklergemeinschaft\n", encoding="utf-8")
    tr = Translator.from_dir(model_dir, beam=2, max_output_tokens=4, glossary=str(f))
    with caplog.at_level(logging.WARNING, logger="s2s"):
        got = tr.translate_chunk(["Hello world", "Hello"])
    assert got[0].hypotheses and len(got[0].hypotheses[0].tokens) < 4
    assert "line 1: glossary term(s) 'Weltweite Zusammenarbeit der Entwicklergemeinschaft' not in the " \
           "translation" in caplog.text
    assert "line 2" not in caplog.text


def test_translate_glossary_on_the_command_line(model_dir, glossary_file, tmp_path, capsys, monkeypatch):
    from tests.test_bad_inputs import assert_error, cli, cli_ok

    src = tmp_path / "in.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    out = tmp_path / "out.de"
    cli_ok(capsys, monkeypatch, "translate", "-m", model_dir, "-i", src, "-o", out, "--glossary", glossary_file,
           "--beam", "2")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(SOURCES)
    g = load_glossary(glossary_file)
    for source, line in zip(SOURCES, lines):
        for term in g.targets_in(source):
            assert term in line
    summary, _ = cli_ok(capsys, monkeypatch, "summarize", "-m", model_dir, "-i", src, "--glossary", glossary_file)
    assert "Datei" in summary.splitlines()[0]

    bad = tmp_path / "bad.tsv"
    bad.write_text("file\tDatei\nprint drucken\n", encoding="utf-8")
    out2 = tmp_path / "out2.de"
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model_dir, "-i", src, "-o", out2, "--glossary", bad),
                 f"{bad}:2: expected 'source term<TAB>target term', found no tab")
    assert not out2.exists()
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model_dir, "-i", src, "--glossary", tmp_path / "no.tsv"),
                 f"{tmp_path / 'no.tsv'}: no such file")
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model_dir, "-i", src, "--glossary", glossary_file,
                     "--sampling"), "decode.glossary: constrains searched hypotheses")
