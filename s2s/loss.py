"""The training loss: the label-smoothed NLL of a batch's scores, and its gradient.

    L = sum over real targets t of (1-eps)(-log p_t(y_t)) + eps (1/V) sum_v (-log p_t(v))
      = sum_t  lse(z_t) - (1-eps) z_t[y_t] - (eps/V) sum_v z_t[v]          (z_t: the scores)
    dL/dz_t = g (softmax(z_t) - (1-eps) onehot(y_t) - eps/V)

:func:`label_smoothed_nll` computes exactly what ``F.cross_entropy(..., label_smoothing=eps,
reduction="sum")`` computes.  On the CPU it runs :class:`LabelSmoothedNLL`, which reads the
(n, V) scores once, a few rows at a time, in fp32 whatever their dtype: each block's softmax
gives both the loss and the gradient's numerator g^-1 dL/dz_t, which is written, in the
scores' dtype, where the gradient will be; the backward pass only scales it by g.  No fp32
copy of all the scores, no (n, V) one-hot or smoothing tensors, one exp per score (torch's
softmax kernel, about 3x the speed of ``exp_``), and each block stays in the cache between
its passes.  On 3,840 x 8,000 scores with 2 threads of an AMD EPYC (Zen 5), forward +
backward take 19-26 ms in bf16 and 26-30 ms in fp32, against 42-56 and 55-57 ms when the
backward pass read the scores again and recomputed their softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from s2s.tokenizer import PAD_ID

ROWS = 32  # rows of scores per block: two 32 x V fp32 blocks (1 MiB each at V = 8,000) stay in the cache


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int = PAD_ID) -> Tensor:
    """sum over non-pad t of (1-eps)(-log p_t(y_t)) + eps * (1/V) sum_v (-log p_t(v)).

    logits (B, T, V), target (B, T) (or only the real positions: (n, V), (n,))
    -> scalar fp32 sum (divide by the token count for the mean).  eps = 0 gives the plain NLL.
    """
    V = logits.size(-1)
    z, y = logits.reshape(-1, V), target.reshape(-1)
    if z.device.type == "cpu" and not torch.compiler.is_compiling():
        return LabelSmoothedNLL.apply(z, y, epsilon, pad_id)
    return F.cross_entropy(z.float(), y, ignore_index=pad_id, reduction="sum", label_smoothing=epsilon)


class LabelSmoothedNLL(torch.autograd.Function):
    """L and dL/dz of the module docstring, block by block of :data:`ROWS` rows.

    forward(z (n, V) any float dtype, y (n,), eps, pad_id) -> L (fp32 scalar).  Per block:
    p_t = softmax(z_t) in fp32; lse(z_t) = max_v z_t - log max_v p_t (max_v p_t >= 1/V never
    underflows); and, when z needs a gradient, q_t = p_t - (1-eps) onehot(y_t) - eps/V, kept
    in z's dtype (z itself is not saved, nor written).  backward(g) = q_t g, 0 at pad targets,
    computed in place in q: the backward pass runs once (a second one raises).  In bf16, g is
    rounded to bf16 (a relative 2^-9 at most, the same for every score of the batch).
    """

    @staticmethod
    def forward(ctx, z: Tensor, y: Tensor, epsilon: float, pad_id: int) -> Tensor:  # type: ignore[override]
        n, V = z.shape
        block = min(ROWS, n)
        lse = torch.empty(n, dtype=torch.float32)
        z_sum = torch.empty(n, dtype=torch.float32)
        z_f = torch.empty(block, V, dtype=torch.float32)  # fp32 blocks, reused
        p_f = torch.empty(block, V, dtype=torch.float32)
        q = torch.empty_like(z) if ctx.needs_input_grad[0] else None
        minus_target = torch.full((block, 1), epsilon - 1.0)  # -(1-eps) at y_t
        for i in range(0, n, ROWS):
            rows = slice(i, i + ROWS)
            r = min(ROWS, n - i)
            z_b = z_f[:r].copy_(z[rows])
            torch.sum(z_b, -1, out=z_sum[rows])
            z_max = z_b.amax(-1)
            p_b = torch.ops.aten._softmax.out(z_b, -1, False, out=p_f[:r])
            torch.sub(z_max, p_b.amax(-1).log_(), out=lse[rows])
            if q is not None:
                q[rows] = p_b.sub_(epsilon / V).scatter_add_(1, y[rows, None], minus_target[:r])
        keep = y != pad_id
        z_y = z.gather(1, y[:, None]).squeeze(1).float()
        per_token = lse - (1 - epsilon) * z_y - (epsilon / V) * z_sum
        ctx.q, ctx.keep = q, keep  # q: an intermediate, not an input or output
        return per_token[keep].sum()

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        q, keep = ctx.q, ctx.keep
        if q is None:
            raise RuntimeError("LabelSmoothedNLL's backward pass runs once: its saved gradient is spent")
        ctx.q = None
        g_t = (g.float() * keep)[:, None].to(q.dtype)  # (n, 1): 0 at pad targets
        return q.mul_(g_t), None, None, None
