"""bf16 products on AMX or AVX512-BF16 (s2s.model.native_linear.c, torch.ops.s2s.bf16_linear),
each kernel this CPU has: each output is the exact sum of products rounded once to bf16 (within
one bf16 step: the sums run in fp32), for the shapes a decoding step gives them (any rows and
columns, depths in tiles of 32, strided rows, a bias, each activation); W's packed layout; what
the operator refuses; and a bf16 model packed for it decodes as the one packed for oneDNN does,
scripted and in Python alike, where ``s2s translate`` picks it on one thread."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import s2s.model.native as native
from s2s.model.gemm import PackedLinear, pack_bf16, packed_linear, packs_bf16, use_packed_bf16

AMX = native.linear_isa() == "amx_bf16"
needs_linear = pytest.mark.skipif(not AMX, reason="no AMX here, or the kernels are not built")
KERNELS = {"amx_bf16": 1, "avx512_bf16": 2}  # native_linear.c's ISA_*


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
    """Each of native_linear.c's kernels in turn (s2s_bf16_linear_use), skipped where this CPU or
    library has not got it; the best one again after."""
    lib = native.library() if native.available() else None
    if lib is None or lib.s2s_bf16_linear_use(KERNELS[request.param]) != KERNELS[request.param]:
        if lib is not None:
            lib.s2s_bf16_linear_use(0)
        pytest.skip(f"no {request.param} kernel here")
    yield request.param
    lib.s2s_bf16_linear_use(0)


def exact(x, W, b, activation: str = "none"):
    """act(x W^T + b) in fp64 (bf16 products are exact there), then rounded once to bf16."""
    y = x.double() @ W.double().t() + (0 if b is None else b.double())
    return (torch.relu(y) if activation == "relu" else y).bfloat16()


def within_a_step(got, want):
    """got differs from want by at most one bf16 step (the fp32 sums may round either way)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.double().abs() * 2 ** -7 + 1e-3
    assert ((got.double() - want.double()).abs() <= step).all()


@pytest.mark.parametrize("M,K,N", [(1, 32, 16), (5, 192, 192), (17, 64, 20), (37, 256, 1030), (64, 192, 576),
                                   (70, 1024, 33), (33, 96, 4100), (6, 64, 64), (13, 128, 100), (20, 1024, 300)])
def test_each_output_is_the_exact_sum_rounded_to_bf16(M, K, N, kernel):
    """Rows in blocks of 32 (AMX) or 6 (vdpbf16ps) with a partial last, columns past
    a chunk (256 at a depth of 256; 64 at 1,024 with vdpbf16ps) and not a multiple of 16."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x, W, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((M, K), (N, K), (N,)))
    P = torch.ops.s2s.bf16_pack(W)
    for bias in (b, None):
        for activation in ("none", "relu"):
            within_a_step(torch.ops.s2s.bf16_linear(x, W, P, bias, activation), exact(x, W, bias, activation))


def test_rows_of_any_stride_and_shape_and_the_activations_after_the_product(kernel):
    """x (B, L, K), or every other row of one (a view); gelu and swish apply to the rounded product
    as torch's do; no rows: no output rows."""
    g = torch.Generator().manual_seed(7)
    W, b = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    P = torch.ops.s2s.bf16_pack(W)
    x = torch.randn(3, 10, 64, generator=g).bfloat16()
    y = torch.ops.s2s.bf16_linear(x, W, P, b)
    assert y.shape == (3, 10, 48)
    within_a_step(y, exact(x, W, b))
    strided = x.reshape(-1, 64)[::2]
    within_a_step(torch.ops.s2s.bf16_linear(strided, W, P, b), exact(strided, W, b))
    for activation, algorithm, act in (("gelu", "none", lambda y: F.gelu(y)),
                                       ("gelu", "tanh", lambda y: F.gelu(y, approximate="tanh")),
                                       ("swish", "", F.silu)):
        assert torch.equal(torch.ops.s2s.bf16_linear(x, W, P, b, activation, algorithm), act(y))
    assert torch.ops.s2s.bf16_linear(x[:, :0], W, P, b).shape == (3, 0, 48)


def test_the_packed_layout_is_pairs_of_w_in_tiles(kernel):
    """P[nb, kb, (p, n, j)] = W[16 nb + n, 32 kb + 2 p + j], zeros past W's rows and columns."""
    W = torch.arange(1, 20 * 40 + 1, dtype=torch.float32).reshape(20, 40).bfloat16()
    P = torch.ops.s2s.bf16_pack(W)
    assert P.shape == (2, 2, 512)
    tiles = P.view(2, 2, 16, 16, 2)
    for nb, kb, p, n, j in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 1, 3, 2, 1), (0, 1, 3, 15, 1), (1, 0, 15, 3, 0)]:
        row, col = 16 * nb + n, 32 * kb + 2 * p + j
        assert tiles[nb, kb, p, n, j] == (W[row, col] if row < 20 and col < 40 else 0)
    assert torch.equal(torch.ops.s2s.bf16_pack(W.t().contiguous().t()), P)  # any strides of W


