"""The pointer-generator (docs/model.md (41); See et al. 2017): the output
distribution mixes generating a word from the vocabulary with copying one
from the source, weighted by the last decoder layer's cross-attention.

    P(w)  = p_gen P_vocab(w) + (1 - p_gen) sum_{j: x_j = w} a_tj
    p_gen = sigmoid(w_p . [h_t; ctx_t; x_t] + b_p),   ctx_t = sum_j a_tj H_enc_j

It reads the decoder's logits and states; the decoder block itself knows
nothing of it (it only hands over its cross-attention a).  The gate's w_p, b_p
stay the model's linear layer ``p_gen_proj`` (their state-dict keys, and
``--quantize int8`` quantizes them like every linear layer), handed to the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CopyHead(nn.Module):
    """log P(w) of the pointer-generator (no parameters of its own: ``gate`` holds w_p, b_p)."""

    def forward(self, gate: nn.Module, z: Tensor, h: Tensor, x_in: Tensor, a: Tensor, h_enc: Tensor,
                src: Tensor) -> Tensor:
        """gate: [h_t; ctx_t; x_t] (.., 3 d) -> w_p . [...] + b_p (.., 1); z (B, T, V) logits,
        h (B, T, d) decoder states, x_in (B, T, d) decoder input embeddings, a (B, T, S) copy
        attention, h_enc (B, S, d), src (B, S) -> log P (B, T, V).

        Computed in fp32 as log(p_gen P_vocab) (+) log((1 - p_gen) copy); P is
        normalized, so softmax and cross-entropy over it leave it unchanged.
        """
        a = a.float()
        ctx = a @ h_enc.float()  # (B, T, d)
        g = gate(torch.cat([h, ctx.to(h.dtype), x_in], dim=-1)).float()  # (B, T, 1)
        log_gen = torch.log_softmax(z.float(), dim=-1) + F.logsigmoid(g)
        copy = torch.zeros_like(log_gen).scatter_add_(2, src[:, None, :].expand(-1, a.size(1), -1), a)
        seen = copy > 0  # log 0 = -inf without a NaN gradient
        log_copy = torch.where(seen, torch.log(torch.where(seen, copy, torch.ones_like(copy))),
                               float("-inf")) + F.logsigmoid(-g)
        return torch.logaddexp(log_gen, log_copy)
