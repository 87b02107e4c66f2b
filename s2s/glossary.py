"""A glossary: source terms and the target terms their translations must contain.

The file (``--glossary FILE``, ``decode.glossary``) is UTF-8, one entry a line:

    source term<TAB>target term

Blank lines are skipped; each field is stripped of surrounding spaces.  A
source term occurs in a sentence when it appears there as whole words: the
characters just before and after it are not word characters (``\\w``), and
case counts ("File" is not "file").  Every term of the glossary that occurs in
a sentence is a constraint of that sentence: its translation must contain the
target term's pieces in a row (s2s.constraints enforces that in the search).

This module imports no torch: the CLI checks a glossary before any model loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from s2s.errors import S2SError
from s2s.textio import decode_line, iter_binary_lines

WORD = re.compile(r"\w+")


def whole_word_pattern(term: str) -> re.Pattern:
    """``term`` as whole words: (?<!\\w) term (?!\\w)."""
    return re.compile(r"(?<!\w)" + re.escape(term) + r"(?!\w)")


@dataclass(frozen=True)
class Glossary:
    """source term -> target term, with the index that finds a sentence's terms quickly."""

    terms: Mapping[str, str]  # source term -> target term, in file order
    where: str = "glossary"  # the file (or request) it came from, for messages
    _by_word: dict = field(default_factory=dict, compare=False, repr=False)  # first word -> [(term, pattern)]

    def __post_init__(self) -> None:
        for source in self.terms:
            words = WORD.findall(source)
            key = words[0] if words else ""  # a term of no word characters is tried on every sentence
            self._by_word.setdefault(key, []).append((source, whole_word_pattern(source)))

    def __len__(self) -> int:
        return len(self.terms)

    def targets_in(self, sentence: str) -> list[str]:
        """The target terms of the source terms that occur in ``sentence`` (whole words),
        in glossary order, each once."""
        words = set(WORD.findall(sentence)) | {""}
        found = {source for w in words for source, pattern in self._by_word.get(w, ())
                 if pattern.search(sentence)}
        targets = [self.terms[source] for source in self.terms if source in found]
        return list(dict.fromkeys(targets))

    def merged(self, other: Mapping[str, str], where: str) -> "Glossary":
        """This glossary with ``other``'s entries added (``other`` wins on a shared source term)."""
        return Glossary({**self.terms, **other}, where)


def check_entry(source: str, target: str, where: str) -> tuple[str, str]:
    """One entry, stripped; an empty term is an error naming ``where``."""
    source, target = source.strip(), target.strip()
    if not source:
        raise S2SError(f"{where}: empty source term")
    if not target:
        raise S2SError(f"{where}: empty target term for {source!r}")
    return source, target


def parse_glossary_line(line: str, where: str) -> tuple[str, str]:
    """``source term<TAB>target term`` -> (source, target); anything else names ``where``."""
    fields = line.split("\t")
    if len(fields) != 2:
        found = "no tab" if len(fields) == 1 else f"{len(fields)} tab-separated fields"
        raise S2SError(f"{where}: expected 'source term<TAB>target term', found {found}")
    return check_entry(*fields, where)


def load_glossary(path: str | Path) -> Glossary:
    """Read a glossary file (see the module docstring).  Errors name the file and line:
    a line without exactly one tab, an empty term, a source term given two different
    targets, invalid UTF-8; a file with no entries is an error too."""
    p = Path(path)
    if p.is_dir():
        raise S2SError(f"{p}: is a directory, expected a glossary file (source term<TAB>target term)")
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise S2SError(f"{p}: no such file") from None
    except PermissionError:
        raise S2SError(f"{p}: permission denied") from None
    terms: dict[str, str] = {}
    first_line: dict[str, int] = {}
    with f:
        for n, raw in enumerate(iter_binary_lines(f, str(p)), 1):
            line = decode_line(raw, str(p), n)
            if not line.strip():
                continue
            source, target = parse_glossary_line(line, f"{p}:{n}")
            if source in terms and terms[source] != target:
                raise S2SError(f"{p}:{n}: source term {source!r} is already translated as "
                               f"{terms[source]!r} (line {first_line[source]})")
            terms.setdefault(source, target)
            first_line.setdefault(source, n)
    if not terms:
        raise S2SError(f"{p}: no glossary entries (expected lines 'source term<TAB>target term')")
    return Glossary(terms, str(p))
