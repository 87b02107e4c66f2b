"""Parallel data: cleaning, binarizing, token-count batching, the Batch.

``prepare`` reads ``{prefix}.{src_lang}`` / ``{prefix}.{tgt_lang}`` for each
split, cleans the training pairs, encodes them with the tokenizer and writes
per split and side a flat id array ``{split}.{side}.ids.npy`` with offsets
``{split}.{side}.idx.npy`` (N+1 entries), loaded back as memory maps, so
training never re-tokenizes.  ``side`` is ``src`` or ``tgt``.  It streams:
chunks of pairs are encoded in worker processes and written in corpus order,
and only the duplicate digests (8 bytes per pair) grow with the corpus.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from s2s.config import ExperimentConfig
from s2s.errors import S2SError
from s2s.langs import target_tag
from s2s.outdir import check_data_dir
from s2s.textio import StagedFiles, file_sha256, read_lines, resolve_corpus, staged_files
from s2s.tokenizer import BOS_ID, PAD_ID, Tokenizer, resolve_tokenizer_config, truncate  # noqa: F401 (truncate: importable from here too)
from s2s.workerserver import usable_cores

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

    def add(self, codes: np.ndarray) -> None:
        """Count one chunk's drop codes (0: kept, k: DROP_REASONS[k - 1])."""
        counts = np.bincount(codes, minlength=len(DROP_REASONS) + 1)
        self.read += len(codes)
        self.kept += int(counts[0])
        for reason, n in zip(DROP_REASONS, counts[1:].tolist()):
            if n:
                self.dropped[reason] += n


KEEP, EMPTY, TOO_LONG, LENGTH_RATIO, DUPLICATE = range(len(DROP_REASONS) + 1)


def drop_codes(empty: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray,
               max_len: Optional[int], max_ratio: Optional[float]) -> np.ndarray:
    """The first rule that drops each pair (0: none), in this order:

    EMPTY         a side is empty
    TOO_LONG      max(|x|, |y|) > max_len
    LENGTH_RATIO  max(|x|, |y|) / min(|x|, |y|) > max_ratio
    (DUPLICATE, the last rule, needs the pairs seen before: see DigestSet.)
    """
    longest = np.maximum(src_lens, tgt_lens)
    codes = np.zeros(len(empty), dtype=np.int8)
    if max_ratio is not None:  # empty sides are EMPTY below, whatever they divide into
        codes[longest / np.maximum(np.minimum(src_lens, tgt_lens), 1) > max_ratio] = LENGTH_RATIO
    if max_len is not None:
        codes[longest > max_len] = TOO_LONG
    codes[empty] = EMPTY
    return codes


def pair_digest(s: str, t: str) -> bytes:
    """8 bytes of blake2b(s TAB t): equal pairs, equal digests (distinct ones collide with
    probability about N^2 / 2^65 over N pairs: one in 10^5 at ten million pairs)."""
    return hashlib.blake2b(f"{s}\t{t}".encode(), digest_size=8).digest()


