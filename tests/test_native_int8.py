"""native_int8.c: the int8 products of the torch-free search on a CPU with AVX2 (VNNI where there).

W quantized row by row to 8 bits, x row by row to 7 bits over its range, the sums exact: each
product is test_native_search.int8_product's (the same arithmetic in torch, exact integers in
float64) to the last bit of its fp32 output, and to a bf16 step where rounded; a shortlist's
packed rows are the packed subset."""

from __future__ import annotations

import os

import pytest
import torch

from s2s import native_search
from tests.test_native_search import int8_product, quantized_rows

LIB = native_search.library() if os.environ.get(native_search.DISABLE, "1") != "0" else None
pytestmark = pytest.mark.skipif(LIB is None or not native_search.has_products(LIB, "int8"),
                                reason="no AVX2 here, or the search's library is not built")
ACT_RELU = 1


@pytest.fixture(scope="module")
def lib():
    return LIB


def pack(lib, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q(W) int8, s_W, Q) of fp32 W (N, K)."""
    N, K = W.shape
    Wq, scale = torch.empty(N, K, dtype=torch.int8), torch.empty(N)
    lib.s2s_i8_quantize_rows(W.contiguous().data_ptr(), N, K, Wq.data_ptr(), scale.data_ptr())
    Q = torch.empty(lib.s2s_i8_packed_bytes(N, K), dtype=torch.uint8)
    lib.s2s_i8_pack(Wq.data_ptr(), scale.data_ptr(), None, N, K, Q.data_ptr())
    return Wq, scale, Q


def product(lib, x: torch.Tensor, Q: torch.Tensor, N: int, b=None, act: int = 0, fp32: bool = False):
    """s2s_i8_linear of bf16 x (M, K): y (M, N), bf16 or fp32."""
    M, K = x.shape
    y = torch.full((M, N), float("nan"), dtype=torch.float32 if fp32 else torch.bfloat16)
    rc = lib.s2s_i8_linear(x.data_ptr(), K, M, N, K, Q.data_ptr(), None if b is None else b.data_ptr(), act,
                           None if fp32 else y.data_ptr(), y.data_ptr() if fp32 else None, N)
    assert rc == 0
    return y


def test_the_quantization_of_a_worked_example(lib):
    """W's row [0.5, -1.27, 0, 1.27]: s_W = 1.27 / 127 = 0.01, q = [50, -127, 0, 127], c = 50; x's
    row [-1, 0, 3, 0, ...]: s_x = (3 - -1) / 127, z = round(31.75) = 32, u = [0, 32, 127, 32, ...];
    y = s_x s_W (sum_k u q - z c) = 4 / 127 * 0.01 * (0 - 4064 + 0 + 4064 - 32 * 50) = -0.50394,
    where x . W = -0.5.  Rows of zeros: s_W = 0, y = 0."""
    W = torch.zeros(3, 8)
    W[0, :4] = torch.tensor([0.5, -1.27, 0.0, 1.27])
    Wq, scale, Q = pack(lib, W)
    assert Wq[0, :4].tolist() == [50, -127, 0, 127] and Wq[1:].abs().sum() == 0
    assert scale[0].item() == pytest.approx(0.01) and scale[1:].tolist() == [0.0, 0.0]
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    x[0, 0], x[0, 2] = -1, 3
    y = product(lib, x, Q, 3, fp32=True)
    assert y[0, 0].item() == pytest.approx(4 / 127 * 0.01 * -1600, rel=1e-6)
    assert y[0, 0].item() == pytest.approx(-0.50394, abs=1e-5) and y[0, 1:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (3, 40, 64), (4, 256, 256), (6, 48, 128), (7, 100, 96),
                                   (10, 17, 64), (13, 33, 1024), (64, 768, 256), (320, 500, 192)])
def test_products_are_the_emulated_arithmetic(lib, M, N, K):
    """Every shape (partial blocks of 4 or 8 rows, as built, and 16 columns; chunks of W's
    columns), on VNNI's instructions or AVX2's, whichever the library was built with: the fp32
    output is int8_product's but for the last bit of its rounding (1e-6), the bf16 output (that
    rounded to nearest, ties to even) the same bits, ReLU's too; with and without a bias."""
    g = torch.Generator().manual_seed(M * N + K)
    W = torch.randn(N, K, generator=g) * 0.1
    x = (torch.randn(M, K, generator=g) * 2 + 0.3).bfloat16()
    x[0, :] = 0  # (a row of zeros: s_x = 0, y = b)
    b = (torch.randn(N, generator=g)).bfloat16()
    _, _, Q = pack(lib, W)
    q, s_w = quantized_rows(W)
    for bias in (None, b):
        want = int8_product(x.float(), q, s_w, None if bias is None else bias.float())
        got = product(lib, x, Q, N, bias, fp32=True)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(product(lib, x, Q, N, bias), want.bfloat16())
        assert torch.equal(product(lib, x, Q, N, bias, act=ACT_RELU), want.relu().bfloat16())
    assert (product(lib, x, Q, N, b, fp32=True)[0] == b.float()).all()


