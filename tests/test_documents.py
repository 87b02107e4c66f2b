"""Documents (s2s.documents): sentence splitting and inline markup carried through alignments.

The markup functions are tested on synthetic alignments (exact spans, tag order and nesting);
the translator tests use an untrained tiny model, whose outputs are whatever its random
weights say: what is checked is what must hold for any output.
"""

import io
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from s2s.cli import app
from s2s.documents import (
    TAG,
    Element,
    MarkupError,
    char_map,
    clamp_markup,
    joiner,
    language_code,
    locate_sentences,
    markup_to_chars,
    parse_markup,
    piece_spans,
    project_markup,
    render_markup,
    trim,
)
from s2s.errors import S2SError
from tests.conftest import untrained_model_dir

runner = CliRunner()


def tags(text: str) -> list[str]:
    """The tags of a text, in order, as written."""
    return [m.group(0) for m in TAG.finditer(text)]


# --------------------------------------------------------------------------- #
# parse_markup / render_markup
# --------------------------------------------------------------------------- #

def test_parse_takes_the_tags_out_and_keeps_their_spans():
    m = parse_markup('Click <a href="/x?a=1&b=2">the <b>red</b> button</a> now.')
    assert m.text == "Click the red button now."
    (a,) = m.elements
    assert (a.open, a.close, m.text[a.start:a.end]) == ('<a href="/x?a=1&b=2">', "</a>", "the red button")
    (b,) = a.children
    assert (b.open, b.close, m.text[b.start:b.end]) == ("<b>", "</b>", "red")


def test_self_closing_tags_are_points_and_keep_words_apart():
    m = parse_markup("one<br/>two <img src='a.png'> three<br>")
    assert m.text == "one two  three"
    assert [(e.open, e.close, e.start, e.end) for e in m.elements] == [
        ("<br/>", "", 3, 3), ("<img src='a.png'>", "", 8, 8), ("<br>", "", 14, 14)]


@pytest.mark.parametrize("line", [
    "plain text, no tags",
    "<b>bold</b> and <i>italic</i>",
    '<p class="x"><a href=\'y\'>link <em>with <b>deep</b> nesting</em></a> tail</p>',
    "a < b > c, x<3, <!-- a comment --> stay text",
    "empty <b></b> pair and <B>case</B> and <ns:tag attr=v>qualified</ns:tag>",
    "  leading and trailing space  <br/>",
])
def test_render_of_a_parse_gives_the_line_back(line):
    m = parse_markup(line)
    assert render_markup(m.text, m.elements) == line
    assert "<b>" not in m.text and "</a>" not in m.text


@pytest.mark.parametrize("line, message", [
    ("<b>never closed", r"column 1: <b> is never closed"),
    ("stray </i> close", r"column 7: </i> closes no open tag"),
    ("<b>crossing <i>pairs</b></i>", r"column 21: </b> closes <i> of column 13"),
    ('<a href="x>broken', r"column 1: .* is not a well-formed tag"),
    ("<b>x</b attr>", r"column 5: </b attr> is not a well-formed closing tag"),
])
def test_malformed_markup_is_an_error_naming_the_column(line, message):
    with pytest.raises(MarkupError, match=message):
        parse_markup(line)


# --------------------------------------------------------------------------- #
# project_markup, clamp_markup, markup_to_chars on synthetic alignments
# --------------------------------------------------------------------------- #

def el(open_, close, start, end, *children):
    return Element(open_, close, start, end, tuple(children))


def spans(elements):
    return [(e.open, e.start, e.end, spans(e.children)) for e in elements]