class DigestSet:
    """The set of 64-bit pair digests seen so far: 8 bytes per distinct pair, kept as
    sorted runs whose sizes shrink geometrically (a log-structured merge), so adding a
    chunk costs O(chunk log N) and memory never holds a Python object per pair."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def add_new(self, keys: np.ndarray) -> np.ndarray:
        """Add ``keys`` (uint64); True where a key is in neither the set nor earlier in ``keys``."""
        uniq, first = np.unique(keys, return_index=True)  # first occurrence of each key
        new = np.ones(len(uniq), dtype=bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, uniq), len(run) - 1)
            new &= run[at] != uniq
        fresh = np.zeros(len(keys), dtype=bool)
        fresh[first[new]] = True
        if new.any():
            self.runs.append(uniq[new])
            while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
                b, a = self.runs.pop(), self.runs.pop()
                self.runs.append(np.sort(np.concatenate([a, b])))
        return fresh


def clean_pairs(pairs: Sequence[tuple[str, str]], src_ids: Sequence[list[int]],
                tgt_ids: Sequence[list[int]], max_len: Optional[int], max_ratio: Optional[float],
                dedupe: bool) -> tuple[list[int], CleanStats]:
    """Indices of the pairs to keep, and why the others were dropped.

    Rules, in order: empty side; either side over ``max_len`` tokens;
    token-length ratio max(|x|,|y|)/min(|x|,|y|) over ``max_ratio``;
    an exact duplicate of an earlier pair.
    """
    codes = drop_codes(np.array([not s or not t for s, t in pairs], dtype=bool),
                       np.array([len(x) for x in src_ids], dtype=np.int64),
                       np.array([len(y) for y in tgt_ids], dtype=np.int64), max_len, max_ratio)
    if dedupe:
        candidates = np.flatnonzero(codes == KEEP)
        digests = np.frombuffer(b"".join(pair_digest(*pairs[i]) for i in candidates), dtype="<u8")
        codes[candidates[~DigestSet().add_new(digests)]] = DUPLICATE
    stats = CleanStats()
    stats.add(codes)
    return np.flatnonzero(codes == KEEP).tolist(), stats


# --------------------------------------------------------------------------- #
# Streaming: chunks of pairs encoded in worker processes, written in order
# --------------------------------------------------------------------------- #

CHUNK_PAIRS = 4096  # pairs per chunk handed to a worker


@dataclass(frozen=True)
class CleanRules:
    """What ``prepare`` drops from one split (see ``drop_codes``)."""

    max_len: Optional[int]
    max_ratio: Optional[float]
    dedupe: bool
    max_src_tokens: int = 0  # cut sources to this many tokens first (0: never)


@dataclass
class EncodedChunk:
    """One chunk of pairs, encoded: flat ids and lengths per side, drop codes (without
    DUPLICATE) and, when deduplicating, each pair's digest."""

    src_ids: np.ndarray  # (sum |x|,) int32
    src_lens: np.ndarray  # (n,) int64
    tgt_ids: np.ndarray  # (sum |y|,) int32
    tgt_lens: np.ndarray  # (n,) int64
    codes: np.ndarray  # (n,) int8
    digests: Optional[np.ndarray]  # (n,) uint64


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def encode_chunk(tok: Tokenizer, srcs: list[str], tgts: list[str], rules: CleanRules) -> EncodedChunk:
    src_ids = tok.encode_src(srcs)
    if rules.max_src_tokens:
        src_ids = [truncate(x, rules.max_src_tokens) for x in src_ids]
    src_flat, src_lens = _flatten(src_ids)
    tgt_flat, tgt_lens = _flatten(tok.encode_tgt(tgts))
    empty = np.fromiter((not s or not t for s, t in zip(srcs, tgts)), dtype=bool, count=len(srcs))
    digests = None
    if rules.dedupe:
        digests = np.frombuffer(b"".join(map(pair_digest, srcs, tgts)), dtype="<u8")
    return EncodedChunk(src_flat, src_lens, tgt_flat, tgt_lens,
                        drop_codes(empty, src_lens, tgt_lens, rules.max_len, rules.max_ratio), digests)


_worker_tok: Optional[Tokenizer] = None  # each worker process loads the tokenizer once


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGHUP}