def test_quantized_products_are_close_to_the_exact_ones(lib):
    """The point of the arithmetic: within 2% of the fp32 product (7-bit x, 8-bit W; 1.5% on
    Gaussian rows)."""
    g = torch.Generator().manual_seed(3)
    W, x = torch.randn(512, 256, generator=g) * 0.05, torch.randn(64, 256, generator=g).bfloat16()
    got = product(lib, x, pack(lib, W)[2], 512, fp32=True)
    exact = x.float() @ W.t()
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


def test_a_shortlists_packed_rows_are_the_packed_subset(lib):
    """s2s_pack_rows_i8 of ids: the same Q (and b's entries) as packing those rows alone."""
    g = torch.Generator().manual_seed(5)
    V, K = 300, 64
    W = torch.randn(V, K, generator=g)
    b = torch.randn(V, generator=g).bfloat16()
    Wq, scale, _ = pack(lib, W)
    ids = torch.tensor([0, 3, 17, 18, 100, 101, 102, 250, 299], dtype=torch.int32)
    n = len(ids)
    Q = torch.empty(lib.s2s_i8_packed_bytes(n, K), dtype=torch.uint8)
    b_sub = torch.empty(n, dtype=torch.bfloat16)
    lib.s2s_pack_rows_i8(Wq.data_ptr(), scale.data_ptr(), K, ids.data_ptr(), n, b.data_ptr(), Q.data_ptr(),
                         b_sub.data_ptr())
    assert torch.equal(Q, pack(lib, W[ids.long()])[2])
    assert torch.equal(b_sub, b[ids.long()])


def test_what_is_not_a_number_stays_so(lib):
    """A row of x holding NaN or an infinity gives NaN outputs (as bf16 products do: the search
    then stops with its error), a row of W holding NaN a column of NaN; the other rows and
    columns are untouched.  A row of x within 2^-100 of zero counts as zeros: y = b."""
    g = torch.Generator().manual_seed(7)
    W, x = torch.randn(40, 64, generator=g), torch.randn(5, 64, generator=g).bfloat16()
    want = product(lib, x, pack(lib, W)[2], 40, fp32=True)
    x[1, 3], x[2, 0], x[3, :] = float("nan"), float("inf"), 1e-35
    W[7, 5] = float("nan")
    got = product(lib, x, pack(lib, W)[2], 40, fp32=True)
    assert got[1:3].isnan().all() and got[:, 7].isnan().all()
    assert (got[3, :7] == 0).all() and (got[3, 8:] == 0).all()  # (no bias: y = 0; column 7 NaN)
    keep = [0, 4]
    cols = [c for c in range(40) if c != 7]
    assert torch.equal(got[keep][:, cols], want[keep][:, cols])


def test_no_rows_is_nothing_to_do(lib):
    x, Q, y = torch.zeros(0, 32, dtype=torch.bfloat16), torch.zeros(lib.s2s_i8_packed_bytes(16, 32),
                                                                        dtype=torch.uint8), torch.zeros(1)
    assert lib.s2s_i8_linear(x.data_ptr(), 32, 0, 16, 32, Q.data_ptr(), None, 0, None, y.data_ptr(), 16) == 0


def test_a_depth_not_in_eights_is_refused(lib):
    x, Q = torch.zeros(1, 12, dtype=torch.bfloat16), torch.zeros(lib.s2s_i8_packed_bytes(16, 12), dtype=torch.uint8)
    y = torch.zeros(1, 16, dtype=torch.bfloat16)
    assert lib.s2s_i8_linear(x.data_ptr(), 12, 1, 16, 12, Q.data_ptr(), None, 0, y.data_ptr(), None, 16) == -2


@pytest.mark.skipif(bool(os.environ.get("S2S_MARCH")), reason="built for another CPU than this one ($S2S_MARCH)")
def test_vnni_is_taken_where_the_cpu_has_it(lib):
    """Built for this CPU, the kernel runs vpdpbusd (2) where it has AVX512-VNNI with VL, and AVX2's
    vpmaddubsw (1) where it has no VNNI at all; with AVX-VNNI alone either, as the compiler knows
    that extension (GCC 11 and later) or not."""
    flags = native_search.cbuild.cpu_flags()
    if {"avx512_vnni", "avx512vl"} <= flags:
        assert lib.s2s_i8_linear_available() == 2
    elif "avx_vnni" not in flags:
        assert lib.s2s_i8_linear_available() == 1
    else:
        assert lib.s2s_i8_linear_available() in (1, 2)
