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

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from s2s.tokenizer import PAD_ID

ROWS = 64  # rows of scores per block: two 64 x V fp32 blocks (2 MiB each at V = 8,000) stay in the cache
# (one 512-row bf16 chunk of OutputNLL, Zen 5, 2 threads: 2.25 ms in blocks of 64, 2.70 in blocks of 32)


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


def smoothed_nll(lse: Tensor, z_y: Tensor, z_sum: Tensor, epsilon: float, V: int) -> Tensor:
    """Per target t: lse(z_t) - (1-eps) z_t[y_t] - (eps/V) sum_v z_t[v]   (the module docstring's L_t)."""
    return lse - (1 - epsilon) * z_y - (epsilon / V) * z_sum


def smoothed_softmax_blocks(z: Tensor, y: Tensor, epsilon: float, lse: Tensor, z_sum: Tensor,
                            q: Optional[Tensor]) -> None:
    """For the rows t of z (r, V), :data:`ROWS` at a time in fp32: lse[t] = lse(z_t) and
    z_sum[t] = sum_v z_t[v] (fp32 (r,) outputs), and with ``q`` (r, V) (z itself allowed: each
    block is read before it is written) q_t = softmax(z_t) - eps/V - (1-eps) onehot(y_t) in
    q's dtype.  lse(z_t) = max_v z_t - log max_v p_t (max_v p_t >= 1/V never underflows)."""
    r, V = z.shape
    block = min(ROWS, r)
    z_f = torch.empty(block, V, dtype=torch.float32)  # fp32 blocks, reused
    p_f = torch.empty(block, V, dtype=torch.float32)
    minus_target = torch.full((block, 1), epsilon - 1.0)  # -(1-eps) at y_t
    for i in range(0, r, ROWS):
        rows = slice(i, i + ROWS)
        k = min(ROWS, r - i)
        z_b = z_f[:k].copy_(z[rows])
        torch.sum(z_b, -1, out=z_sum[rows])
        z_max = z_b.amax(-1)
        p_b = torch.ops.aten._softmax.out(z_b, -1, False, out=p_f[:k])
        torch.sub(z_max, p_b.amax(-1).log_(), out=lse[rows])
        if q is not None:  # p - (1-eps) onehot(y), then - eps/V written to q in q's dtype: one pass
            torch.sub(p_b.scatter_add_(1, y[rows, None], minus_target[:k]), epsilon / V, out=q[rows])


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
        n = z.size(0)
        lse = torch.empty(n, dtype=torch.float32)
        z_sum = torch.empty(n, dtype=torch.float32)
        q = torch.empty_like(z) if ctx.needs_input_grad[0] else None
        smoothed_softmax_blocks(z, y, epsilon, lse, z_sum, q)
        keep = y != pad_id
        z_y = z.gather(1, y[:, None]).squeeze(1).float()
        per_token = smoothed_nll(lse, z_y, z_sum, epsilon, z.size(1))
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


# --------------------------------------------------------------------------- #
# bf16 training: the output head and the loss in one pass, without the (n, V) scores
# --------------------------------------------------------------------------- #
# Training scores n target positions (about 4,000 a batch) against V pieces (8,000): the scores
# z = h W^T + b and their gradient are (n, V) tensors, 63 MB each in bf16, written by one product
# and read back by the loss and by the two products of the backward pass.  OutputNLL takes h
# CHUNK rows at a time instead: z of the chunk, its loss terms and q = g^-1 dL/dz written over z,
# then at once dL/dh = q W and dL/dW += q^T h (and dL/db), so a chunk's scores are made and used
# while they are in the cache and the whole (n, V) never is.  The backward pass only scales the
# saved gradients by g.  2 threads of an AMD EPYC (Zen 5, avx512_bf16): the reference model's
# head and loss, forward + backward, 125 -> 95 ms (3,968 rows); a whole bf16 update 0.953x and
# 0.948x (paired, benchmarks/README.md).  fp32, whose products are 4x slower, was level (1.024x, 1.009x) and
# keeps the scores.

CHUNK = 512  # rows of h per product (1,024: a bf16 update 0.966x)


def fuses_output_nll(h: Tensor, W: Tensor) -> bool:
    """Whether :func:`output_nll` takes h (n, d) and W (V, d) in one pass (:class:`OutputNLL`):
    bf16 on the CPU, while autograd records the head (a training step), outside torch.compile."""
    return (h.device.type == "cpu" and h.dtype == torch.bfloat16 and W.dtype == torch.bfloat16
            and torch.is_grad_enabled() and (h.requires_grad or W.requires_grad)
            and not torch.compiler.is_compiling())


