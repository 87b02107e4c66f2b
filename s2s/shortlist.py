"""A vocabulary shortlist: the target pieces a batch may produce, looked up from its source.

For each source piece s the k target pieces t that co-occur with it best in the
training pairs, counted per sentence pair (a pair counts once however often the
pieces repeat in it):

    c(s, t) = #pairs whose source holds s and whose target holds t
    c(s)    = #pairs whose source holds s;     c(t) = #pairs whose target holds t
    dice(s, t) = 2 c(s, t) / (c(s) + c(t))                      (score: dice, the default)
    p(t | s)   = c(s, t) / c(s)                                 (score: prob)

A batch's subset is the union, over its sources' pieces, of their k pieces,
plus the ``frequent`` most frequent target pieces (by token count) and the
tokenizer's special ids.  Decoding then scores only the subset's rows of the
output projection:

    z'_t = (s_U h_t) W_U[:, subset] + b_U[subset]     softmax over the subset alone

The table is stored as ``MODEL/shortlist.safetensors`` (tensors only; its
settings in the safetensors metadata) and built by ``s2s shortlist``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from s2s.errors import S2SError
from s2s.modeldir import SHORTLIST

FILE = SHORTLIST  # MODEL/shortlist.safetensors
SCORES = ("dice", "prob")


def dice(c_st: np.ndarray, c_s: np.ndarray, c_t: np.ndarray) -> np.ndarray:
    """dice(s, t) = 2 c(s, t) / (c(s) + c(t)), elementwise."""
    return 2.0 * c_st / (c_s + c_t)


def conditional_probability(c_st: np.ndarray, c_s: np.ndarray) -> np.ndarray:
    """p(t | s) = c(s, t) / c(s), elementwise."""
    return c_st / c_s


def cooccurrence(src: np.ndarray, src_off: np.ndarray, tgt: np.ndarray, tgt_off: np.ndarray, V_src: int,
                 V_tgt: int, chunk: int = 20000) -> tuple[np.ndarray, ...]:
    """Sentence-level counts over a corpus of flat ids and offsets (pair i's source is
    src[src_off[i]:src_off[i+1]], its target likewise: a prepared split's arrays).

    Returns (s, t, c_st) for every co-occurring (s, t), sorted by s then t, and
    c_s (V_src,), c_t (V_tgt,): pairs holding each piece.  Vectorized ``chunk``
    pairs at a time; memory grows with the distinct (s, t), not with the corpus.
    """
    keys = np.zeros(0, dtype=np.int64)
    counts = np.zeros(0, dtype=np.int64)
    c_s = np.zeros(V_src, dtype=np.int64)
    c_t = np.zeros(V_tgt, dtype=np.int64)
    n_pairs = len(src_off) - 1
    for lo in range(0, n_pairs, chunk):
        hi = min(lo + chunk, n_pairs)
        s_sent, s_id = _distinct_per_pair(src, src_off, lo, hi, V_src, "source")
        t_sent, t_id = _distinct_per_pair(tgt, tgt_off, lo, hi, V_tgt, "target")
        c_s += np.bincount(s_id, minlength=V_src)
        c_t += np.bincount(t_id, minlength=V_tgt)
        # every (s, t) of a pair: each distinct source piece repeated once per distinct target piece
        n_t = np.bincount(t_sent, minlength=hi - lo)  # distinct target pieces per pair
        t_first = np.cumsum(n_t) - n_t  # where each pair's target pieces start in t_id
        reps = n_t[s_sent]
        block = np.repeat(np.cumsum(reps) - reps, reps)
        t_idx = np.repeat(t_first[s_sent], reps) + (np.arange(int(reps.sum())) - block)
        new_keys, new_counts = np.unique(np.repeat(s_id, reps) * V_tgt + t_id[t_idx], return_counts=True)
        keys, counts = _merge_counts(keys, counts, new_keys, new_counts)
    return keys // V_tgt, keys % V_tgt, counts, c_s, c_t


def _distinct_per_pair(ids: np.ndarray, off: np.ndarray, lo: int, hi: int, V: int,
                       side: str) -> tuple[np.ndarray, np.ndarray]:
    """(pair - lo, id) of every distinct id of pairs lo..hi-1, sorted by pair then id."""
    x = np.asarray(ids[off[lo]:off[hi]], dtype=np.int64)
    if len(x) and (x.min() < 0 or x.max() >= V):
        raise S2SError(f"training pairs {lo + 1}-{hi}: a {side} id outside the model's {V} ids")
    pair = np.repeat(np.arange(hi - lo, dtype=np.int64), np.diff(np.asarray(off[lo:hi + 1], dtype=np.int64)))
    key = np.unique(pair * V + x)
    return key // V, key % V


def _merge_counts(keys: np.ndarray, counts: np.ndarray, new_keys: np.ndarray,
                  new_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sums per key of two sorted (key, count) lists."""
    all_keys = np.concatenate([keys, new_keys])
    all_counts = np.concatenate([counts, new_counts])
    if not len(all_keys):
        return all_keys, all_counts
    order = np.argsort(all_keys, kind="stable")
    all_keys, all_counts = all_keys[order], all_counts[order]
    starts = np.flatnonzero(np.r_[True, all_keys[1:] != all_keys[:-1]])
    return all_keys[starts], np.add.reduceat(all_counts, starts)


def top_k_per_source(s: np.ndarray, t: np.ndarray, score: np.ndarray, V_src: int, k: int) -> np.ndarray:
    """The k best-scoring t of every s -> (V_src, k) int32, best first (ties: lower id first),
    -1 where s has fewer than k partners."""
    order = np.lexsort((t, -score, s))  # by s, then score descending, then t
    s_sorted, t_sorted = s[order], t[order]
    first = np.searchsorted(s_sorted, np.arange(V_src))  # start of each s's run
    rank = np.arange(len(s_sorted)) - first[s_sorted]
    keep = rank < k
    table = np.full((V_src, k), -1, dtype=np.int32)
    table[s_sorted[keep], rank[keep]] = t_sorted[keep]
    return table


def most_frequent(tgt_ids: np.ndarray, V_tgt: int, n: int) -> np.ndarray:
    """The n target ids with the most tokens (ties: lower id first) -> (n,) int32."""
    counts = np.bincount(np.asarray(tgt_ids, dtype=np.int64), minlength=V_tgt)
    order = np.argsort(-counts, kind="stable")
    return order[:n][counts[order[:n]] > 0].astype(np.int32)


@dataclass
class Shortlist:
    top: Tensor  # (V_src, k) int32: each source piece's k target pieces, -1 padded
    frequent: Tensor  # (F,) int32: the most frequent target pieces
    settings: dict  # k, frequent, score, sentences: how it was built
    _on: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # device -> tables

    def tables_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(top, frequent) on ``device``, copied there once (not with every batch)."""
        if device == self.top.device:
            return self.top, self.frequent
        if device not in self._on:
            self._on[device] = (self.top.to(device), self.frequent.to(device))
        return self._on[device]

    def subset(self, src: Tensor, always: Sequence[int] = ()) -> Tensor:
        """The batch's target ids: the union of its source pieces' lists, the frequent
        pieces and ``always`` (special ids, a forced prefix's ids) -> (V',) int64, ascending.
        src (B, S) source ids (padding included: the pad's list is the frequent pieces')."""
        top, frequent = self.tables_on(src.device)
        listed = top[src.flatten()].flatten()  # (B * S * k,)
        extra = torch.tensor(list(always), dtype=torch.long, device=src.device)
        ids = torch.cat([listed[listed >= 0].long(), frequent.long(), extra])
        return torch.unique(ids)  # sorted


def subset_positions(ids: Tensor, x: Optional[Tensor]) -> Optional[Tensor]:
    """Target ids -> their positions in the ascending subset ``ids`` (every id >= 0 of x
    must be in it); negative entries (padding) stay -1."""
    if x is None:
        return None
    pos = torch.searchsorted(ids, x.clamp(min=0))
    return torch.where(x >= 0, pos, -1)


def subset_search_ids(s, ids: Tensor):
    """Special ids (bos, eos, pad: a :class:`s2s.search.SpecialIds`) as positions in the subset ``ids``."""
    bos, eos, pad = subset_positions(ids, torch.tensor([s.bos_id, s.eos_id, s.pad_id], device=ids.device)).tolist()
    return dataclasses.replace(s, bos_id=bos, eos_id=eos, pad_id=pad)


def build_shortlist(src: np.ndarray, src_off: np.ndarray, tgt: np.ndarray, tgt_off: np.ndarray, V_src: int,
                    V_tgt: int, k: int = 50, frequent: int = 200, score: str = "dice") -> Shortlist:
    """The table of the module docstring from training pairs given as flat ids and
    offsets (see :func:`cooccurrence`); the frequency list counts every target token."""
    if k < 1:
        raise S2SError(f"--k: {k} must be >= 1")
    if frequent < 0:
        raise S2SError(f"--frequent: {frequent} must be >= 0")
    if score not in SCORES:
        raise S2SError(f"--score: {score!r} is not {' or '.join(SCORES)}")
    s, t, c_st, c_s, c_t = cooccurrence(src, src_off, tgt, tgt_off, V_src, V_tgt)
    c_st = c_st.astype(np.float64)
    value = dice(c_st, c_s[s], c_t[t]) if score == "dice" else conditional_probability(c_st, c_s[s])
    top = top_k_per_source(s, t, value, V_src, k)
    freq = most_frequent(tgt[tgt_off[0]:tgt_off[-1]], V_tgt, frequent)
    return Shortlist(torch.from_numpy(top), torch.from_numpy(freq),
                     {"k": k, "frequent": frequent, "score": score, "sentences": len(src_off) - 1})


def flatten_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, ...]:
    """(source ids, target ids) pairs -> src, src_off, tgt, tgt_off as a prepared split stores them."""
    def flat(side: list) -> tuple[np.ndarray, np.ndarray]:
        off = np.concatenate([[0], np.cumsum([len(x) for x in side])]).astype(np.int64)
        return np.concatenate([np.asarray(x, dtype=np.int64) for x in side] or [np.zeros(0, np.int64)]), off

    src, src_off = flat([p[0] for p in pairs])
    tgt, tgt_off = flat([p[1] for p in pairs])
    return src, src_off, tgt, tgt_off


def save_shortlist(shortlist: Shortlist, directory: str | Path) -> Path:
    """Write ``directory/shortlist.safetensors`` atomically."""
    from safetensors.torch import save

    from s2s.textio import atomic_write

    path = Path(directory) / FILE
    data = save({"top": shortlist.top.contiguous(), "frequent": shortlist.frequent.contiguous()},
                metadata={"shortlist": json.dumps(shortlist.settings, sort_keys=True)})
    with atomic_write(path, "wb") as f:
        f.write(data)
    return path


def load_shortlist(directory: str | Path, V_src: int, V_tgt: int) -> Shortlist:
    """Read ``directory/shortlist.safetensors``; a missing or malformed file is one error line."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / FILE
    if not path.is_file():
        raise S2SError(f"{path}: no shortlist; build it with `s2s shortlist CONFIG -m {directory}`")
    try:
        with safe_open(str(path), framework="pt") as f:
            settings = json.loads((f.metadata() or {}).get("shortlist", "{}"))
            top, freq = f.get_tensor("top"), f.get_tensor("frequent")
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise S2SError(f"{path}: unreadable shortlist ({e}); build it again with `s2s shortlist`") from None
    if (top.dim() != 2 or top.size(0) != V_src or freq.dim() != 1 or top.dtype != torch.int32
            or bool((top >= V_tgt).any()) or bool((freq < 0).any()) or bool((freq >= V_tgt).any())):
        raise S2SError(f"{path}: does not fit this model ({V_src} source, {V_tgt} target ids); "
                       f"build it again with `s2s shortlist CONFIG -m {directory}`")
    return Shortlist(top, freq, settings)


def shortlist_from_data(cfg, model_dir: str | Path, k: int = 50, frequent: int = 200,
                        score: str = "dice") -> Path:
    """``s2s shortlist``: build the table from ``cfg``'s prepared training split (data.dir,
    memory-mapped) for the model in ``model_dir`` (same tokenizer) and store it there."""
    from s2s.data import BinDataset, tokenizer_fingerprint
    from s2s.modeldir import load_spec, vocab_sizes
    from s2s.trainer import check_prepared

    check_prepared(cfg)
    model_dir = Path(model_dir)
    if not (model_dir / "config.yaml").is_file():
        raise S2SError(f"{model_dir}: not a model directory (no config.yaml)")
    model_cfg, tok = load_spec(model_dir)
    meta = json.loads((Path(cfg.data.dir) / "meta.json").read_text(encoding="utf-8"))
    if meta.get("tokenizer") != tokenizer_fingerprint(model_cfg, model_dir):
        raise S2SError(f"{cfg.data.dir}: prepared with another tokenizer than {model_dir}'s")
    V_src, V_tgt = vocab_sizes(model_cfg, tok)
    ds = BinDataset(cfg.data.dir, "train", tok.pad_id, tok.bos_id)
    if len(ds) == 0:
        raise S2SError(f"{cfg.data.dir}: the training split is empty")
    table = build_shortlist(ds.src, ds.src_off, ds.tgt, ds.tgt_off, V_src, V_tgt, k, frequent, score)
    return save_shortlist(table, model_dir)
