"""Training's CPU kernels against torch's own: the fused label-smoothed NLL and the output head
fused with it (s2s.loss), bf16
products in row blocks (s2s.model.gemm), the attention's matmul path while training, and the
dropout mask drawn from raw bits (s2s.model.dropout)."""

import pytest
import torch
import torch.nn.functional as F

import s2s.loss
import s2s.model.base
from s2s.config import load_config
from s2s.loss import ROWS, LabelSmoothedNLL, OutputNLL, fuses_output_nll, label_smoothed_nll, output_nll
from s2s.model.attention import MATH_KEYS, MultiHeadAttention, attention, causal_mask, padding_mask
from s2s.model.dropout import KEEP_BITS, Dropout, keep_mask
from s2s.model.gemm import ROW_BLOCK, RowBlockLinear, RowBlockLinearModule, row_block_linear
from s2s.trainer import make_trainer


def _reference_nll(z, y, eps, pad):
    return F.cross_entropy(z.float(), y, ignore_index=pad, reduction="sum", label_smoothing=eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_nll_equals_cross_entropy_value_and_gradient(dtype, eps):
    g = torch.Generator().manual_seed(0)
    n, V, pad = 3 * ROWS + 5, 50, 0  # a last block of 5 rows
    z = (3 * torch.randn(n, V, generator=g)).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (n,), generator=g)
    y[::7] = pad
    before = z.detach().clone()
    loss = LabelSmoothedNLL.apply(z, y, eps, pad)
    (dz,) = torch.autograd.grad(2.5 * loss, z)
    want = _reference_nll(z, y, eps, pad)
    (want_dz,) = torch.autograd.grad(2.5 * want, z)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-3)
    assert dz.dtype == dtype
    torch.testing.assert_close(dz.float(), want_dz.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)
    assert torch.equal(z.detach(), before)  # the scores are not written over
    assert float(dz[y == pad].abs().max()) == 0.0  # pad targets give no gradient


