"""Multilingual models: which language tokens a model has and where they go.

One model serves many directions when its input says which language to write
(Johnson et al. 2017).  The model's tokenizer keeps its language tokens whole
in any input, and ``tokenizer.lang_scheme`` says where they go:

    scheme       source ids                          target ids (forced first)   models
    target_tag   <2de> x_1 .. x_n </s>               -                           s2s data.pairs, Marian >>de<<
    mbart        x_1 .. x_n </s> en_XX               de_DE                       mBART (cc25)
    m2m100       __en__ x_1 .. x_n </s>              __de__                      M2M100, NLLB, mBART-50

``--tgt-lang X`` (``decode.tgt_lang``) names the target: a token exactly
(``>>de<<``, ``de_DE``, ``deu_Latn``), the code inside it (``de`` for ``<2de>``,
``>>de<<`` and ``__de__``), or the part before its ``_`` when that is one token
only (``de`` for ``de_DE``; ``deu`` for ``deu_Latn``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from s2s.errors import S2SError

# tokens that name a language in the families s2s imports: >>de<< (Marian), __de__ (M2M100),
# de_DE (mBART), deu_Latn (NLLB)
LANG_TOKEN = re.compile(r"^(>>[^<>\s]+<<|__[A-Za-z0-9_-]+__|[a-z]{2,3}_[A-Z][A-Za-z]{1,3})$")


def target_tag(lang: str) -> str:
    """The tag s2s reserves for target language ``lang`` (data.pairs): <2de>."""
    return f"<2{lang}>"


def token_code(token: str) -> str:
    """The language code a token names: <2de>, >>de<<, __de__ -> de; de_DE, deu_Latn stay whole."""
    for left, right in (("<2", ">"), (">>", "<<"), ("__", "__")):
        if token.startswith(left) and token.endswith(right) and len(token) > len(left) + len(right):
            return token[len(left):-len(right)]
    return token


@dataclass(frozen=True)
class Languages:
    """A model's language tokens (``tokenizer.lang_*``) and where they go (see the table above)."""

    scheme: str = "none"
    tokens: tuple[str, ...] = ()  # the target-language tokens, in the model's order
    src_token: str = ""  # mbart, m2m100: the source language's token

    @property
    def codes(self) -> list[str]:
        return [token_code(t) for t in self.tokens]

    @property
    def needs_target(self) -> bool:
        """A target must be named (--tgt-lang or a token starting the line): several to choose
        from, and a scheme that has no default (mBART falls back to its training's habit)."""
        return self.scheme in ("target_tag", "m2m100") and len(self.tokens) > 1

    def describe(self) -> str:
        """For messages and `s2s info`: 'de (<2de>), fr (<2fr>)'."""
        return ", ".join(c if c == t else f"{c} ({t})" for c, t in zip(self.codes, self.tokens))

    def resolve(self, lang: str, key: str = "--tgt-lang") -> str:
        """The token of target language ``lang`` (see the module docstring); an error naming
        ``key`` and listing the model's languages when it is none of them."""
        if not self.tokens:
            raise S2SError(f"{key}: {lang!r}: this model has no language tokens (it translates "
                           "into one language)")
        if lang in self.tokens:
            return lang
        exact = [t for t in self.tokens if token_code(t) == lang]
        if len(exact) == 1:
            return exact[0]
        family = [t for t in self.tokens if token_code(t).split("_")[0] == lang]
        if len(family) == 1:
            return family[0]
        if len(family) > 1:
            raise S2SError(f"{key}: {lang!r} is ambiguous: say which of {', '.join(family)}")
        raise S2SError(f"{key}: {lang!r} is not a target language of this model; it has: {self.describe()}")

    def starts_with_token(self, text: str) -> bool:
        """Whether ``text`` begins with one of the model's language tokens (typed by the user)."""
        head = text.lstrip()
        return any(head.startswith(t) for t in self.tokens)


@dataclass(frozen=True)
class LanguageIds:
    """The ids a chosen target language adds: before and after each source's ids (which end
    with </s>) and forced at the start of each output."""

    langs: Languages = Languages()
    src_before: tuple[int, ...] = ()
    src_after: tuple[int, ...] = ()
    tgt_first: tuple[int, ...] = ()
    required: bool = False  # no target chosen, and the model must be told one

    @property
    def extra(self) -> int:
        return len(self.src_before) + len(self.src_after)

    def typed(self, text: str) -> bool:
        """target_tag: the text starts with its own language token, which wins over --tgt-lang."""
        return self.langs.scheme == "target_tag" and self.langs.starts_with_token(text)

    def check_line(self, text: str, where: str, key: str = "--tgt-lang (decode.tgt_lang)") -> None:
        """A model that must be told its target, and none given (nor typed): an error naming
        the text (``where``: 'line 3') and the setting to pass (``key``)."""
        if self.required and not self.typed(text):
            typing = (f", or start the text with one of {', '.join(self.langs.tokens)}"
                      if self.langs.scheme == "target_tag" else "")
            raise S2SError(f"{where}: which target language? This model translates into "
                           f"{self.langs.describe()}: pass {key}{typing}")

    def wrap(self, ids: list[int], text: str = "") -> list[int]:
        """A source's ids (ending in </s>) with the language tokens around them."""
        before = () if self.typed(text) else self.src_before
        return [*before, *ids, *self.src_after]


def language_ids(langs: Languages, token_id, tgt_lang: str, key: str = "--tgt-lang") -> LanguageIds:
    """The ids ``tgt_lang`` ("" for none) adds under ``langs.scheme``; ``token_id`` maps a token to
    its model id.  Unknown languages are an error naming ``key`` (see :meth:`Languages.resolve`)."""
    if langs.scheme == "none" or not langs.tokens:
        if tgt_lang:
            Languages().resolve(tgt_lang, key)  # raises: no language tokens
        return LanguageIds()
    src = (token_id(langs.src_token),) if langs.src_token else ()
    if not tgt_lang:
        before = src if langs.scheme == "m2m100" else ()
        after = src if langs.scheme == "mbart" else ()
        return LanguageIds(langs, before, after, (), required=langs.needs_target)
    tgt = token_id(langs.resolve(tgt_lang, key))
    if langs.scheme == "target_tag":
        return LanguageIds(langs, (tgt,))
    if langs.scheme == "mbart":
        return LanguageIds(langs, (), src, (tgt,))
    return LanguageIds(langs, src, (), (tgt,))


def with_forced(first: Sequence[int], prefixes: Optional[list[list[int]]], n: int) -> Optional[list[list[int]]]:
    """Each output's forced start: the language token(s) ``first``, then the row's own prefix."""
    if not first:
        return prefixes
    return [[*first, *(prefixes[i] if prefixes is not None else [])] for i in range(n)]
