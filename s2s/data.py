"""Parallel data: cleaning, binarizing, token-count batching, the Batch.

``prepare`` reads ``{prefix}.{src_lang}`` / ``{prefix}.{tgt_lang}`` for each
split, cleans the training pairs, encodes them with the tokenizer and writes
per split and side a flat id array ``{split}.{side}.ids.npy`` with offsets
``{split}.{side}.idx.npy`` (N+1 entries), loaded back as memory maps, so
training never re-tokenizes.  ``side`` is ``src`` or ``tgt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from s2s.config import ExperimentConfig
from s2s.errors import S2SError
from s2s.textio import atomic_write, file_sha256, read_lines, resolve_corpus
from s2s.tokenizer import BOS_ID, PAD_ID, Tokenizer, resolve_tokenizer_config

SPLITS = ("train", "dev", "test")
DROP_REASONS = ("empty", "too_long", "length_ratio", "duplicate")


# --------------------------------------------------------------------------- #
# Reading and cleaning
# --------------------------------------------------------------------------- #

def read_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Yield aligned (source, target) lines; different line counts is an error naming both."""
    src_it, tgt_it = read_lines(src_path), read_lines(tgt_path)
    n = 0
    for s, t in itertools.zip_longest(src_it, tgt_it):
        if s is None or t is None:
            n_src = n + (s is not None) + sum(1 for _ in src_it)
            n_tgt = n + (t is not None) + sum(1 for _ in tgt_it)
            raise S2SError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: "
                           "parallel files must have the same number of lines")
        n += 1
        yield s, t


@dataclass
class CleanStats:
    read: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)


def truncate(ids: list[int], n: int) -> list[int]:
    """The first n-1 tokens and the final </s>: an over-long input cut to n tokens."""
    return ids if len(ids) <= n else ids[:n - 1] + ids[-1:]


def clean_pairs(pairs: Sequence[tuple[str, str]], src_ids: Sequence[list[int]],
                tgt_ids: Sequence[list[int]], max_len: Optional[int], max_ratio: Optional[float],
                dedupe: bool) -> tuple[list[int], CleanStats]:
    """Indices of the pairs to keep, and why the others were dropped.

    Rules, in order: empty side; either side over ``max_len`` tokens;
    token-length ratio max(|x|,|y|)/min(|x|,|y|) over ``max_ratio``;
    an exact duplicate of an earlier pair.
    """
    stats = CleanStats(read=len(pairs))
    seen: set[bytes] = set()
    keep = []
    for i, ((s, t), xs, ys) in enumerate(zip(pairs, src_ids, tgt_ids)):
        if not s or not t:
            reason = "empty"
        elif max_len is not None and max(len(xs), len(ys)) > max_len:
            reason = "too_long"
        elif max_ratio is not None and max(len(xs), len(ys)) / min(len(xs), len(ys)) > max_ratio:
            reason = "length_ratio"
        else:
            reason = None
            if dedupe:
                key = hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=16).digest()
                if key in seen:
                    reason = "duplicate"
                seen.add(key)
        if reason:
            stats.dropped[reason] += 1
        else:
            keep.append(i)
    stats.kept = len(keep)
    return keep, stats


# --------------------------------------------------------------------------- #
# Binarized splits
# --------------------------------------------------------------------------- #

def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_write(path, "wb") as f:
        np.save(f, array)


def write_ids(directory: Path, split: str, side: str, seqs: Sequence[list[int]], vocab: int) -> None:
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max else np.int32
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(offsets[-1]))
    _save_npy(directory / f"{split}.{side}.ids.npy", flat)
    _save_npy(directory / f"{split}.{side}.idx.npy", offsets)


def tokenizer_fingerprint(cfg: ExperimentConfig, directory: Path) -> str:
    files = Tokenizer.all_files(directory, cfg.tokenizer, cfg.data)
    return hashlib.sha256("".join(file_sha256(p) for p in files).encode()).hexdigest()[:16]


