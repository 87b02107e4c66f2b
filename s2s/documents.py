"""Documents: paragraphs translated sentence by sentence, inline markup carried through alignments.

``decode.split_sentences`` (``--split-sentences``) splits each input line (a paragraph) into
sentences with sentencex, by the rules of the model's source language (data.src_lang; English
rules where that names no language), translates every sentence of the chunk in one batch and
joins each line's translations again (with a space; with nothing for a target language written
without spaces), so a line stays one output line.

``decode.markup`` (``--markup``) takes simple inline tags out of each line before translation and
puts them back into the translation where the model's alignment says their words went.  Glossary:

    P           the plain text of a line: the line with its tags taken out
    element     a tag pair <b>...</b> over the span [s, e) of P, or a self-closing <br/> at s = e;
                elements nest as a tree (children inside their parent, siblings in order)
    x_1..x_S    the source tokens of a line (its sentences' tokens one after another, each
                sentence's </s> left out); x_j covers the characters [a_j, b_j) of P
    y_1..y_T    the target tokens, y_t covering [c_t, d_t) of the output text
    a(t)        the source token y_t is aligned to: argmax_j A_tj of the last decoder layer's
                cross-attention (s2s.translate.hard_alignment)

An element over [s, e) goes to the target tokens aligned to the source tokens it overlaps,

    J = {j : [a_j, b_j) ∩ [s, e) ≠ ∅},    T_e = {t : a(t) ∈ J},    span = [min T_e, max T_e + 1),

an element with no such token (a <br/>, an empty pair, words nothing aligned to) to the point
before the first target token aligned to the first source token at or after s (the end when
there is none).  Then, top down, each span is clamped inside its parent's and after its
previous sibling's end (:func:`clamp_markup`), so the output holds every tag of the input, in
the input's order and nesting: well-formed whatever the alignment says.  A line whose markup
does not parse (a tag never closed, a close that matches no open tag, crossing pairs, a ``<``
that starts no tag) is translated as it is, tags and all, with a warning naming the line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from s2s.errors import S2SError
from s2s.hypotheses import Hypothesis, Translation, length_penalty
from s2s.textio import line_numbers

if TYPE_CHECKING:
    from s2s.translate import Translator

log = logging.getLogger("s2s")

SPLITTER_MISSING = ("--split-sentences (decode.split_sentences) needs the sentencex package: "
                    "pip install 's2s[documents]' (or pip install sentencex)")

# A tag: <name attr="v" attr='v' attr=v flag>, </name>, <name/>; names as XML writes them
TAG = re.compile(r"""<(?P<slash>/)?(?P<name>[A-Za-z][\w.:-]*)"""
                 r"""(?P<attrs>(?:\s+[^\s=<>/"']+(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'<>=`]+))?)*)"""
                 r"""\s*(?P<empty>/)?>""")
TAG_START = re.compile(r"</?[A-Za-z]")  # what a tag begins with: anything else with < is text
VOID = frozenset({"br", "hr", "img", "wbr"})  # HTML's inline void elements: <br> needs no slash
NO_SPACES = frozenset({"zh", "ja", "th", "lo", "km", "my", "bo", "yue", "zho", "jpn", "tha", "lao", "khm", "mya"})
NOT_LANGUAGES = frozenset({"src", "tgt", "doc", "sum"})  # s2s's default data.src_lang/tgt_lang names


class MarkupError(ValueError):
    """A line's markup does not parse; the message says where (1-based columns)."""


@dataclass(frozen=True)
class Element:
    """A tag pair (or one self-closing tag) over the span [start, end) of a text."""

    open: str  # the opening tag as written, e.g. '<a href="x">'; a self-closing tag: all of it
    close: str  # '</a>'; '' for a self-closing tag
    start: int
    end: int  # == start for a self-closing tag
    children: tuple["Element", ...] = ()


@dataclass(frozen=True)
class Markup:
    text: str  # P: the line with its tags taken out
    elements: tuple[Element, ...]  # the top-level elements, in order, spans in P


# --------------------------------------------------------------------------- #
# Markup: parse, project, clamp, render (pure functions)
# --------------------------------------------------------------------------- #

def parse_markup(line: str) -> Markup:
    """Take the inline tags out of ``line``: P and the tree of elements with their spans in P.

    Tags are <name ...>...</name> (names compared case-insensitively, attributes kept as
    written), <name/>, and HTML's <br>, <hr>, <img>, <wbr> without a slash.  A self-closing
    tag between two non-space characters becomes a space in P ("one<br/>two": "one two") so
    the words stay apart.  Raises :class:`MarkupError` on a close without its open, crossing
    pairs, a tag never closed, or a ``<name`` that does not end as a tag.
    """
    parts: list[str] = []  # the pieces of P
    n = 0  # len(P) so far
    # each open element: (name, opening text, start in P, column, its children so far)
    stack: list[tuple[str, str, int, int, list[Element]]] = [("", "", 0, 0, [])]
    pos = 0
    for found in TAG_START.finditer(line):
        at = found.start()
        if at < pos:  # inside a tag already read (a quoted attribute value)
            continue
        tag = TAG.match(line, at)
        if tag is None:
            raise MarkupError(f"column {at + 1}: {_excerpt(line, at)} is not a well-formed tag")
        parts.append(line[pos:at])
        n += at - pos
        pos = tag.end()
        name, text = tag.group("name"), tag.group(0)
        if tag.group("slash"):
            if tag.group("attrs") or tag.group("empty"):
                raise MarkupError(f"column {at + 1}: {text} is not a well-formed closing tag")
            if len(stack) == 1:
                raise MarkupError(f"column {at + 1}: {text} closes no open tag")
            open_name, open_text, start, column, children = stack.pop()
            if open_name.lower() != name.lower():
                raise MarkupError(f"column {at + 1}: {text} closes {open_text} of column {column}")
            stack[-1][4].append(Element(open_text, text, start, n, tuple(children)))
        elif tag.group("empty") or name.lower() in VOID:
            stack[-1][4].append(Element(text, "", n, n))
            before = next((part[-1] for part in reversed(parts) if part), "")  # P's last character
            after = line[pos:pos + 1]
            if before and not before.isspace() and after and not after.isspace():
                parts.append(" ")
                n += 1
        else:
            stack.append((name, text, n, at + 1, []))
    if len(stack) > 1:
        _, open_text, _, column, _ = stack[-1]
        raise MarkupError(f"column {column}: {open_text} is never closed")
    parts.append(line[pos:])
    return Markup("".join(parts), tuple(stack[0][4]))


def _excerpt(line: str, at: int) -> str:
    end = line.find(">", at)
    return repr(line[at:end + 1] if 0 <= end - at < 40 else line[at:at + 20] + "...")


def clamp_markup(elements: Sequence[Element], lo: int, hi: int) -> tuple[Element, ...]:
    """Make spans nest: each element's [start, end) is clamped into [lo, hi) after its previous
    sibling's end, start <= end, and its children the same way into its own span:

        start_i = min(max(start_i, end_{i-1}), hi),   end_i = min(max(end_i, start_i), hi),   end_0 = lo.
    """
    out, floor = [], lo
    for el in elements:
        start = min(max(el.start, floor), hi)
        end = min(max(el.end, start), hi)
        out.append(replace(el, start=start, end=end, children=clamp_markup(el.children, start, end)))
        floor = end
    return tuple(out)


def project_markup(elements: Sequence[Element], src_spans: Sequence[tuple[int, int]],
                   alignment: Sequence[tuple[int, int]], tgt_len: int) -> tuple[Element, ...]:
    """The elements' spans moved from source characters to target tokens [t0, t1), 0 <= t0 <= t1 <= T.

    ``src_spans``: [a_j, b_j) of each source token x_j in P (an empty span: a token of no text);
    ``alignment``: Pharaoh pairs (j, t); ``tgt_len``: T.  An element over [s, e) goes to
    [min T_e, max T_e + 1), T_e = {t : a(t) ∈ J}, J = {j : [a_j, b_j) ∩ [s, e) ≠ ∅}; one with
    T_e empty to the point before the first target token aligned to the first source token at
    or after s (T when there is none); then :func:`clamp_markup` into [0, T].
    """
    aligned: dict[int, list[int]] = defaultdict(list)  # j -> the t aligned to it
    for j, t in alignment:
        if 0 <= t < tgt_len:
            aligned[j].append(t)

    def point(s: int) -> int:
        after = [min(aligned[j]) for j, (a, b) in enumerate(src_spans) if b > a and a >= s and aligned[j]]
        return after[0] if after else tgt_len

    def walk(level: Sequence[Element]) -> tuple[Element, ...]:
        out = []
        for el in level:
            T_e = [t for j, (a, b) in enumerate(src_spans) if a < el.end and b > el.start and b > a
                   for t in aligned[j]] if el.end > el.start else []
            t0, t1 = (min(T_e), max(T_e) + 1) if T_e else (point(el.start),) * 2
            out.append(replace(el, start=t0, end=t1, children=walk(el.children)))
        return tuple(out)

    return clamp_markup(walk(elements), 0, tgt_len)


def markup_to_chars(elements: Sequence[Element], tgt_spans: Sequence[tuple[int, int]],
                    n_chars: int) -> tuple[Element, ...]:
    """Token spans [t0, t1) -> character spans of the output text: [c_t0, d_(t1-1)) for a
    non-empty span (the tags hug the words, whitespace stays outside), the end of the token
    before, d_(t0-1), for a point (0 at the start); then clamped again in characters."""
    def walk(level: Sequence[Element]) -> tuple[Element, ...]:
        out = []
        for el in level:
            if el.end > el.start:
                start, end = tgt_spans[el.start][0], tgt_spans[el.end - 1][1]
            else:
                start = end = tgt_spans[el.start - 1][1] if el.start > 0 else 0
            out.append(replace(el, start=start, end=end, children=walk(el.children)))
        return tuple(out)

    return clamp_markup(walk(elements), 0, n_chars)


def render_markup(text: str, elements: Sequence[Element], lo: int = 0, hi: Optional[int] = None) -> str:
    """``text`` with the elements' tags written around their (nested, ordered) character spans;
    ``render_markup(m.text, m.elements)`` of a :func:`parse_markup` result gives back its line
    (but for the space a self-closing tag between two words leaves)."""
    hi = len(text) if hi is None else hi
    out, pos = [], lo
    for el in elements:
        out += [text[pos:el.start], el.open, render_markup(text, el.children, el.start, el.end), el.close]
        pos = el.end
    out.append(text[pos:hi])
    return "".join(out)


# --------------------------------------------------------------------------- #
# Characters of tokens (pure functions)
# --------------------------------------------------------------------------- #

def piece_spans(prefixes: Sequence[str]) -> list[tuple[int, int]]:
    """The character span of each token in the text of all of them, from the texts of the
    token prefixes: ``prefixes[k]`` = decode(tokens[:k]), k = 0..n.  Token k covers
    [B_k, B_(k+1)), B_k = the length of the common beginning of prefixes[k] and prefixes[n]
    (a running maximum, so a prefix that ends inside a character moves nothing), with its
    whitespace at both ends left out."""
    full = prefixes[-1]
    bounds, best = [], 0
    for p in prefixes:
        best = max(best, len(os.path.commonprefix([p, full])))
        bounds.append(best)
    spans = []
    for a, b in zip(bounds, bounds[1:]):
        while a < b and full[a].isspace():
            a += 1
        while b > a and full[b - 1].isspace():
            b -= 1
        spans.append((a, b))
    return spans


def char_map(a: str, b: str) -> list[int]:
    """For each position i = 0..len(a) of ``a``, the matching position of ``b``: inside a block
    that difflib matches, the same offset into its copy in b; in an unmatched stretch, the end
    of the block before.  Monotone, f(len(a)) = len(b).  (``a``: the decoded source tokens;
    ``b``: the text they came from, which normalization may have changed.)"""
    blocks = SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()  # ends in (len(a), len(b), 0)
    starts = [blk.a for blk in blocks]
    out = []
    for i in range(len(a) + 1):
        k = bisect_right(starts, i) - 1
        out.append(0 if k < 0 else blocks[k].b + min(i - blocks[k].a, blocks[k].size))
    out[-1] = len(b)
    return out


def trim(text: str, start: int, end: int) -> tuple[int, int]:
    """[start, end) without the whitespace at either end (str.strip's whitespace)."""
    piece = text[start:end]
    lead = len(piece) - len(piece.lstrip())
    return start + lead, start + len(piece.rstrip()) if piece.strip() else start + lead


# --------------------------------------------------------------------------- #
# Sentences and languages
# --------------------------------------------------------------------------- #

def language_code(name: str) -> str:
    """The code the sentence splitter takes for a data.src_lang/tgt_lang name: its letters
    before any - or _, lower-cased (de, de_DE, en_XX, eng_Latn -> de, de, en, eng); en for a
    name that is no language code (s2s's defaults src, tgt, doc, sum)."""
    base = re.split(r"[-_]", name.strip())[0].lower()
    return base if re.fullmatch(r"[a-z]{2,3}", base) and base not in NOT_LANGUAGES else "en"


def joiner(tgt_lang: str) -> str:
    """What goes between a paragraph's translated sentences: nothing for a target language
    written without spaces between sentences (Chinese, Japanese, Thai, ...), else one space."""
    return "" if language_code(tgt_lang) in NO_SPACES else " "


def require_splitter() -> None:
    """One error line when sentencex is not installed."""
    try:
        import sentencex  # noqa: F401
    except ImportError:
        raise S2SError(SPLITTER_MISSING) from None


def sentence_spans(text: str, language: str) -> list[tuple[int, int]]:
    """The sentences of ``text`` as character spans, in order, whitespace trimmed, by sentencex's
    rules for ``language`` (an ISO 639 code, see :func:`language_code`)."""
    try:
        from sentencex import segment
    except ImportError:
        raise S2SError(SPLITTER_MISSING) from None
    return locate_sentences([str(s) for s in segment(language, text)], text)


def locate_sentences(sentences: Sequence[str], text: str) -> list[tuple[int, int]]:
    """The spans of ``sentences`` (a splitter's output, in order) in ``text``, each trimmed.  If
    one is not found where the last ended, or text outside them is more than whitespace (the
    splitter changed or dropped something), the whole trimmed text is one sentence: nothing
    is lost."""
    spans, pos = [], 0
    for s in sentences:
        s = s.strip()
        if not s:
            continue
        i = text.find(s, pos)
        if i < 0 or text[pos:i].strip():
            spans = []
            break
        spans.append((i, i + len(s)))
        pos = i + len(s)
    if not spans or text[pos:].strip():
        whole = trim(text, 0, len(text))
        return [whole] if whole[1] > whole[0] else []
    return spans


# --------------------------------------------------------------------------- #
# Translating paragraphs
# --------------------------------------------------------------------------- #

@dataclass
class Paragraph:
    """One input line as translated: the text the model reads, its sentences, its markup."""

    line_no: int
    text: str  # the line, or with markup its P
    sentences: list[tuple[int, int]]  # spans in text
    elements: tuple[Element, ...] = ()  # its markup (spans in text); () without
    src_spans: list[tuple[int, int]] = field(default_factory=list)  # [a_j, b_j) of each source token


def read_paragraph(line: str, line_no: int, split: bool, markup: bool, language: str) -> Paragraph:
    """A line's text, sentences and markup (a line whose markup does not parse: its text as it
    is, with a warning naming the line)."""
    text, elements = line, ()
    if markup and TAG_START.search(line):
        try:
            parsed = parse_markup(line)
            text, elements = parsed.text, parsed.elements
        except MarkupError as e:
            log.warning("line %d: markup: %s; translated as plain text", line_no, e)
    if split:
        sentences = sentence_spans(text, language)
    else:
        whole = trim(text, 0, len(text))
        sentences = [whole] if whole[1] > whole[0] else []
    return Paragraph(line_no, text, sentences, elements)


@contextlib.contextmanager
def aligning(translator: "Translator", on: bool) -> Iterator[None]:
    """While the block runs, the translator also aligns its hypotheses (when ``on``)."""
    before = translator.alignments
    translator.alignments = before or on
    try:
        yield
    finally:
        translator.alignments = before


def source_spans(translator: "Translator", ids: Sequence[int], text: str) -> list[tuple[int, int]]:
    """[a_j, b_j) in ``text`` of each source token id (a sentence's ids without its </s>);
    special tokens, and tokens whose text is not in ``text``, get an empty span."""
    tok = translator.tok
    pieces = ["" if i in tok.specials else tok.piece(i, "src") for i in ids]
    decoded = [tok.src.decode_pieces([p for p in pieces[:k] if p]) for k in range(len(pieces) + 1)]
    to_text = char_map(decoded[-1], text)
    return [(to_text[a], to_text[b]) for a, b in piece_spans(decoded)]


def translate_paragraphs(translator: "Translator", lines: Sequence[str], first_line_no: int | Sequence[int] = 1,
                         prefixes: Optional[Sequence[str]] = None, glossary=None) -> list["Translation"]:
    """``Translator.translate_chunk`` with decode.split_sentences or decode.markup: every sentence
    of every line in one ``translate_sentences`` call (sorted into batches as usual), then one
    Translation per line (see :func:`join_paragraph`).  A prefix (``--prefix-file``) forces the
    start of its line's first sentence; ``glossary`` (default: decode.glossary's) holds for each
    sentence.  ``first_line_no``: the first line's number, or each line's."""
    decode = translator.decode
    src_lang = language_code(translator.languages[0])
    paragraphs = [read_paragraph(line, no, decode.split_sentences, decode.markup, src_lang)
                  for line, no in zip(lines, line_numbers(first_line_no, len(lines)))]
    texts, line_nos, firsts = [], [], []
    for i, p in enumerate(paragraphs):
        for k, (s, e) in enumerate(p.sentences):
            texts.append(p.text[s:e])
            line_nos.append(p.line_no)
            firsts.append(prefixes[i] if prefixes is not None and k == 0 else "")
    tagged = any(p.elements and p.sentences for p in paragraphs)
    with aligning(translator, tagged):
        given = {} if glossary is None else {"glossary": glossary}  # the torch-free search takes none
        found = translator.translate_sentences(texts, line_nos, None if prefixes is None else firsts, **given)
    need_ids = tagged or translator.alignments
    ids = translator.encode_lines(texts, line_nos) if need_ids else [None] * len(texts)
    out, pos = [], 0
    for p in paragraphs:
        k = len(p.sentences)
        sentence_ids = ids[pos:pos + k]
        if p.elements:
            p.src_spans = [(s + a, s + b) for (s, e), x in zip(p.sentences, sentence_ids)
                           for a, b in source_spans(translator, x[:-1], p.text[s:e])]
        out.append(join_paragraph(translator, p, found[pos:pos + k],
                                  [len(x) - 1 if x is not None else 0 for x in sentence_ids]))
        pos += k
    if tagged and not translator.alignments:  # aligned for the markup only: not kept
        for h in (h for t in out for h in t.hypotheses):
            h.alignment = None
    return out


def join_paragraph(translator: "Translator", p: Paragraph, sentences: Sequence["Translation"],
                   src_lens: Sequence[int]) -> "Translation":
    """One Translation of a line from its sentences' (``src_lens``: each one's source tokens).

    Hypothesis k of the line joins hypothesis k of each sentence (a sentence with fewer: its
    last), scored (when there are several) as one hypothesis of all their tokens, each </s>
    counted: score = Σ log p / lp(Σ m), and the joined ones are ordered by that score; its
    alignment indexes the sentences' source and target tokens one after another.  With markup,
    the tags are projected through that alignment (:func:`project_markup`) into each
    hypothesis's text."""
    if not sentences and not p.elements:
        return Translation(p.line_no, [], [])
    if len(sentences) == 1 and not p.elements:
        return sentences[0]
    if not sentences:  # markup around no words: the tags alone
        text = render_markup("", clamp_markup(p.elements, 0, 0))
        return Translation(p.line_no, [Hypothesis([], 0.0, 0.0, [] if translator.alignments else None)], [text])
    decode, tok, sep = translator.decode, translator.tok, joiner(translator.languages[1])
    hyps, texts = [], []
    for k in range(max(len(s.hypotheses) for s in sentences)):
        text, tokens, alignment, tgt_spans = "", [], [], []
        log_prob, m, src_offset = 0.0, 0, 0
        for s, src_len in zip(sentences, src_lens):
            h = s.hypotheses[min(k, len(s.hypotheses) - 1)]
            piece = s.texts[min(k, len(s.texts) - 1)]
            if piece and text:
                text += sep
            if p.elements:
                decoded = [tok.decode_tgt(h.tokens[:n]) for n in range(len(h.tokens) + 1)]
                tgt_spans += [(len(text) + a, len(text) + b) for a, b in piece_spans(decoded)]
            alignment += [(j + src_offset, t + len(tokens)) for j, t in h.alignment or []]
            text += piece
            tokens += h.tokens
            log_prob += h.log_prob
            m += len(h.tokens) + 1
            src_offset += src_len
        if p.elements:
            projected = project_markup(p.elements, p.src_spans, alignment, len(tokens))
            text = render_markup(text, markup_to_chars(projected, tgt_spans, len(text)))
        score = h.score if len(sentences) == 1 else log_prob / length_penalty(m, decode.alpha, decode.length_penalty)
        hyps.append(Hypothesis(tokens, score, log_prob, alignment if translator.alignments else None, m=m))
        texts.append(text)
    order = sorted(range(len(hyps)), key=lambda k: -hyps[k].score)  # rows best first, as a sentence's are
    return Translation(p.line_no, [hyps[k] for k in order], [texts[k] for k in order])