def test_a_span_goes_to_the_target_tokens_aligned_to_its_words():
    # "the red car" -> "das rote Auto": monotone
    src = [(0, 3), (4, 7), (8, 11)]
    b = el("<b>", "</b>", 4, 7)
    assert spans(project_markup([b], src, [(0, 0), (1, 1), (2, 2)], 3)) == [("<b>", 1, 2, [])]
    # "the red car" -> "la voiture rouge": the tags follow "red" to the end
    assert spans(project_markup([b], src, [(0, 0), (2, 1), (1, 2)], 3)) == [("<b>", 2, 3, [])]
    # a span over two words that land apart covers everything between them
    two = el("<i>", "</i>", 0, 7)
    assert spans(project_markup([two], src, [(0, 0), (2, 1), (1, 2)], 3)) == [("<i>", 0, 3, [])]


def test_siblings_keep_their_order_when_the_translation_swaps_their_words():
    # "<b>A</b> <i>B</i>" translated "B' A'": <i> cannot come first, so it closes up after <b>
    src = [(0, 1), (2, 3)]
    out = project_markup([el("<b>", "</b>", 0, 1), el("<i>", "</i>", 2, 3)], src, [(1, 0), (0, 1)], 2)
    assert spans(out) == [("<b>", 1, 2, []), ("<i>", 2, 2, [])]
    text = render_markup("Bp Ap", markup_to_chars(out, [(0, 2), (3, 5)], 5))
    assert text == "Bp <b>Ap</b><i></i>"
    assert tags(text) == ["<b>", "</b>", "<i>", "</i>"]


def test_a_child_stays_inside_its_parent():
    # <a>x<br/></a> y: the <br/> would go before the translation of y, outside <a>'s words
    src = [(0, 1), (2, 3)]
    tree = [el("<a>", "</a>", 0, 1, el("<br/>", "", 1, 1))]
    out = project_markup(tree, src, [(1, 0), (0, 1)], 2)  # y' x'
    assert spans(out) == [("<a>", 1, 2, [("<br/>", 1, 1, [])])]
    # nested pairs over the same words nest in the output too
    tree = [el("<a>", "</a>", 0, 3, el("<b>", "</b>", 2, 3, el("<i>", "</i>", 2, 3)))]
    out = project_markup(tree, src, [(0, 0), (1, 1)], 2)
    assert spans(out) == [("<a>", 0, 2, [("<b>", 1, 2, [("<i>", 1, 2, [])])])]


def test_a_point_goes_before_the_translation_of_the_next_word():
    src = [(0, 3), (4, 7)]  # "one two" from one<br/>two (the <br/> at 3)
    out = project_markup([el("<br/>", "", 3, 3)], src, [(1, 0), (0, 1)], 2)  # "two' one'"
    assert spans(out) == [("<br/>", 0, 0, [])]
    out = project_markup([el("<br/>", "", 3, 3)], src, [(0, 0), (1, 1)], 2)
    assert spans(out) == [("<br/>", 1, 1, [])]
    # at the end, or before words nothing is aligned to: after the last target token
    assert spans(project_markup([el("<br/>", "", 7, 7)], src, [(0, 0), (1, 1)], 2)) == [("<br/>", 2, 2, [])]
    assert spans(project_markup([el("<b>", "</b>", 4, 7)], src, [(0, 0), (0, 1)], 2)) == [("<b>", 2, 2, [])]


def test_clamp_puts_each_span_inside_its_parent_after_its_sibling():
    tree = [el("<a>", "</a>", 2, 5, el("<b>", "</b>", 0, 3), el("<i>", "</i>", 1, 9)), el("<u>", "</u>", 0, 1)]
    out = clamp_markup(tree, 0, 6)
    assert spans(out) == [("<a>", 2, 5, [("<b>", 2, 3, []), ("<i>", 3, 5, [])]), ("<u>", 5, 5, [])]