def data_signature(cfg: ExperimentConfig) -> str:
    """What the prepared splits depend on besides the tokenizer: data settings and file sizes."""
    parts = [json.dumps(dataclasses.asdict(cfg.data), sort_keys=True),
             cfg.model.positions, str(cfg.model.max_positions)]
    for split in SPLITS:
        prefix = getattr(cfg.data, split)
        for lang in (cfg.data.src_lang, cfg.data.tgt_lang):
            if prefix:
                with contextlib.suppress(S2SError, OSError):
                    parts.append(str(resolve_corpus(prefix, lang).stat().st_size))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def prepare(cfg: ExperimentConfig) -> dict[str, CleanStats]:
    """Clean, encode and binarize every configured split into ``data.dir``."""
    out = Path(cfg.data.dir)
    if not cfg.data.train:
        raise S2SError("data.train: no training corpus configured")
    corpora = {split: (resolve_corpus(prefix, cfg.data.src_lang), resolve_corpus(prefix, cfg.data.tgt_lang))
               for split in SPLITS if (prefix := getattr(cfg.data, split))}
    cfg = resolve_tokenizer_config(cfg)
    tok = Tokenizer.load(out, cfg.tokenizer, cfg.data)
    (out / "meta.json").unlink(missing_ok=True)  # written last: its presence means complete
    all_stats: dict[str, CleanStats] = {}
    sizes = {}
    for split, (src_path, tgt_path) in corpora.items():
        pairs = [(s.strip(), t.strip()) for s, t in read_parallel(src_path, tgt_path)]
        src_ids = tok.encode_src([s for s, _ in pairs])
        if cfg.data.max_src_tokens:
            src_ids = [truncate(x, cfg.data.max_src_tokens) for x in src_ids]
        tgt_ids = tok.encode_tgt([t for _, t in pairs])
        if split == "train":
            keep, stats = clean_pairs(pairs, src_ids, tgt_ids, cfg.data.max_tokens_per_sentence,
                                      cfg.data.max_length_ratio or None, cfg.data.dedupe)
        else:  # evaluation splits keep every non-empty pair the model can take
            limit = cfg.model.max_positions if cfg.model.positions == "learned" else None
            keep, stats = clean_pairs(pairs, src_ids, tgt_ids, limit, None, False)
        if not keep:
            raise S2SError(f"{src_path}: no pairs left after cleaning ({split} split)")
        write_ids(out, split, "src", [src_ids[i] for i in keep], tok.src_vocab_size)
        write_ids(out, split, "tgt", [tgt_ids[i] for i in keep], tok.tgt_vocab_size)
        with atomic_write(out / f"{split}.src.txt") as f:
            f.writelines(pairs[i][0] + "\n" for i in keep)
        with atomic_write(out / f"{split}.tgt.txt") as f:
            f.writelines(pairs[i][1] + "\n" for i in keep)
        all_stats[split] = stats
        sizes[split] = stats.kept
    meta = {"splits": sizes, "src_vocab": tok.src_vocab_size, "tgt_vocab": tok.tgt_vocab_size,
            "tokenizer": tokenizer_fingerprint(cfg, out), "data": data_signature(cfg)}
    with atomic_write(out / "meta.json") as f:
        json.dump(meta, f, indent=2)
    return all_stats


class BinDataset:
    """One binarized split, memory-mapped."""

    epoch = 0  # the epoch being read (the trainer sets it; denoising datasets seed their noise with it)

    def __init__(self, directory: str | Path, split: str, pad_id: int = PAD_ID, bos_id: int = BOS_ID):
        d = Path(directory)
        self.pad_id, self.bos_id = pad_id, bos_id
        try:
            self.src = np.load(d / f"{split}.src.ids.npy", mmap_mode="r")
            self.src_off = np.load(d / f"{split}.src.idx.npy")
            self.tgt = np.load(d / f"{split}.tgt.ids.npy", mmap_mode="r")
            self.tgt_off = np.load(d / f"{split}.tgt.idx.npy")
        except FileNotFoundError as e:
            raise S2SError(f"{e.filename}: prepared data not found (run `s2s prepare CONFIG`)") from None
        except ValueError as e:
            raise S2SError(f"{d}/{split}.*.npy: corrupted prepared data ({e})") from None
        if len(self.src_off) != len(self.tgt_off):
            raise S2SError(f"{d}: {split} source and target sizes differ; run `s2s prepare` again")
        self.src_lens = np.diff(self.src_off)
        self.tgt_lens = np.diff(self.tgt_off)

    def __len__(self) -> int:
        return len(self.src_lens)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.src[self.src_off[i]:self.src_off[i + 1]],
                self.tgt[self.tgt_off[i]:self.tgt_off[i + 1]])

    def batch(self, indices: Sequence[int]) -> "Batch":
        pairs = [self.pair(int(i)) for i in indices]
        return Batch.from_ids([p[0] for p in pairs], [p[1] for p in pairs], self.pad_id, self.bos_id)