def test_fused_nll_backward_runs_once_and_needs_no_gradient_to_score():
    z = torch.randn(ROWS + 3, 20, requires_grad=True)
    y = torch.randint(1, 20, (ROWS + 3,))
    loss = LabelSmoothedNLL.apply(z, y, 0.1, 0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()
    with torch.no_grad():  # scoring (dev loss): the same value, no gradient kept
        torch.testing.assert_close(LabelSmoothedNLL.apply(z, y, 0.1, 0), loss.detach())


def test_label_smoothed_nll_takes_batch_shapes():
    z, y = torch.randn(2, 3, 11), torch.randint(1, 11, (2, 3))
    torch.testing.assert_close(label_smoothed_nll(z, y, 0.1, 0), _reference_nll(z.view(6, 11), y.view(6), 0.1, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_output_nll_equals_cross_entropy_of_the_head(dtype, bias, eps, monkeypatch):
    """The head and the loss chunk by chunk: L and dL/dh, dL/dW, dL/db as F.linear + cross_entropy."""
    monkeypatch.setattr(s2s.loss, "CHUNK", 16)
    g = torch.Generator().manual_seed(1)
    n, d, V, pad = 3 * 16 + 5, 8, 37, 0  # a last chunk of 5 rows, padded
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_(True)
    W = torch.randn(V, d, generator=g).to(dtype).requires_grad_(True)
    b = torch.randn(V, generator=g).to(dtype).requires_grad_(True) if bias else None
    y = torch.randint(1, V, (n,), generator=g)
    y[::7] = pad
    inputs = [t for t in (h, W, b) if t is not None]
    loss = OutputNLL.apply(h, W, b, y, eps, pad)
    grads = torch.autograd.grad(2.5 * loss, inputs)
    if dtype == torch.float32:  # against float64
        ref = [t.detach().double().requires_grad_(True) for t in inputs]
        want = F.cross_entropy(F.linear(*ref), y, ignore_index=pad, reduction="sum", label_smoothing=eps)
    else:  # against the scores path in bf16, which rounds the scores to bf16 too
        ref = [t.detach().clone().requires_grad_(True) for t in inputs]
        want = label_smoothed_nll(F.linear(*ref), y, eps, pad)
    want_grads = torch.autograd.grad(2.5 * want, ref)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=1e-5, atol=1e-3)
    for got, exp, t in zip(grads, want_grads, inputs):
        assert got.dtype == t.dtype
        scale = float(exp.abs().max())
        torch.testing.assert_close(got.double(), exp.double(), rtol=1e-5 if dtype == torch.float32 else 2e-2,
                                   atol=1e-6 * scale if dtype == torch.float32 else 1e-2 * scale)
    assert float(grads[0][y == pad].abs().max()) == 0.0  # pad targets give h no gradient


def test_output_nll_takes_bf16_training_steps_only():
    h, W = torch.randn(5, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    y = torch.randint(1, 9, (5,))
    assert not fuses_output_nll(h, W)  # fp32 keeps its scores (the one pass was not faster)
    hb, Wb = h.detach().bfloat16().requires_grad_(True), W.detach().bfloat16().requires_grad_(True)
    assert fuses_output_nll(hb, Wb)
    assert output_nll(hb, Wb, None, y, 0.1, 0).grad_fn.name().startswith("OutputNLL")
    none = OutputNLL.apply(hb[:0], Wb, None, y[:0], 0.1, 0)  # a batch without targets
    (dW,) = torch.autograd.grad(none, Wb)
    assert float(none.detach()) == 0.0 and not dW.any()
    with torch.no_grad():
        assert not fuses_output_nll(hb, Wb)
        torch.testing.assert_close(output_nll(hb, Wb, None, y, 0.1, 0),
                                   label_smoothed_nll(F.linear(hb, Wb), y, 0.1, 0))


@pytest.mark.parametrize("head", [[], ["model.tie_output=false", "model.output_bias=true", "model.scale_output=true"]])
def test_bf16_training_step_with_the_fused_head_equals_the_scores_path(prepared, tmp_path, monkeypatch, head):
    """One bf16 batch: loss and every gradient of the one-pass head as through the (n, V) scores."""
    cfg = load_config(prepared, ["train.precision=bf16", "model.dropout=0", *head])
    trainer = make_trainer(cfg, tmp_path / "run", show_progress=False)
    monkeypatch.setattr(s2s.loss, "CHUNK", 32)  # several chunks, the last one padded
    batch = trainer.train_data.batch(trainer.epoch_batches(0)[0])
    calls = []
    monkeypatch.setattr(OutputNLL, "forward", staticmethod(lambda *a, f=OutputNLL.forward: calls.append(1) or f(*a)))
    trainer.bf16.refresh()
    fused = trainer.forward_backward(batch, batch.n_tgt_tokens)
    fused_grads = [p.grad.clone() for p in trainer.model.parameters()]
    assert calls and batch.n_tgt_tokens > 32
    trainer.optimizer.zero_grad()
    monkeypatch.setattr(s2s.model.base, "fuses_output_nll", lambda h, W: False)
    scores = trainer.forward_backward(batch, batch.n_tgt_tokens)
    assert len(calls) == 1
    torch.testing.assert_close(fused, scores, rtol=1e-3, atol=1e-3)
    for (name, p), g in zip(trainer.model.named_parameters(), fused_grads):
        torch.testing.assert_close(g, p.grad, rtol=5e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("rows", [5, ROW_BLOCK, 2 * ROW_BLOCK + 3])
@pytest.mark.parametrize("bias", [True, False])
def test_row_block_linear_gradients(rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 8, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(lambda x, W, b: RowBlockLinear.apply(x.view(1, rows, 8), W, b), (x, W, b))
    torch.testing.assert_close(RowBlockLinear.apply(x, W, b), F.linear(x, W, b))


def test_row_block_linear_takes_bf16_training_products_only():
    x = torch.randn(3, 7, 16, requires_grad=True)
    W = torch.randn(4, 16, requires_grad=True)
    assert not row_block_linear(x, W).grad_fn.name().startswith("RowBlockLinear")  # fp32: F.linear
    xb, Wb = x.detach().bfloat16().requires_grad_(True), W.detach().bfloat16().requires_grad_(True)
    y = row_block_linear(xb, Wb)
    assert y.grad_fn.name().startswith("RowBlockLinear")
    with torch.no_grad():  # decoding: F.linear
        assert row_block_linear(xb, Wb).grad_fn is None
    torch.testing.assert_close(y.float(), F.linear(xb, Wb).float(), rtol=2e-2, atol=2e-2)


def test_bf16_training_multiplies_in_row_blocks(prepared, tmp_path):
    cfg = load_config(prepared, ["train.precision=bf16"])
    trainer = make_trainer(cfg, tmp_path / "run", show_progress=False)
    kinds = {type(m) for m in trainer.work.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {RowBlockLinearModule}
    assert trainer.work.gemm == "rows"
    assert all(type(m) is torch.nn.Linear for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    fp32 = make_trainer(load_config(prepared, ["train.precision=fp32"]), tmp_path / "run32", show_progress=False)
    assert not any(isinstance(m, RowBlockLinearModule) for m in fp32.work.modules())


@pytest.mark.parametrize("cross", [False, True])
def test_training_attention_path_equals_flash_forward_and_backward(cross):
    """While training on the CPU with at most MATH_KEYS keys, attention runs as two matmuls and
    an fp32 softmax: the same values and gradients as torch's scaled_dot_product_attention."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, cross=cross)
    B, T, S = 3, 9, 7
    q = torch.randn(B, 4, T, 8, requires_grad=True)
    k = torch.randn(B, 4, S if cross else T, 8, requires_grad=True)
    v = torch.randn(B, 4, S if cross else T, 8, requires_grad=True)
    src = torch.ones(B, S, dtype=torch.long)
    src[0, -2:] = 0
    mask = padding_mask(src, 0) if cross else causal_mask(T)
    dout = torch.randn(B, 4, T, 8)
    out, _ = mha.attend_heads(q, k, v, mask, need_weights=False)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    assert out.grad_fn.name() != want.grad_fn.name()  # the matmul path ran, not the flash kernel
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
    assert MATH_KEYS >= 128


@pytest.mark.parametrize("cross", [False, True])
def test_bf16_training_attention_multiplies_bf16_and_takes_the_softmax_in_fp32(cross, monkeypatch):
    """bf16 inputs: Q K^T and A V multiply bf16 (as autocast does) and the softmax runs in fp32;
    values and gradients stay within bf16 rounding of the fp32 path's."""
    torch.manual_seed(1)
    mha = MultiHeadAttention(64, 4, cross=cross)
    B, T, S = 3, 11, 9
    S = S if cross else T
    q32, k32, v32 = (torch.randn(B, 4, L, 16) for L in (T, S, S))
    src = torch.ones(B, S, dtype=torch.long)
    src[0, -3:] = 0
    mask = padding_mask(src, 0) if cross else causal_mask(T)
    dout = torch.randn(B, 4, T, 16)

    def run(dtype):
        q, k, v = (x.to(dtype).requires_grad_() for x in (q32, k32, v32))
        out, _ = mha.attend_heads(q, k, v, mask, need_weights=False)
        return out, torch.autograd.grad(out, (q, k, v), dout.to(dtype))

    seen = []
    softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax",
                        lambda x, *a, **kw: seen.append((x.dtype, kw.get("dtype"))) or softmax(x, *a, **kw))
    attention(q32.bfloat16(), k32.bfloat16(), v32.bfloat16())  # no mask: the bf16 product's scores
    assert seen == [(torch.bfloat16, torch.float32)]  # reach the softmax in bf16, which sums in fp32
    seen.clear()
    out16, grads16 = run(torch.bfloat16)
    assert seen == [(torch.float32, None)]  # masked by an fp32 mask: the scores are fp32 already
    assert out16.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads16)
    assert out16.grad_fn.name() == "UnsafeViewBackward0"  # the bf16 product A V, no cast after it
    out32, grads32 = run(torch.float32)
    torch.testing.assert_close(out16.float(), out32, rtol=0.03, atol=0.03)
    for got, want in zip(grads16, grads32):
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_attention_in_float64_keeps_float64_precision():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, L, 4, dtype=torch.float64, requires_grad=True) for L in (5, 6, 6))
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.float64)
    mask[0, ..., -2:] = float("-inf")
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, mask)[0], (q, k, v))
    out, A = attention(q, k, v, mask)
    assert out.dtype == A.dtype == torch.float64
    torch.testing.assert_close(A.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64), rtol=0, atol=1e-12)


def test_keep_mask_is_bernoulli_and_follows_the_seed():
    p = 0.1
    torch.manual_seed(3)
    m = keep_mask(torch.Size([1000, 1000]), p, torch.device("cpu"))
    assert m.dtype == torch.bool
    p_grid = round(p * (1 << KEEP_BITS)) / (1 << KEEP_BITS)
    # 10^6 draws: the kept fraction within 5 standard deviations (5 * 3e-4) of 1 - p'
    assert abs(float(m.float().mean()) - (1 - p_grid)) < 1.5e-3
    assert abs(float(m[:, :500].float().mean()) - float(m[:, 500:].float().mean())) < 3e-3  # no stripes
    torch.manual_seed(3)
    assert torch.equal(keep_mask(torch.Size([1000, 1000]), p, torch.device("cpu")), m)
    assert keep_mask(torch.Size([5, 3]), p, torch.device("cpu")).shape == (5, 3)  # numel not a multiple of 4


def test_dropout_scales_kept_values_and_passes_gradients_through_the_mask():
    d = Dropout(0.25).train()
    x = torch.randn(64, 33, requires_grad=True)
    y = d(x)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, kept.float() / 0.75)
    assert torch.equal(d.eval()(x), x)
