"""Position information: sinusoidal or learned input embeddings, or the T5
relative-position bias added to the attention logits (docs/model.md (15)-(18)).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn


def sinusoidal_table(positions: Tensor, d_model: int) -> Tensor:
    """PE(pos) = [sin(pos w_i)]_{i<d/2} ++ [cos(pos w_i)]_{i<d/2},  w_i = 10000^(-2i/d).

    positions (L,) -> (L, d_model).  (Sines in the first half and cosines in
    the second, the layout fairseq and Marian use.)
    """
    half = d_model // 2
    i = torch.arange(half, dtype=torch.float32, device=positions.device)
    w = torch.exp(-math.log(10000.0) * 2 * i / d_model)  # (d/2,)
    angles = positions.float()[:, None] * w[None, :]  # (L, d/2)
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if d_model % 2:
        table = torch.nn.functional.pad(table, (0, 1))
    return table


def fairseq_sinusoid(rows: int, d_model: int, pad_row: int) -> Tensor:
    """fairseq's (and M2M100's) table: row p = [sin(p w_i)]_{i<d/2} ++ [cos(p w_i)]_{i<d/2},
    w_i = 10000^(-i/(d/2 - 1)) (note d/2 - 1, where :func:`sinusoidal_table` has d/2),
    an odd d padded with a zero column, the row ``pad_row`` all zeros.  -> (rows, d_model)."""
    half = d_model // 2
    w = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))  # (d/2,)
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * w[None, :]  # (rows, d/2)
    table = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if d_model % 2:
        table = torch.nn.functional.pad(table, (0, 1))
    table[pad_row] = 0
    return table


class SinusoidalPositions(nn.Module):
    """PE(start..start+L-1), read from a table of the positions asked for so far: a
    decoder step reads one row instead of computing it (the table is neither a
    parameter nor saved; it grows to twice its length when a position is past it)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model
        self._table: Optional[Tensor] = None  # (n, d_model): PE(0..n-1)

    def forward(self, L: int, start: int = 0, device=None) -> Tensor:
        device = torch.device("cpu") if device is None else torch.device(device)
        table = self._table
        if table is None or table.size(0) < start + L or table.device != device:
            n = max(start + L, 64, 2 * table.size(0) if table is not None and table.device == device else 0)
            with torch.inference_mode(False), torch.no_grad():  # usable in training too
                table = sinusoidal_table(torch.arange(n, device=device), self.d_model)
            self._table = table
        return table[start:start + L]  # (L, d_model)


class LearnedPositions(nn.Module):
    """P(pos) = table[pos + offset]; the first ``offset`` rows are never read
    (BART keeps 2 there, a relic of fairseq's padding-based position ids)."""

    def __init__(self, max_positions: int, d_model: int, offset: int = 0):
        super().__init__()
        self.max_positions = max_positions
        self.offset = offset
        self.table = nn.Embedding(max_positions + offset, d_model)
        nn.init.normal_(self.table.weight, std=d_model ** -0.5)

    def forward(self, L: int, start: int = 0, device=None) -> Tensor:
        if start + L > self.max_positions:
            raise ValueError(f"position {start + L - 1} exceeds model.max_positions={self.max_positions}")
        pos = torch.arange(start + self.offset, start + L + self.offset, device=device)
        return self.table(pos)  # (L, d_model)


def relative_position_bucket(distance: Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Tensor:
    """bucket(i - j) of T5 for query i and key j (``distance = i - j``).

    Bidirectional: half the buckets for keys after the query (j > i), half for
    keys at or before it.  Unidirectional: keys after the query share bucket 0.
    Within each half, distances below ``max_exact = n/2`` get their own
    bucket; larger ones are log-spaced up to ``max_distance``:
        bucket(n) = max_exact + log(n / max_exact) / log(max_distance / max_exact)
                    * (n_buckets - max_exact),   capped at n_buckets - 1.
    """
    bucket = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (distance < 0).long() * num_buckets  # key to the right
        n = distance.abs()
    else:
        n = distance.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """s_ij += b_{bucket(i-j)}: one learned scalar per (bucket, head)."""

    def __init__(self, heads: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.bias = nn.Embedding(num_buckets, heads)

    def forward(self, T_q: int, T_k: int, q_start: int = 0, device=None) -> Tensor:
        i = torch.arange(q_start, q_start + T_q, device=device)[:, None]  # query positions
        j = torch.arange(T_k, device=device)[None, :]  # key positions
        buckets = relative_position_bucket(i - j, self.bidirectional, self.num_buckets,
                                           self.max_distance)  # (T_q, T_k)
        return self.bias(buckets).permute(2, 0, 1)[None]  # (1, heads, T_q, T_k)