def _encoding_pool(workers: int, directory: Path, cfg: ExperimentConfig) -> multiprocessing.pool.Pool:
    """``workers`` encoding processes.  They are forked with SIGTERM and SIGHUP blocked, so that
    neither can reach a worker before :func:`_init_worker` has put back the default action (the
    CLI's handler, inherited through fork, would keep a worker alive that Pool.terminate() stops
    with SIGTERM: a hang); a signal sent meanwhile waits, pending, and is not lost.  A process
    that has used CUDA (a library user's, a GPU test session) is not forked, since CUDA's threads
    and locks do not survive a fork: its workers start from a forkserver."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        start = "forkserver" if torch.cuda.is_initialized() else None  # None: the platform's default
        return multiprocessing.get_context(start).Pool(workers, _init_worker, (directory, cfg))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_worker(directory: Path, cfg: ExperimentConfig) -> None:
    global _worker_tok
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to report
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    # a process group of its own: a signal to s2s's group (Ctrl-C, `timeout`, a closed terminal)
    # reaches the main process alone, which stops the pool with Pool.terminate(); a worker killed
    # beside it would die holding a queue's lock or mid-message, and terminate() wait forever.
    # Should the main process die outright, a worker reads EOF from the task queue and exits.
    os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a warning to a terminal under `stty tostop` not stopped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _worker_tok = Tokenizer.load(directory, cfg.tokenizer, cfg.data)


def _encode_in_worker(job: tuple[list[str], list[str], CleanRules]) -> EncodedChunk:
    return encode_chunk(_worker_tok, *job)


def encoded_chunks(pairs: Iterator[tuple[str, str]], rules: CleanRules, tok: Tokenizer,
                   pool=None, workers: int = 1
                   ) -> Iterator[tuple[list[str], list[str], EncodedChunk]]:
    """(sources, targets, encoded) per chunk of CHUNK_PAIRS pairs, in corpus order.

    With a pool, at most 2 * workers chunks are in flight, so memory does not
    grow with the corpus (Pool.imap would read the whole input ahead).
    """
    chunks = ((list(s), list(t)) for s, t in
              (zip(*c) for c in iter(lambda: list(itertools.islice(pairs, CHUNK_PAIRS)), [])))
    if pool is None:
        for srcs, tgts in chunks:
            yield srcs, tgts, encode_chunk(tok, srcs, tgts, rules)
        return
    pending: collections.deque = collections.deque()
    for srcs, tgts in chunks:
        pending.append((srcs, tgts, pool.apply_async(_encode_in_worker, ((srcs, tgts, rules),))))
        if len(pending) >= 2 * workers:
            srcs, tgts, result = pending.popleft()
            yield srcs, tgts, result.get()
    while pending:
        srcs, tgts, result = pending.popleft()
        yield srcs, tgts, result.get()


# --------------------------------------------------------------------------- #
# Binarized splits
# --------------------------------------------------------------------------- #

def ids_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= np.iinfo(np.uint16).max else np.int32)


class NpyAppender:
    """A 1-D ``.npy`` file written piece by piece, byte for byte what ``np.save`` writes.

    The header is written for length 0, the data appended, then the header
    rewritten with the final length: numpy pads every header so that the
    length of the first axis can grow in place without moving the data.
    """

    def __init__(self, f: IO[bytes], dtype: np.dtype):
        self.f, self.dtype, self.n = f, np.dtype(dtype), 0
        self.header_size = self._write_header()

    def _write_header(self) -> int:
        start = self.f.tell()
        np.lib.format.write_array_header_1_0(self.f, {
            "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.n,)})
        return self.f.tell() - start

    def append(self, values: np.ndarray) -> None:
        self.f.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.n += len(values)

    def finish(self) -> None:
        end = self.f.tell()
        self.f.seek(0)
        if self._write_header() != self.header_size:  # cannot happen with numpy's padded headers
            raise RuntimeError(f"{self.f.name}: .npy header changed size")
        self.f.seek(end)


class SplitWriter:
    """The six files of one binarized split, appended to chunk by chunk:
    ``{split}.{side}.ids.npy`` (flat ids), ``{split}.{side}.idx.npy`` (N+1 offsets)
    and ``{split}.{side}.txt`` for side in src, tgt.  Each is written under a
    temporary name, renamed only when ``staged`` is published."""

    def __init__(self, stack: contextlib.ExitStack, staged: StagedFiles, directory: Path, split: str,
                 src_vocab: int, tgt_vocab: int):
        self.ids, self.idx, self.txt, self.end = {}, {}, {}, {}
        for side, vocab in (("src", src_vocab), ("tgt", tgt_vocab)):
            name = f"{split}.{side}"
            self.ids[side] = NpyAppender(stack.enter_context(staged.open(directory / f"{name}.ids.npy", "wb")),
                                         ids_dtype(vocab))
            self.idx[side] = NpyAppender(stack.enter_context(staged.open(directory / f"{name}.idx.npy", "wb")),
                                         np.int64)
            self.idx[side].append(np.zeros(1, dtype=np.int64))
            self.txt[side] = stack.enter_context(staged.open(directory / f"{name}.txt"))
            self.end[side] = 0

    def append(self, side: str, lines: list[str], flat: np.ndarray, lens: np.ndarray,
               keep: np.ndarray) -> None:
        """Append the kept pairs' side: their lines, ids and offsets."""
        self.ids[side].append(flat[np.repeat(keep, lens)])
        offsets = self.end[side] + np.cumsum(lens[keep])
        self.idx[side].append(offsets)
        if len(offsets):
            self.end[side] = int(offsets[-1])
        self.txt[side].writelines(line + "\n" for line, k in zip(lines, keep.tolist()) if k)

    def finish(self) -> None:
        for side in ("src", "tgt"):
            self.ids[side].finish()
            self.idx[side].finish()



def tokenizer_fingerprint(cfg: ExperimentConfig, directory: Path) -> str:
    files = Tokenizer.all_files(directory, cfg.tokenizer, cfg.data)
    return hashlib.sha256("".join(file_sha256(p) for p in files).encode()).hexdigest()[:16]