def test_tags_hug_the_words_and_whitespace_stays_outside():
    text = "Hallo schöne Welt"
    tgt = piece_spans(["", "Hallo", "Hallo schöne", "Hallo schöne Welt"])
    assert tgt == [(0, 5), (6, 12), (13, 17)]
    out = markup_to_chars([el("<b>", "</b>", 1, 2), el("<br/>", "", 3, 3)], tgt, len(text))
    assert render_markup(text, out) == "Hallo <b>schöne</b> Welt<br/>"
    out = markup_to_chars([el("<br/>", "", 2, 2)], tgt, len(text))  # a point sits after the word before it
    assert render_markup(text, out) == "Hallo schöne<br/> Welt"


@st.composite
def marked_lines(draw):
    """A line of single-letter words with random well-formed nested markup."""
    words = draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=6))
    names = ["b", "i", "a", "em", "span"]

    def fragment(depth):
        parts = []
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["word", "word", "pair", "br"] if depth < 3 else ["word", "br"]))
            if kind == "word":
                parts.append(words[draw(st.integers(0, len(words) - 1))])
            elif kind == "br":
                parts.append("<br/>")
            else:
                n = draw(st.sampled_from(names))
                parts.append(f"<{n}>{fragment(depth + 1)}</{n}>")
        return " ".join(parts)

    return fragment(0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(line=marked_lines(), alignment=st.lists(st.integers(0, 9), max_size=9))
def test_any_alignment_gives_well_formed_output_with_the_tags_in_order(line, alignment):
    """Whatever the alignment: every tag of the input, in the input's order, well-formed."""
    m = parse_markup(line)
    src = [(w.start(), w.end()) for w in re.finditer(r"\S+", m.text)]
    T = len(alignment)
    pairs = [(j % len(src), t) for t, j in enumerate(alignment)] if src else []
    projected = project_markup(m.elements, src, pairs, T)
    out_text = " ".join(f"w{t}" for t in range(T))
    tgt = piece_spans([" ".join(f"w{t}" for t in range(k)) for k in range(T + 1)])
    out = render_markup(out_text, markup_to_chars(projected, tgt, len(out_text)))
    assert tags(out) == tags(line)  # the same tags in the same order ...
    parse_markup(out)  # ... and well-formed, so nested as in the line
    assert re.sub(r"<[^>]*>", "", out).replace(" ", "") == out_text.replace(" ", "")


# --------------------------------------------------------------------------- #
# characters of tokens, sentences, languages
# --------------------------------------------------------------------------- #

def test_piece_spans_leave_out_whitespace_and_half_characters():
    assert piece_spans(["", "Hello", "Hello wor", "Hello world", "Hello world."]) == [
        (0, 5), (6, 9), (9, 11), (11, 12)]
    # a byte-level prefix that ends inside a character decodes to U+FFFD: no characters for it yet
    assert piece_spans(["", "\ufffd", "ü", "ü!"]) == [(0, 0), (0, 1), (1, 2)]


def test_char_map_follows_the_text_through_normalization():
    f = char_map("Hello world", "Hello  world")  # whitespace collapsed by the tokenizer's normalizer
    assert f[0] == 0 and f[5] == 5 and f[6] == 7 and f[11] == 12
    f = char_map("<2de> Hi", "Hi")  # a token of no text of the line
    assert f[0] == 0 and f[6] == 0 and f[8] == 2


def test_trim():
    assert trim("  ab c ", 0, 7) == (2, 6)
    assert trim("   ", 0, 3)[0] == trim("   ", 0, 3)[1]


def test_locate_sentences_loses_nothing():
    text = "First one.  Second one? Third"
    assert locate_sentences(["First one. ", "Second one? ", "Third"], text) == [(0, 10), (12, 23), (24, 29)]
    # a splitter that rewrote or dropped text: the whole text is one sentence
    assert locate_sentences(["First one.", "Third"], text) == [(0, 29)]
    assert locate_sentences(["First  one."], "First one. x") == [(0, 12)]
    assert locate_sentences([], "   ") == []


def test_language_codes_and_joining():
    assert [language_code(x) for x in ("de", "de_DE", "en_XX", "eng_Latn", "src", "doc", "EN-us")] == [
        "de", "de", "en", "eng", "en", "en", "en"]
    assert joiner("de") == " " and joiner("zh") == "" and joiner("ja_XX") == "" and joiner("tgt") == " "


def test_joined_nbest_rows_are_ordered_by_their_own_score():
    """Row k joins each sentence's k-th hypothesis; its score Σ log p / lp(Σ m) can beat row k-1's."""
    from types import SimpleNamespace

    from s2s.config import DecodeConfig
    from s2s.documents import Paragraph, join_paragraph
    from s2s.hypotheses import Hypothesis, Translation, length_penalty

    translator = SimpleNamespace(decode=DecodeConfig(beam=2, nbest=2), tok=None, languages=("en", "de"),
                                 alignments=False)
    first = Translation(1, [Hypothesis([5], -1.0, -1.0), Hypothesis([5, 6, 7, 8], -1.1, -1.2)], ["a", "a b c d"])
    second = Translation(1, [Hypothesis([5], -3.0, -3.0), Hypothesis([5, 6], -2.5, -2.0)], ["x", "x y"])
    joined = join_paragraph(translator, Paragraph(1, "A. B.", [(0, 2), (3, 5)]), [first, second], [2, 2])
    assert joined.texts == ["a b c d x y", "a x"]
    assert [h.score for h in joined.hypotheses] == pytest.approx(
        [-3.2 / length_penalty(8, 0.6, "gnmt"), -4.0 / length_penalty(4, 0.6, "gnmt")])


# --------------------------------------------------------------------------- #
# through the Translator and the CLI
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory):
    """An untrained model directory of the tiny en-de config."""
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("documents") / "model")


PARAGRAPHS = ["Clipboard management. Port scanner for discovering services.", "",
              "Only one sentence here", "A tool for <b>clipboard</b> management. It scans <i>ports</i>."]


def test_split_sentences_translates_each_sentence_and_rejoins_them(model_dir):
    pytest.importorskip("sentencex")
    from s2s.translate import Translator

    plain = Translator.from_dirs([model_dir], "cpu", decode={"beam": 2})
    split = Translator.from_dirs([model_dir], "cpu", decode={"beam": 2, "split_sentences": True})
    assert split.languages == ("en", "de")
    lines = PARAGRAPHS[:3]
    sentences = ["Clipboard management.", "Port scanner for discovering services.", "Only one sentence here"]
    alone = plain.translate_sentences(sentences)  # the same batch as the split run's
    texts = [t.text for t in alone]
    out = list(split.translate_lines(lines))
    assert [t.line_no for t in out] == [1, 2, 3]
    assert [t.text for t in out] == [" ".join(x for x in texts[:2] if x), "", texts[2]]
    h, (a, b) = out[0].hypotheses[0], (t.hypotheses[0] for t in alone[:2])
    assert h.tokens == a.tokens + b.tokens and h.log_prob == pytest.approx(a.log_prob + b.log_prob)


def test_a_glossary_given_with_the_call_holds_for_split_sentences(model_dir):
    """`s2s serve`'s request glossary reaches each sentence of a --split-sentences paragraph."""
    pytest.importorskip("sentencex")
    from s2s.glossary import Glossary
    from s2s.translate import Translator

    split = Translator.from_dirs([model_dir], "cpu", decode={"beam": 2, "split_sentences": True})
    line = "Clipboard management. Port scanner for discovering services."
    plain = split.translate_chunk([line])[0].text
    kept = split.translate_chunk([line], glossary=Glossary({"Port scanner": "Portscanner"}, "request"))[0].text
    assert "Portscanner" in kept and "Portscanner" not in plain


