"""Denoising objectives (docs/model.md (47), (48)): the corrupted input x~ and the target y.

    span_corruption (T5):  spans covering ``noise_density`` of x, of mean length ``mean_span``,
                           each become one sentinel in x~; y = each sentinel followed by its span.
    bart:                  token masking, token deletion, text infilling (span lengths ~ Poisson(lambda),
                           each span one <mask>), sentence permutation, document rotation;
                           y = the whole original x.

Every function is pure: ids in, ids out, randomness only from the ``numpy``
Generator passed in, so the same seed gives the same noise (a resumed run sees
the noise the uninterrupted one saw).  Ids exclude the final </s>.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def random_partition(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` positive integers summing to ``total`` (a uniformly random composition)."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else []
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)


def span_corruption(x: Sequence[int], rng: np.random.Generator, sentinels: Sequence[int],
                    noise_density: float = 0.15, mean_span: float = 3.0) -> tuple[list[int], list[int]]:
    """T5's span corruption of one sequence x (length L):

        n_noise = round(L * noise_density)  (at least 1, at most L - 1)
        n_spans = round(n_noise / mean_span) (at least 1, at most the sentinels there are)

    noise and kept tokens are each cut into n_spans random runs and interleaved
    (kept run first); x~ = kept_1 s_1 kept_2 s_2 ...,  y = s_1 noise_1 s_2 noise_2 ... s_n+1.
    Replacing each s_i of x~ by noise_i gives x back.
    """
    L = len(x)
    if L < 2:
        return list(x), [sentinels[0]]
    n_noise = min(max(int(round(L * noise_density)), 1), L - 1)
    n_spans = min(max(int(round(n_noise / mean_span)), 1), n_noise, L - n_noise, len(sentinels) - 1)
    noise_lens = random_partition(n_noise, n_spans, rng)
    keep_lens = random_partition(L - n_noise, n_spans, rng)
    src: list[int] = []
    tgt: list[int] = []
    pos = 0
    for i in range(n_spans):
        src += list(x[pos:pos + keep_lens[i]])
        pos += keep_lens[i]
        src.append(sentinels[i])
        tgt.append(sentinels[i])
        tgt += list(x[pos:pos + noise_lens[i]])
        pos += noise_lens[i]
    tgt.append(sentinels[n_spans])  # closes the last span (T5's final sentinel)
    return src, tgt


def fill_spans(src: Sequence[int], tgt: Sequence[int], sentinels: Sequence[int]) -> list[int]:
    """The inverse of :func:`span_corruption`: each sentinel of x~ replaced by its span in y."""
    spans: dict[int, list[int]] = {}
    current = None
    for t in tgt:
        if t in sentinels:
            current = t
            spans[t] = []
        elif current is not None:
            spans[current].append(t)
    out: list[int] = []
    for t in src:
        out += spans.get(t, [t]) if t in sentinels else [t]
    return out


@dataclass(frozen=True)
class BartNoise:
    """The rates of BART's five noising functions (Lewis et al. 2020), each 0 to switch it off."""

    mask_rate: float = 0.0  # each token -> <mask> with this probability
    delete_rate: float = 0.0  # each token deleted with this probability
    infill_rate: float = 0.3  # spans covering this fraction of tokens -> one <mask> each
    poisson_lambda: float = 3.0  # span lengths ~ Poisson(lambda) (a 0-length span inserts a <mask>)
    permute_rate: float = 1.0  # probability that a document's sentences are shuffled
    rotate_rate: float = 0.0  # probability that a document is rotated to start at a random token


def split_sentences(x: Sequence[int], stops: set[int]) -> list[list[int]]:
    """Sentences of x: each ends at a token in ``stops`` (a full stop) or at the end."""
    out, cur = [], []
    for t in x:
        cur.append(t)
        if t in stops:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def bart_noise(x: Sequence[int], rng: np.random.Generator, mask_id: int, noise: BartNoise,
               stops: set[int] = frozenset()) -> tuple[list[int], list[int]]:
    """x~ from x by, in order: sentence permutation, document rotation, text infilling,
    token masking, token deletion.  The target is x itself."""
    y = list(x)
    doc = list(x)
    if noise.permute_rate and rng.random() < noise.permute_rate:
        sentences = split_sentences(doc, stops)
        doc = [t for i in rng.permutation(len(sentences)) for t in sentences[i]]
    if noise.rotate_rate and len(doc) > 1 and rng.random() < noise.rotate_rate:
        k = int(rng.integers(1, len(doc)))
        doc = doc[k:] + doc[:k]
    if noise.infill_rate:
        doc = infill(doc, rng, mask_id, noise.infill_rate, noise.poisson_lambda)
    if noise.mask_rate:
        hit = rng.random(len(doc)) < noise.mask_rate
        doc = [mask_id if h else t for t, h in zip(doc, hit)]
    if noise.delete_rate:
        keep = rng.random(len(doc)) >= noise.delete_rate
        doc = [t for t, k in zip(doc, keep) if k]
    return doc, y


def infill(doc: list[int], rng: np.random.Generator, mask_id: int, rate: float, lam: float) -> list[int]:
    """Text infilling: span lengths ~ Poisson(lambda) are drawn until they cover ``rate`` of
    the tokens (the last one cut to fit); the spans are laid out in random order with random
    gaps of kept tokens between them, and each becomes one <mask> (a 0-length span inserts one)."""
    budget = int(round(len(doc) * rate))
    lengths: list[int] = []
    while sum(lengths) < budget:
        lengths.append(min(int(rng.poisson(lam)), budget - sum(lengths)))
    if not lengths:
        return list(doc)
    gaps = rng.multinomial(len(doc) - budget, [1.0 / (len(lengths) + 1)] * (len(lengths) + 1))
    out: list[int] = []
    pos = 0
    for gap, n in zip(gaps, lengths):
        out += doc[pos:pos + gap] + [mask_id]
        pos += gap + n
    return out + doc[pos:]
