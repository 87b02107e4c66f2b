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

FILE = "shortlist.safetensors"
SCORES = ("dice", "prob")


def dice(c_st: np.ndarray, c_s: np.ndarray, c_t: np.ndarray) -> np.ndarray:
    """dice(s, t) = 2 c(s, t) / (c(s) + c(t)), elementwise."""
    return 2.0 * c_st / (c_s + c_t)


def conditional_probability(c_st: np.ndarray, c_s: np.ndarray) -> np.ndarray:
    """p(t | s) = c(s, t) / c(s), elementwise."""
    return c_st / c_s


def cooccurrence(pairs: Sequence[tuple[np.ndarray, np.ndarray]], V_src: int, V_tgt: int,
                 chunk: int = 20000) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sentence-level counts over (source ids, target ids) pairs.

    Returns (s, t, c_st) for every co-occurring (s, t), sorted by s then t, and
    c_s (V_src,), c_t (V_tgt,): pairs holding each piece.  Memory grows with the
    distinct (s, t) pairs, not with the corpus: pairs are counted chunk by chunk.
    """
    keys = np.zeros(0, dtype=np.int64)
    counts = np.zeros(0, dtype=np.int64)
    c_s = np.zeros(V_src, dtype=np.int64)
    c_t = np.zeros(V_tgt, dtype=np.int64)
    part: list[np.ndarray] = []

    def merge(part: list[np.ndarray], keys: np.ndarray, counts: np.ndarray):
        new_keys, new_counts = np.unique(np.concatenate(part), return_counts=True)
        all_keys = np.concatenate([keys, new_keys])
        all_counts = np.concatenate([counts, new_counts])
        order = np.argsort(all_keys, kind="stable")
        all_keys, all_counts = all_keys[order], all_counts[order]
        starts = np.flatnonzero(np.r_[True, all_keys[1:] != all_keys[:-1]])
        return all_keys[starts], np.add.reduceat(all_counts, starts) if len(starts) else all_counts

    for n, (src, tgt) in enumerate(pairs, 1):
        u_s = np.unique(np.asarray(src, dtype=np.int64))
        u_t = np.unique(np.asarray(tgt, dtype=np.int64))
        if (len(u_s) and (u_s[0] < 0 or u_s[-1] >= V_src)) or (len(u_t) and (u_t[0] < 0 or u_t[-1] >= V_tgt)):
            raise S2SError(f"training pair {n}: an id outside the model's vocabularies "
                           f"({V_src} source, {V_tgt} target ids)")
        c_s[u_s] += 1
        c_t[u_t] += 1
        part.append((u_s[:, None] * V_tgt + u_t[None, :]).ravel())
        if n % chunk == 0:
            keys, counts = merge(part, keys, counts)
            part = []
    if part:
        keys, counts = merge(part, keys, counts)
    return keys // V_tgt, keys % V_tgt, counts, c_s, c_t


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

    def subset(self, src: Tensor, always: Sequence[int] = ()) -> Tensor:
        """The batch's target ids: the union of its source pieces' lists, the frequent
        pieces and ``always`` (special ids, a forced prefix's ids) -> (V',) int64, ascending.
        src (B, S) source ids (padding included: the pad's list is the frequent pieces')."""
        listed = self.top.to(src.device)[src.flatten()].flatten()  # (B * S * k,)
        extra = torch.tensor(list(always), dtype=torch.long, device=src.device)
        ids = torch.cat([listed[listed >= 0].long(), self.frequent.to(src.device).long(), extra])
        return torch.unique(ids)  # sorted


def subset_positions(ids: Tensor, x: Optional[Tensor]) -> Optional[Tensor]:
    """Target ids -> their positions in the ascending subset ``ids`` (every id >= 0 of x
    must be in it); negative entries (padding) stay -1."""
    if x is None:
        return None
    pos = torch.searchsorted(ids, x.clamp(min=0))
    return torch.where(x >= 0, pos, -1)


def subset_search_ids(s, ids: Tensor):
    """Search settings whose special ids (bos, eos, pad) are positions in the subset ``ids``."""
    bos, eos, pad = subset_positions(ids, torch.tensor([s.bos_id, s.eos_id, s.pad_id], device=ids.device)).tolist()
    return dataclasses.replace(s, bos_id=bos, eos_id=eos, pad_id=pad)


def build_shortlist(pairs: Sequence[tuple[np.ndarray, np.ndarray]], tgt_tokens: np.ndarray, V_src: int,
                    V_tgt: int, k: int = 50, frequent: int = 200, score: str = "dice") -> Shortlist:
    """The table of the module docstring from training pairs (source ids, target ids) and
    all target tokens (for the frequency list)."""
    if k < 1:
        raise S2SError(f"--k: {k} must be >= 1")
    if frequent < 0:
        raise S2SError(f"--frequent: {frequent} must be >= 0")
    if score not in SCORES:
        raise S2SError(f"--score: {score!r} is not {' or '.join(SCORES)}")
    s, t, c_st, c_s, c_t = cooccurrence(pairs, V_src, V_tgt)
    c_st = c_st.astype(np.float64)
    value = dice(c_st, c_s[s], c_t[t]) if score == "dice" else conditional_probability(c_st, c_s[s])
    top = top_k_per_source(s, t, value, V_src, k)
    freq = most_frequent(tgt_tokens, V_tgt, frequent)
    return Shortlist(torch.from_numpy(top), torch.from_numpy(freq),
                     {"k": k, "frequent": frequent, "score": score, "sentences": len(pairs)})


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
    pairs = _Pairs(ds)
    return save_shortlist(build_shortlist(pairs, ds.tgt, V_src, V_tgt, k, frequent, score), model_dir)


class _Pairs:
    """The (source, target) id arrays of a BinDataset, as a sequence."""

    def __init__(self, ds) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __iter__(self):
        return (self.ds.pair(i) for i in range(len(self.ds)))
