"""The real positions of a padded batch, packed into rows of their own.

A batch of B sources padded to S positions holds N <= B S real tokens.  Every
position-wise part of an encoder block (the norms, the Q/K/V and output
projections, the FFN, the residual sums) gives a real position the same output
whatever the padding beside it (in fp32 and bf16; an int8 product quantizes its
input over all its rows, so there the padding rows' absence moves the scale and
the outputs a little), so it can run on the N real rows alone; only
the attention mixes positions, and it runs on the padded (B, S) layout, where
the padding mask M^pad already gives padded keys no weight:

    X_packed = X[real]                 (N, d_model), real (B, S) bool
    pad(Y)   = Y at the real positions, 0 at the padded ones   (B, S, e)

CTranslate2's encoder does the same (its ``Padder``).  On the ddtp test
sentences batched 64 at a time, a quarter of the encoder's positions are
padding.  Training packs the decoder's positions the same way (its batches are
sorted by source length: 14% of their target positions are padding, 0.4% of
their source positions); the self-attention's causal mask already keeps a real
query from the padded positions after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

MIN_PADDING = 0.1  # pack a batch whose share of padded positions is at least this


@dataclass
class Packing:
    """Where a padded (B, S) batch's N real positions are: flat indices b S + s."""

    index: Tensor  # (N,) long, ascending
    batch: int  # B
    length: int  # S

    @classmethod
    def of(cls, src: Tensor, pad_id: int, min_padding: float = MIN_PADDING) -> Optional["Packing"]:
        """The packing of src (B, S) ids, or None when its padding is under ``min_padding`` of
        the positions (gathering and scattering would cost more than the padding)."""
        return cls.of_real(src != pad_id, min_padding)

    @classmethod
    def of_real(cls, real: Tensor, min_padding: float = MIN_PADDING) -> Optional["Packing"]:
        """The packing of the True positions of ``real`` (B, S) bool, or None as in :meth:`of`."""
        flat = real.flatten()
        index = flat.nonzero().squeeze(1)  # one wait for a device, not two
        if index.numel() > (1.0 - min_padding) * flat.numel():
            return None
        return cls(index, real.size(0), real.size(1))

    def pack(self, x: Tensor) -> Tensor:
        """x (B, S, e) -> its real positions (N, e)."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.index)

    def pad(self, y: Tensor) -> Tensor:
        """y (N, e) -> (B, S, e): y at the real positions, 0 at the padded ones."""
        out = y.new_zeros(self.batch * self.length, y.size(-1))
        return out.index_copy_(0, self.index, y).view(self.batch, self.length, -1)