# --------------------------------------------------------------------------- #
# Batches
# --------------------------------------------------------------------------- #

def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int = PAD_ID, prefix: Optional[int] = None,
                  drop_last: bool = False) -> Tensor:
    """Right-pad id sequences into a (B, L) LongTensor, optionally prepending ``prefix``."""
    rows = []
    for s in seqs:
        s = np.asarray(s, dtype=np.int64)
        if drop_last:
            s = s[:-1]
        if prefix is not None:
            s = np.concatenate([[prefix], s])
        rows.append(s)
    L = max(len(r) for r in rows)
    out = np.full((len(rows), L), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


@dataclass
class Batch:
    """A teacher-forcing batch.  The shift happens here, once:

        tgt_in  = (<s>, y_1, ..., y_{m-1})
        tgt_out = (y_1, ..., y_m)            with y_m = </s>
    """

    src: Tensor  # (B, S)
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)
    n_src_tokens: int
    n_tgt_tokens: int
    pad_id: int = PAD_ID

    @classmethod
    def from_ids(cls, src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]], pad_id: int = PAD_ID,
                 bos_id: int = BOS_ID) -> "Batch":
        return cls(src=pad_sequences(src, pad_id),
                   tgt_in=pad_sequences(tgt, pad_id, prefix=bos_id, drop_last=True),
                   tgt_out=pad_sequences(tgt, pad_id),
                   n_src_tokens=sum(len(s) for s in src),
                   n_tgt_tokens=sum(len(t) for t in tgt), pad_id=pad_id)

    def __len__(self) -> int:
        return self.src.size(0)

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device),
                     self.n_src_tokens, self.n_tgt_tokens, self.pad_id)

    def halves(self) -> tuple["Batch", "Batch"]:
        """The first and the second half of the sentences (for a batch too big for memory)."""
        k = len(self) // 2

        def part(rows: slice) -> "Batch":
            src, tgt_in, tgt_out = self.src[rows], self.tgt_in[rows], self.tgt_out[rows]
            pad = self.pad_id
            return Batch(src, tgt_in, tgt_out, int((src != pad).sum()), int((tgt_out != pad).sum()), pad)
        return part(slice(0, k)), part(slice(k, None))


def token_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int,
                  rng: Optional[np.random.Generator] = None) -> list[np.ndarray]:
    """Group sentence indices into batches of similar length.

    Sentences are sorted by (source length, target length) — ties in random
    order when ``rng`` is given — and cut greedily so that each batch's padded
    size ``B * max(S_max, T_max) <= max_tokens`` (fairseq's --max-tokens).  A
    single pair longer than ``max_tokens`` forms its own batch.  With ``rng``
    the batch order is shuffled too.
    """
    n = len(src_lens)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    order = order[np.lexsort((tgt_lens[order], src_lens[order]))]
    batches, start, longest = [], 0, 0
    for pos, i in enumerate(order):
        width = max(int(src_lens[i]), int(tgt_lens[i]))
        new_longest = max(longest, width)
        if pos > start and new_longest * (pos - start + 1) > max_tokens:
            batches.append(order[start:pos])
            start, new_longest = pos, width
        longest = new_longest
    if start < n:
        batches.append(order[start:])
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches
