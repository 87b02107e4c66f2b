"""Training's matrix products through OpenBLAS (s2s.model.gemm) against torch's; bf16 decoding's
products through weights packed for oneDNN against F.linear."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from s2s.config import ModelConfig, load_config
from s2s.errors import S2SError
from s2s.model import make_model
from s2s.model.gemm import (
    BlasLinear,
    PackedLinear,
    auto_gemm,
    linear,
    pack_bf16,
    packed_linear,
    packs_bf16,
    resolve_gemm,
    use_openblas,
    use_packed_bf16,
)
from s2s.trainer import make_trainer
from tests.test_precision import NO_DROPOUT

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _blas_threads_restored():
    """use_openblas sets OpenBLAS's threads for the whole process: back as they were after each test."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=None, user_api="blas"):
        yield


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("column_major", [False, True])
def test_linear_through_blas_equals_torch_forward_and_backward(bias, column_major):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    W = torch.randn(24, 16, generator=g)
    if column_major:  # as lay_out_for_steps stores a decoder's matrices
        W = W.t().contiguous().t()
    W.requires_grad_(True)
    b = torch.randn(24, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(3, 5, 24, generator=g)
    grads = {}
    for name, f in (("torch", F.linear), ("openblas", linear)):
        y = f(x, W, b)
        y.backward(dy)
        grads[name] = (y.detach(), x.grad.clone(), W.grad.clone(), None if b is None else b.grad.clone())
        for t in (x, W, b):
            if t is not None:
                t.grad = None
    assert linear(x, W, b).grad_fn.name().startswith("LinearThroughBlas")
    for want, got in zip(grads["torch"], grads["openblas"]):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_output_may_change_in_place():
    """As nn.Linear's: an activation written over its input (ReLU in place) must not fail."""
    x, W = torch.randn(2, 3, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    y = linear(x, W)
    torch.relu_(y)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (F.linear(x, W) > 0).float() @ W, rtol=1e-5, atol=1e-5)


def test_linear_keeps_torch_where_nothing_is_recorded():
    """Evaluation and decoding (no autograd) and bf16 stay on F.linear, bit for bit."""
    x, W = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(linear(x, W), F.linear(x, W))
    assert linear(x.bfloat16(), W.bfloat16()).grad_fn.name().startswith("Mm")


@pytest.mark.parametrize("device, threads, vendor, mkl, want", [
    ("cpu", 1, "AuthenticAMD", True, "openblas"),
    ("cpu", 2, "AuthenticAMD", True, "torch"),  # OpenBLAS's and OpenMP's threads on the same cores
    ("cpu", 1, "GenuineIntel", True, "torch"),
    ("cpu", 1, "", True, "torch"),
    ("cpu", 1, "AuthenticAMD", False, "torch"),
    ("cuda", 1, "AuthenticAMD", True, "torch"),
])
def test_auto_gemm(device, threads, vendor, mkl, want):
    assert auto_gemm(torch.device(device), threads, vendor, mkl)[0] == want


def test_resolve_gemm_refuses_what_it_cannot_do():
    with pytest.raises(S2SError, match="train.gemm: 'mkl' is not auto, torch or openblas"):
        resolve_gemm("mkl", CPU)
    with pytest.raises(S2SError, match="openblas multiplies on the CPU, not on cuda"):
        resolve_gemm("openblas", torch.device("cuda"))
    assert resolve_gemm("torch", CPU) == "torch"


def test_use_openblas_trains_the_same_model():
    """The swapped model has the same parameters and keys, evaluates bit for bit as before,
    and its loss and gradients match torch's to fp32 rounding (the tied output projection too)."""
    cfg = ModelConfig(d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=24, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = make_model(cfg, 40, 40, 0)
    blas = copy.deepcopy(model)
    assert use_openblas(blas) == sum(type(m) is torch.nn.Linear for m in model.modules()) > 0
    assert all(type(m) is not torch.nn.Linear for m in blas.modules())
    assert isinstance(blas.encoder_layers[0].ffn.w_1, BlasLinear) and blas.gemm == "openblas"
    assert list(blas.state_dict()) == list(model.state_dict())
    src = torch.randint(4, 40, (3, 6))
    tgt_in, tgt_out = torch.randint(4, 40, (3, 5)), torch.randint(4, 40, (3, 5))
    with torch.no_grad():
        assert torch.equal(blas(src, tgt_in), model(src, tgt_in))
    for m in (model, blas):
        F.cross_entropy(m(src, tgt_in).reshape(-1, 40), tgt_out.reshape(-1)).backward()
    for (name, p), q in zip(model.named_parameters(), blas.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_train_gemm_openblas_learns_like_torch(prepared, tmp_path):
    """30 updates of one thread on the same batches: the losses through OpenBLAS stay with torch's."""
    losses = {}
    threads = torch.get_num_threads()
    try:
        for gemm in ("torch", "openblas"):
            cfg = load_config(prepared, [*NO_DROPOUT, f"train.gemm={gemm}", "train.threads=1",
                                         "train.warmup_steps=10", "train.max_tokens=300"])
            t = make_trainer(cfg, tmp_path / gemm, show_progress=False)
            assert t.model.gemm == gemm
            batches = [t.train_data.batch(idx) for idx in t.epoch_batches(0)[:10]]
            per_token = []
            for step in range(30):
                loss, ok, (n_tgt, *_) = t.train_step([batches[step % len(batches)]])
                assert ok
                t.state.step += 1
                per_token.append(float(loss) / n_tgt)
            losses[gemm] = per_token
    finally:
        torch.set_num_threads(threads)
    assert losses["torch"][-1] < losses["torch"][0] - 0.5
    assert max(abs(a - b) for a, b in zip(losses["torch"], losses["openblas"])) < 1e-3, losses


def test_train_gemm_openblas_says_where_it_cannot_apply(prepared, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="s2s"):
        t = make_trainer(load_config(prepared, ["train.gemm=openblas", "train.precision=bf16"]), tmp_path / "run",
                         show_progress=False)
    assert t.model.gemm == "torch"
    assert "train.gemm openblas: bf16 precision multiplies with torch's BLAS" in caplog.text


def test_bad_train_gemm_names_the_key(prepared):
    from s2s.errors import ConfigError

    with pytest.raises(ConfigError, match="train.gemm"):
        load_config(prepared, ["train.gemm=mkl"])


# --------------------------------------------------------------------------- #
# bf16 decoding on the CPU: weights packed for oneDNN once
# --------------------------------------------------------------------------- #
needs_packing = pytest.mark.skipif(not packs_bf16(), reason="no native bf16 matmul on this CPU (or no oneDNN)")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 16), (3, 7, 16), (64, 16)])
def test_packed_linear_equals_f_linear_in_bf16(bias, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).bfloat16()
    W = torch.randn(40, 16, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16() if bias else None
    packed = pack_bf16(W)
    with torch.no_grad():
        got = packed_linear(x, W, packed, b)
        torch.testing.assert_close(got, F.linear(x, W, b), atol=2e-2, rtol=2e-2)
        assert got.shape == (*shape[:-1], 40) and got.dtype == torch.bfloat16
        strided = x.reshape(-1, 16)[::2]  # every other row: a view, not contiguous
        torch.testing.assert_close(packed_linear(strided, W, packed, b), F.linear(strided, W, b), atol=2e-2, rtol=2e-2)


def test_packed_linear_falls_back_where_oneDNN_does_not_apply():
    """fp32 W is never packed; an fp32 input, or a product autograd records, takes F.linear."""
    W = torch.randn(8, 4)
    assert pack_bf16(W) is None
    x = torch.randn(3, 4, requires_grad=True)
    y = packed_linear(x, W, None)
    assert torch.equal(y, F.linear(x, W)) and y.requires_grad


@needs_packing
@torch.no_grad()
def test_bf16_model_decodes_the_same_with_packed_weights():
    """use_packed_bf16 swaps every linear layer and the tied W_U: each step's log-probs equal the
    unpacked bf16 model's up to bf16 rounding, with the full vocabulary and with a subset."""
    from s2s.search import ModelDecoder
    from tests.test_model import make_model as decode_model
    from tests.test_model import right_pad, tokens

    plain = decode_model().to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    layers = use_packed_bf16(packed)
    assert layers == sum(isinstance(m, torch.nn.Linear) for m in plain.modules()) > 0
    assert packed.gemm == "packed" and packed.output_packed is not None
    assert all(m.packed is not None for m in packed.modules() if isinstance(m, PackedLinear))
    assert packed.state_dict().keys() == plain.state_dict().keys()
    src = right_pad([tokens(5, seed=80), tokens(9, seed=81)])
    tgt = tokens(2, 6, seed=82)
    for subset in (None, torch.tensor([0, 1, 2, 3, 5, 8, 13, 21])):
        ref, got = ModelDecoder(plain, src, vocab_subset=subset), ModelDecoder(packed, src, vocab_subset=subset)
        if subset is not None:
            assert got.cache.vocab_subset.packed is not None
        for t in range(tgt.size(1)):
            y = tgt[:, t:t + 1] if subset is None else torch.zeros_like(tgt[:, t:t + 1]) + t % 8
            torch.testing.assert_close(got.step(y), ref.step(y), atol=0.05, rtol=0)


@needs_packing
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("native", [False, True])
@torch.no_grad()
def test_feed_forward_with_the_activation_inside_the_packed_product(activation, gated, native):
    """A packed W_1 applies the activation in oneDNN's product (a post-op), or in s2s's AMX kernel
    (``native``; ReLU before rounding, the others after): the FFN's output equals the unpacked
    bf16 FFN's up to bf16 rounding."""
    from s2s.model.layers import FeedForward
    from s2s.model.native import linear_isa

    if native and linear_isa() != "amx_bf16":  # (torch's route packs for s2s's kernel on AMX only)
        pytest.skip("no AMX here, or the kernels are not built")
    torch.manual_seed(3)
    plain = FeedForward(32, 64, activation, dropout=0.0, gated=gated).eval().to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    use_packed_bf16(packed, native=native)
    assert packed.w_1.packed.dim() == (3 if native else 2)
    assert packed.post_op == activation
    x = torch.randn(2, 5, 32).bfloat16()
    torch.testing.assert_close(packed(x), plain(x), atol=0.05, rtol=0.02)


@torch.no_grad()
def test_int8_layers_are_not_taken_for_packed_bf16_ones():
    """An int8 W_1 (s2s.model.int8, with its own fbgemm ``packed``) keeps its kernel: the
    FFN's fused activation is for PackedLinear only."""
    from s2s.model.int8 import quantize_int8
    from s2s.search import ModelDecoder
    from tests.test_model import make_model as decode_model
    from tests.test_model import right_pad, tokens

    model = decode_model().float().eval()
    src = right_pad([tokens(5, seed=90), tokens(7, seed=91)])
    y = tokens(2, 1, seed=92)
    ref = ModelDecoder(model, src).step(y)
    quantize_int8(model)
    torch.testing.assert_close(ModelDecoder(model, src).step(y), ref, atol=0.1, rtol=0)