def data_signature(cfg: ExperimentConfig) -> str:
    """What the prepared splits depend on besides the tokenizer: data settings and file sizes."""
    parts = [json.dumps(dataclasses.asdict(cfg.data), sort_keys=True),
             cfg.model.positions, str(cfg.model.max_positions)]
    for split in SPLITS:
        for prefix, src_lang, tgt_lang in cfg.data.split_corpora(split):
            for lang in (src_lang, tgt_lang):
                with contextlib.suppress(S2SError, OSError):
                    parts.append(str(resolve_corpus(prefix, lang).stat().st_size))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def prepare(cfg: ExperimentConfig, workers: int = 0) -> dict[str, CleanStats]:
    """Clean, encode and binarize every configured split into ``data.dir``.

    The corpus streams through in chunks: ``workers`` processes (0: one per
    core; 1: this process alone) encode them, and the chunks are cleaned and
    written in corpus order, so the output does not depend on ``workers`` and
    memory does not grow with the corpus beyond the duplicate digests (8 bytes
    per distinct training pair).
    """
    out = Path(cfg.data.dir)
    if not cfg.data.split_corpora("train"):
        raise S2SError("data.train: no training corpus configured")
    corpora = {split: [(resolve_corpus(prefix, src), resolve_corpus(prefix, tgt), tgt)
                       for prefix, src, tgt in cfg.data.split_corpora(split)]
               for split in SPLITS if cfg.data.split_corpora(split)}
    check_data_dir(out)
    cfg = resolve_tokenizer_config(cfg)
    tok = Tokenizer.load(out, cfg.tokenizer, cfg.data)
    workers = workers or usable_cores()
    all_stats: dict[str, CleanStats] = {}
    # every file appears when all are written, meta.json (its presence means complete) last:
    # a failure or a stop keeps the earlier prepared data whole
    with staged_files() as staged, contextlib.ExitStack() as pool_scope:
        pool = None
        if workers > 1:
            pool = pool_scope.enter_context(_encoding_pool(workers, out, cfg))
        for split, files in corpora.items():
            if split == "train":
                rules = CleanRules(cfg.data.max_tokens_per_sentence, cfg.data.max_length_ratio or None,
                                   cfg.data.dedupe, cfg.data.max_src_tokens)
            else:  # evaluation splits keep every non-empty pair the model can take
                limit = cfg.model.max_positions if cfg.model.positions == "learned" else None
                rules = CleanRules(limit, None, False, cfg.data.max_src_tokens)
            tagged = bool(cfg.data.pairs)
            pairs = itertools.chain.from_iterable(split_pairs(src, tgt, lang if tagged else None)
                                                  for src, tgt, lang in files)
            all_stats[split] = prepare_split(pairs, rules, tok, staged, out, split, pool, workers, files[0][0])
        meta = {"splits": {split: st.kept for split, st in all_stats.items()},
                "src_vocab": tok.src_vocab_size, "tgt_vocab": tok.tgt_vocab_size,
                "tokenizer": tokenizer_fingerprint(cfg, out), "data": data_signature(cfg)}
        with staged.open(out / "meta.json") as f:
            json.dump(meta, f, indent=2)
    return all_stats


def split_pairs(src_path: Path, tgt_path: Path, tgt_lang: Optional[str]) -> Iterator[tuple[str, str]]:
    """The stripped (source, target) lines of one corpus; with ``tgt_lang`` (data.pairs) each
    non-empty source starts with the target language's tag: '<2de> Hello' (Johnson et al. 2017)."""
    tag = f"{target_tag(tgt_lang)} " if tgt_lang else ""
    for s, t in read_parallel(src_path, tgt_path):
        s = s.strip()
        yield (tag + s if s else s), t.strip()


def prepare_split(pairs: Iterator[tuple[str, str]], rules: CleanRules, tok: Tokenizer, staged: StagedFiles,
                  out: Path, split: str, pool, workers: int, src_path: Path) -> CleanStats:
    """Clean, encode and write one split, chunk by chunk, into ``staged`` files."""
    stats = CleanStats()
    seen = DigestSet()
    with contextlib.ExitStack() as stack:
        writer = SplitWriter(stack, staged, out, split, tok.src_vocab_size, tok.tgt_vocab_size)
        for srcs, tgts, enc in encoded_chunks(pairs, rules, tok, pool, workers):
            codes = enc.codes
            if rules.dedupe:
                candidates = np.flatnonzero(codes == KEEP)
                codes[candidates[~seen.add_new(enc.digests[candidates])]] = DUPLICATE
            stats.add(codes)
            keep = codes == KEEP
            writer.append("src", srcs, enc.src_ids, enc.src_lens, keep)
            writer.append("tgt", tgts, enc.tgt_ids, enc.tgt_lens, keep)
        if not stats.kept:
            raise S2SError(f"{src_path}: no pairs left after cleaning ({split} split)")
        writer.finish()
    return stats