def test_markup_keeps_every_tag_in_order_through_the_translator(model_dir):
    pytest.importorskip("sentencex")
    from s2s.translate import Translator

    lines = ["<b>Clipboard</b> management", '<a href="x">Port <i>scanner</i></a> for <br/>services.',
             "no tags at all", "<b>broken markup", "<br/>", PARAGRAPHS[3]]
    for decode in ({"markup": True}, {"markup": True, "split_sentences": True, "nbest": 2}):
        translator = Translator.from_dirs([model_dir], "cpu", decode={"beam": 2, **decode})
        out = list(translator.translate_lines(lines))
        assert len(out) == len(lines)
        for line, t in zip(lines, out):
            assert len(t.texts) == len(t.hypotheses)
            for text in t.texts:
                if line == "<b>broken markup":  # translated as plain text: whatever the model makes of it
                    continue
                assert tags(text) == tags(line), (line, text)
                parse_markup(text)  # well-formed
        assert out[4].text == "<br/>"
        assert all(h.alignment is None for t in out for h in t.hypotheses)  # not asked for: not kept


def test_markup_warns_about_a_line_it_cannot_parse(model_dir, caplog):
    from s2s.translate import Translator

    translator = Translator.from_dirs([model_dir], "cpu", decode={"markup": True, "beam": 1})
    with caplog.at_level("WARNING", logger="s2s"):
        list(translator.translate_lines(["fine", "<b>never closed"]))
    assert "line 2: markup: column 1: <b> is never closed; translated as plain text" in caplog.text


def test_translate_cli_markup_and_split_sentences_one_line_per_line(model_dir, tmp_path):
    pytest.importorskip("sentencex")
    src = tmp_path / "doc.txt"
    src.write_text("\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    out = tmp_path / "doc.out"
    r = runner.invoke(app, ["translate", "-m", str(model_dir), "-i", str(src), "-o", str(out), "--device", "cpu",
                            "--workers", "1", "--beam", "2", "--split-sentences", "--markup"])
    assert r.exit_code == 0, r.output
    got = out.read_text(encoding="utf-8").split("\n")
    assert len(got) == len(PARAGRAPHS) + 1 and got[-1] == "" and got[1] == ""
    assert tags(got[3]) == ["<b>", "</b>", "<i>", "</i>"]
    r = runner.invoke(app, ["translate", "-m", str(model_dir), "-i", str(src), "--device", "cpu", "--workers", "1",
                            "--beam", "2", "--split-sentences", "--markup", "--alignments"])
    assert r.exit_code == 0, r.output
    rows = r.stdout.splitlines()
    assert len(rows) == len(PARAGRAPHS) and rows[0].split(" ||| ")[0] == got[0]
    assert re.fullmatch(r"( ?\d+-\d+)*", rows[0].split(" ||| ")[1])


def test_split_sentences_with_two_workers_writes_what_one_process_writes(model_dir):
    pytest.importorskip("sentencex")
    from s2s.workers import TranslatorSpec, translate_stream

    spec = TranslatorSpec((str(model_dir),), {"beam": 2, "split_sentences": True, "markup": True},
                          device="cpu", threads=1)
    lines = PARAGRAPHS * 2
    outs = []
    for workers in (1, 2):
        buf = io.StringIO()
        translate_stream(spec, lines, buf, workers=workers, chunk_lines=3)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    assert outs[0].count("\n") == len(lines)


def test_split_sentences_without_sentencex_is_one_error_line(model_dir, monkeypatch):
    import sys

    from s2s.translate import Translator

    monkeypatch.setitem(sys.modules, "sentencex", None)  # import sentencex raises ImportError
    with pytest.raises(S2SError, match=r"needs the sentencex package: pip install 's2s\[documents\]'"):
        Translator.from_dirs([model_dir], "cpu", decode={"split_sentences": True})


def test_markup_needs_cross_attention():
    from s2s.config import DecodeConfig, ModelConfig, check_arch_supports

    with pytest.raises(S2SError, match="decode.markup: places tags by the cross-attention"):
        check_arch_supports(ModelConfig(arch="decoder_only"), DecodeConfig(markup=True))