def test_the_operator_refuses_what_it_cannot_multiply(kernel):
    W = torch.randn(32, 64).bfloat16()
    P = torch.ops.s2s.bf16_pack(W)
    x = torch.randn(4, 64).bfloat16()
    W48 = torch.randn(32, 48).bfloat16()  # a depth that is not whole tiles of 32
    for args in [(x.float(), W, P, None), (x[:, :32], W, P, None), (x, W[:16], P, None),
                 (x, W, P, torch.zeros(31).bfloat16()), (x, W, P, None, "tanh"),
                 (x[:, :48], W48, torch.ops.s2s.bf16_pack(W48), None), (x, W, P, None, "gelu", "erf"),
                 (x[:, :0], W[:, :0], torch.ops.s2s.bf16_pack(W[:, :0]), None)]:
        with pytest.raises(ValueError, match="bf16_linear"):
            torch.ops.s2s.bf16_linear(*args)
    with pytest.raises(ValueError, match="bf16_pack"):
        torch.ops.s2s.bf16_pack(W.float())


@needs_linear
@torch.no_grad()
def test_a_model_packed_for_the_kernel_decodes_as_the_one_packed_for_onednn():
    """use_packed_bf16 with ``native``: every linear layer, the tied W_U and a batch's vocabulary
    subset packed for s2s's kernel; each step's log-probs equal the oneDNN-packed (or unpacked)
    model's up to bf16 rounding; the FFN's activation inside the product."""
    from s2s.search import ModelDecoder
    from tests.test_model import make_model, right_pad, tokens

    reference = make_model(activation="relu").to(torch.bfloat16)
    if packs_bf16():
        use_packed_bf16(reference)
    model = make_model(activation="relu").to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    assert use_packed_bf16(model, native=True) > 0
    assert model.gemm == "native" and model.output_packed.dim() == 3
    assert model.state_dict().keys() == reference.state_dict().keys()  # the packed copies are not state
    assert all(m.packed.dim() == 3 for m in model.modules() if isinstance(m, PackedLinear))
    src = right_pad([tokens(5, seed=80), tokens(9, seed=81)])
    tgt = tokens(2, 6, seed=82)
    for subset in (None, torch.tensor([0, 1, 2, 3, 5, 8, 13, 21])):
        ref, got = ModelDecoder(reference, src, vocab_subset=subset), ModelDecoder(model, src, vocab_subset=subset)
        if subset is not None:
            assert got.cache.vocab_subset.packed.dim() == 3
        for t in range(tgt.size(1)):
            y = tgt[:, t:t + 1] if subset is None else torch.zeros_like(tgt[:, t:t + 1]) + t % 8
            torch.testing.assert_close(got.step(y), ref.step(y), atol=0.05, rtol=0)


@needs_linear
def test_scripted_and_python_steps_through_the_kernel_search_alike():
    """A bf16 model whose products and attention go through s2s's kernels: greedy, beams, n-best,
    sampling, a prefix and constraints search the same hypotheses scripted and in Python, bit for
    bit."""
    from s2s.model.native import use_native_attention
    from tests.test_model import make_model
    from tests.test_step_script import assert_same_searches

    model = make_model(activation="relu", d_model=128, heads=2, d_ff=128).to(torch.bfloat16)
    model.lay_out_for_steps()
    use_packed_bf16(model, native=True)
    assert use_native_attention(model, True)
    assert_same_searches(model)


@needs_linear
def test_translate_packs_for_the_kernel_on_one_thread(prepared, tmp_path, monkeypatch):
    """bf16 on one thread: every matrix packed for s2s's kernel; on two threads, or with
    $S2S_NATIVE_ATTENTION=0: for oneDNN (which splits a product over the threads)."""
    from s2s.translate import Translator
    from tests.conftest import untrained_model_dir

    model_dir = untrained_model_dir(prepared, tmp_path / "model")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert Translator.from_dirs([model_dir], precision="bf16").model.gemm == "native"
        monkeypatch.setenv(native.DISABLE, "0")
        assert Translator.from_dirs([model_dir], precision="bf16").model.gemm == "packed"
        monkeypatch.delenv(native.DISABLE)
        torch.set_num_threads(2)
        assert Translator.from_dirs([model_dir], precision="bf16").model.gemm == "packed"
    finally:
        torch.set_num_threads(threads)


def test_packed_linear_routes_by_the_packed_form():
    """gemm.pack_bf16 with ``native``: s2s's tiles (3 dimensions) where W's depth is whole tiles,
    oneDNN's layout where it is not, nothing for fp32; gemm.packed_linear multiplies through
    whichever it is given, and fp32 or autograd through F.linear."""
    W = torch.randn(8, 32)
    assert pack_bf16(W, native=True) is None
    x = torch.randn(3, 32, requires_grad=True)
    assert torch.equal(packed_linear(x, W, None), F.linear(x, W))
    if AMX:
        Wb, xb = W.bfloat16(), x.detach().bfloat16()
        assert pack_bf16(Wb, native=True).dim() == 3
        with torch.no_grad():
            within_a_step(packed_linear(xb, Wb, pack_bf16(Wb, native=True)), exact(xb, Wb, None))
    if packs_bf16():
        assert pack_bf16(torch.randn(8, 48).bfloat16(), native=True).dim() == 2  # oneDNN's



def test_without_the_amx_kernel_the_packing_is_onednns(monkeypatch):
    """Where the kernel cannot run (no AMX, no library), use_packed_bf16 with ``native`` packs for
    oneDNN (model.gemm "packed"), and pack_bf16 never makes s2s's tiles."""
    import s2s.model.gemm as gemm
    from tests.test_model import make_model

    monkeypatch.setattr(gemm, "linear_isa", lambda: None)
    W = torch.randn(8, 32).bfloat16()
    packed = pack_bf16(W, native=True)
    assert packed is None if not packs_bf16() else packed.dim() == 2
    model = make_model().to(torch.bfloat16)
    use_packed_bf16(model, native=True)
    assert model.gemm == ("packed" if packs_bf16() else "torch")