class TrainingData(Protocol):
    """What training reads: per-pair lengths (for token batching) and batches by index.
    ``epoch`` is the epoch being trained (0 for dev), for data that changes with it
    (denoising seeds its noise with it)."""

    src_lens: np.ndarray
    tgt_lens: np.ndarray

    def batch(self, indices: Sequence[int], epoch: int = 0) -> "Batch": ...


class BinDataset:
    """One binarized split, memory-mapped: ids and offsets stay on disk (the page cache
    holds what is read), and only the per-pair lengths, two int64 arrays, are in memory."""

    def __init__(self, directory: str | Path, split: str, pad_id: int = PAD_ID, bos_id: int = BOS_ID):
        d = Path(directory)
        self.pad_id, self.bos_id = pad_id, bos_id
        try:
            self.src = np.load(d / f"{split}.src.ids.npy", mmap_mode="r")
            self.src_off = np.load(d / f"{split}.src.idx.npy", mmap_mode="r")
            self.tgt = np.load(d / f"{split}.tgt.ids.npy", mmap_mode="r")
            self.tgt_off = np.load(d / f"{split}.tgt.idx.npy", mmap_mode="r")
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

    def batch(self, indices: Sequence[int], epoch: int = 0) -> "Batch":
        """The pairs ``indices`` as a Batch (the same in every epoch)."""
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


def teacher_forcing_input(tgt: Sequence[Sequence[int]], pad_id: int = PAD_ID, bos_id: int = BOS_ID) -> Tensor:
    """The teacher-forcing shift, the one place it happens: targets (y_1, ..., y_m) ->
    decoder inputs (<s>, y_1, ..., y_{m-1}), right-padded into (B, L)."""
    return pad_sequences(tgt, pad_id, prefix=bos_id, drop_last=True)


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
                   tgt_in=teacher_forcing_input(tgt, pad_id, bos_id),
                   tgt_out=pad_sequences(tgt, pad_id),
                   n_src_tokens=sum(len(s) for s in src),
                   n_tgt_tokens=sum(len(t) for t in tgt), pad_id=pad_id)

    def __len__(self) -> int:
        return self.src.size(0)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """On ``device``; ``non_blocking``: from page-locked memory (:meth:`pinned`) the copy
        to a GPU runs while the host goes on (elsewhere it is an ordinary copy)."""
        return Batch(self.src.to(device, non_blocking=non_blocking),
                     self.tgt_in.to(device, non_blocking=non_blocking),
                     self.tgt_out.to(device, non_blocking=non_blocking),
                     self.n_src_tokens, self.n_tgt_tokens, self.pad_id)

    def pinned(self, pin: bool = True) -> "Batch":
        """In page-locked host memory (with ``pin``; else this batch as it is)."""
        if not pin:
            return self
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(), self.tgt_out.pin_memory(),
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
    order = sort_by_lengths(order, src_lens, tgt_lens)
    width = np.maximum(src_lens[order], tgt_lens[order]).astype(np.int64)
    cuts = greedy_cuts(width, max_tokens)
    batches = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def sort_by_lengths(order: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
    """``order`` stably sorted by (source length, target length): np.lexsort's result,
    by two radix sorts (numpy's stable sort of 16-bit keys) when lengths fit 16 bits."""
    if len(order) == 0 or max(src_lens.max(), tgt_lens.max()) >= 2**16:
        return order[np.lexsort((tgt_lens[order], src_lens[order]))]
    order = order[np.argsort(tgt_lens[order].astype(np.uint16), kind="stable")]
    return order[np.argsort(src_lens[order].astype(np.uint16), kind="stable")]


def greedy_cuts(width: np.ndarray, max_tokens: int) -> list[int]:
    """Boundaries 0 = c_0 < c_1 < ... = n of the greedy cut: batch [c_k, c_{k+1}) grows
    while (pos - c_k + 1) * max(width[c_k..pos]) <= max_tokens (at least one pair each).

    Vectorized per batch: a running maximum over a window (twice the last
    batch) that doubles until it holds the cut, so the work is a few numpy
    calls per batch, not a Python iteration per pair.
    """
    n, cuts, start = len(width), [0], 0
    while start < n:
        span = max(64, 2 * (cuts[-1] - cuts[-2]) if len(cuts) > 1 else 0)  # twice the last batch
        while True:
            stop = min(n, start + span)
            padded = np.maximum.accumulate(width[start:stop]) * np.arange(1, stop - start + 1)
            over = padded > max_tokens
            over[0] = False  # a pair longer than max_tokens is a batch of its own
            if over.any():
                start += int(over.argmax())
                break
            if stop == n:
                start = n
                break
            span *= 2
        cuts.append(start)
    return cuts
