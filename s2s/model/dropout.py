"""Dropout (docs/model.md (11)): on the CPU the mask is drawn from the generator's raw bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KEEP_BITS = 15  # a mask draw's resolution: u_i uniform over {0, ..., 2^15 - 1}


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> Tensor:
    """m_i = [u_i >= round(p 2^15)], u_i uniform over {0, ..., 2^15 - 1} and independent:
    m_i ~ Bernoulli(1 - p'), p' = round(p 2^15) / 2^15 (|p' - p| <= 2^-16).  bool.

    Four u_i come from each 63-bit integer of torch's generator (``random_`` of an int64,
    cut into 16-bit words whose top bit is dropped): on the CPU that is about 1/7 of the time
    ``torch.rand`` takes to draw one float per element, and the mask is a byte, not four.
    """
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_()
    u = words.view(torch.int16)[:n].view(shape).bitwise_and_((1 << KEEP_BITS) - 1)
    return u >= round(p * (1 << KEEP_BITS))


class Dropout(nn.Module):
    """Dropout(x) = x * m / (1 - p),  m_i ~ Bernoulli(1 - p), while training; x itself otherwise.

    The same function as ``nn.Dropout`` (with p on a 2^-15 grid).  On the CPU the mask is
    :func:`keep_mask`: torch's CPU ``bernoulli_``, which ``nn.Dropout`` draws with, takes about
    5x the time (5.9 against 1.2 ms for a 4096 x 256 activation, 2 threads), and a training
    update of the reference model draws 17 such masks.  Elsewhere it is ``F.dropout`` (one
    fused kernel on a GPU).
    """

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        return (x * keep_mask(x.shape, self.p, x.device)).mul_(1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"