def output_nll(h: Tensor, W: Tensor, b: Optional[Tensor], target: Tensor, epsilon: float,
               pad_id: int = PAD_ID) -> Tensor:
    """label_smoothed_nll(h W^T + b, target, epsilon, pad_id): h (n, d), W (V, d), b (V,) or
    None, target (n,) -> the fp32 sum; in one pass without the (n, V) scores where
    :func:`fuses_output_nll` (:class:`OutputNLL`), else through F.linear."""
    if fuses_output_nll(h, W):
        return OutputNLL.apply(h, W, b, target, epsilon, pad_id)
    return label_smoothed_nll(F.linear(h, W, b), target, epsilon, pad_id)


class OutputNLL(torch.autograd.Function):
    """L = sum over non-pad t of L_t(z_t), z_t = h_t W^T + b, and its gradients, chunk by chunk.

    forward(h (n, d), W (V, d), b (V,) or None, y (n,), eps, pad_id) -> L (fp32 scalar).
    For each chunk c of :data:`CHUNK` rows (the last padded with zero rows, so that every
    product has one shape, which oneDNN's bf16 kernels are built for once):

        z_c = h_c W^T + b                                  (CHUNK, V), h's dtype
        L_t, and q_c = softmax(z_c) - eps/V - (1-eps) onehot(y_c), written over z_c
        (0 in the rows of pad targets and of the padding)
        dh_c = q_c W,   dW += q_c^T h_c,   db += sum_t q_t  (dW and db summed in fp32)

    backward(g) = (g dh, g dW, g db) in the inputs' dtypes.  The same values as
    label_smoothed_nll(F.linear(h, W, b)) up to the order of the sums and where g is applied
    (after the products instead of before).  Any float dtype works; the model takes it for bf16.
    """

    @staticmethod
    def forward(ctx, h: Tensor, W: Tensor, b: Optional[Tensor], y: Tensor, epsilon: float,  # type: ignore[override]
                pad_id: int) -> Tensor:
        n, d = h.shape
        V = W.size(0)
        need_h, need_W, need_b = ctx.needs_input_grad[:3]
        grads = need_h or need_W or need_b
        R = min(CHUNK, max(n, 1))
        h, W = h.detach(), W.detach()
        W_t = W.t().contiguous()  # (d, V): the forward product as a plain GEMM (s2s.model.gemm.WIDE)
        z = h.new_empty(R, V)  # one chunk's scores; q is written over them
        h_pad = h.new_zeros(R, d)  # the last chunk, padded with zero rows
        dh_c = h.new_empty(R, d) if need_h else None
        lse, z_sum, z_y = (torch.empty(n, dtype=torch.float32) for _ in range(3))
        keep = y != pad_id
        has_pad = not bool(keep.all())
        dh = torch.empty_like(h) if need_h else None
        dW = torch.zeros(V, d, dtype=torch.float32) if need_W else None
        db = torch.zeros(V, dtype=torch.float32) if need_b else None
        for i in range(0, n, R):
            r = min(R, n - i)
            rows = slice(i, i + r)
            if r == R:
                h_c = h[rows]
            else:
                h_pad[:r] = h[rows]
                h_c = h_pad
            if b is None:
                torch.mm(h_c, W_t, out=z)
            else:
                torch.addmm(b.detach(), h_c, W_t, out=z)  # + b inside the product: rounded once
            z_r, y_r = z[:r], y[rows]
            z_y[rows] = z_r.gather(1, y_r[:, None]).squeeze(1)
            smoothed_softmax_blocks(z_r, y_r, epsilon, lse[rows], z_sum[rows], z_r if grads else None)
            if not grads:
                continue
            z[r:] = 0  # the padding rows: no gradient
            if has_pad:
                z_r[~keep[rows]] = 0  # pad targets: no gradient
            if need_h:
                dh[rows] = torch.mm(z, W, out=dh_c)[:r]
            if need_W and z.dtype == torch.float32:
                dW.addmm_(z.t(), h_c)
            elif need_W:
                dW.add_(z.t() @ h_c)  # the chunk's product in h's dtype, summed in fp32
            if need_b:
                db.add_(z.sum(0, dtype=torch.float32))
        ctx.grads = (dh, dW, db)
        ctx.dtypes = (h.dtype, W.dtype, None if b is None else b.dtype)
        return smoothed_nll(lse, z_y, z_sum, epsilon, V)[keep].sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):  # type: ignore[override]
        g = g.float()
        dh, dW, db = ((None if t is None else (t.float() * g).to(dtype))
                      for t, dtype in zip(ctx.grads, ctx.dtypes))
        return dh, dW, db, None, None, None
