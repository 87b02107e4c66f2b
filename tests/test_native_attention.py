"""Few-query attention in C (s2s.model.native): the function torch's two products compute
(few_query_attention; in fp64 as the exact values), within fp32 rounding, over the shapes and
layouts a decoding step gives it, and each beam's own columns of its sentence's slots; the
scripted step and the Python step through it search the same hypotheses, bit for bit;
``s2s translate``'s arithmetic takes it on one thread; and without a compiler decoding goes on
through torch."""

from __future__ import annotations

import contextlib
import subprocess

import pytest
import torch

import s2s.model.native as native
from s2s.config import DecodeConfig
from s2s.model.attention import NEG_INF, few_query_attention, inference_attention
from s2s.model.cache import CACHE_BUCKET
from s2s.model.native import use_native_attention
from s2s.search import ModelDecoder, SpecialIds, search
from tests.test_model import make_model, right_pad, tokens
from tests.test_step_script import assert_same_searches

needs_kernel = pytest.mark.skipif(not native.available(), reason="the kernel is not built (no C compiler?) or "
                                  f"${native.DISABLE}=0")


def kernel(q, k, v, mask, scale=True):
    return torch.ops.s2s.few_query_attention(q, k, v, mask, scale)


def padded_mask(B: int, S: int, lengths: list[int]) -> torch.Tensor:
    """(B, 1, 1, S): 0 on each row's first lengths[b] keys, -inf after (a source's padding)."""
    mask = torch.zeros(B, 1, 1, S)
    for b, n in enumerate(lengths):
        mask[b, ..., n:] = NEG_INF
    return mask


@needs_kernel
@pytest.mark.parametrize("D", [64, 32, 48, 128, 16, 8, 24])  # 16-float vectors (16 n) and the loop for any d_head
@pytest.mark.parametrize("G", [1, 5, 16])
@pytest.mark.parametrize("S", [1, 15, 16, 17, 45])  # blocks of 16 keys and their remainders
def test_kernel_computes_what_torchs_products_compute(D, G, S):
    g = torch.Generator().manual_seed(D * 1000 + G * 100 + S)
    B, H = 3, 2
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (G, S, S))
    mask = padded_mask(B, S, [S, max(1, S - 3), 1])
    for m in (mask, None):
        for scale in (True, False):
            exact = few_query_attention(q.double(), k.double(), v.double(), None if m is None else m.double(), scale)
            torch.testing.assert_close(kernel(q, k, v, m, scale).double(), exact, atol=1e-5, rtol=1e-4)


@needs_kernel
def test_kernel_reads_the_layouts_a_step_gives_it():
    """q a view of the fused Q/K/V projection (B, 3, heads, 1, d_head); K/V the first t columns
    of a preallocated buffer (strided along the keys' dimension); a mask per query (a beam's
    ancestry, (B, 1, G, S)); scores large enough that most weights are e^-100 and below."""
    g = torch.Generator().manual_seed(7)
    B, H, D, S, capacity, G = 4, 4, 64, 37, 64, 5
    qkv = torch.randn(B, 3, H, 1, D, generator=g)
    q = qkv.unbind(1)[0]  # (B, heads, 1, d_head), strides of the fused product
    k_buf, v_buf = torch.randn(B, H, capacity, D, generator=g), torch.randn(B, H, capacity, D, generator=g)
    k, v = k_buf.narrow(2, 0, S), v_buf.narrow(2, 0, S)
    assert not k.is_contiguous()
    torch.testing.assert_close(kernel(q, k, v, padded_mask(B, S, [S, 20, 5, 1])),
                               few_query_attention(q, k, v, padded_mask(B, S, [S, 20, 5, 1])), atol=2e-6, rtol=2e-5)
    beams = torch.randn(B, H, G, D, generator=g) * 30  # peaked: weights from 1 down to 0
    ancestry = torch.zeros(B, 1, G, S)
    ancestry[:, :, 1:, 1::3] = NEG_INF  # each query its own keys
    ancestry[:, :, 3, 1:] = NEG_INF  # one key only
    got = kernel(beams, k, v, ancestry)
    # (scores 30x larger: the order of their fp32 sums, in 16 or 8 lanes, moves a weight by 2e-5)
    torch.testing.assert_close(got, few_query_attention(beams, k, v, ancestry), atol=4e-5, rtol=2e-5)
    torch.testing.assert_close(got[:, :, 3], v[:, :, 0])  # one key: its value, whatever the score


@needs_kernel
@pytest.mark.parametrize("D", [64, 48, 24])
def test_kernel_widens_bf16_keys_and_values(D):
    """K/V in bf16 (a beam search's self-attention slots): the kernel computes in fp32 what the
    K/V say, widened exactly; torch's products round q and the scores to bf16 as well."""
    g = torch.Generator().manual_seed(D)
    B, H, G, S = 3, 2, 5, 21
    q = torch.randn(B, H, G, D, generator=g)
    k, v = (torch.randn(B, H, S, D, generator=g).bfloat16() for _ in range(2))
    mask = padded_mask(B, S, [S, 9, 1])
    exact = few_query_attention(q.double(), k.double(), v.double(), mask.double())
    got = kernel(q, k, v, mask)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, few_query_attention(q, k, v, mask), atol=0.05, rtol=0.05)  # torch's bf16 route


@needs_kernel
@pytest.mark.parametrize("D", [64, 48, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_each_beams_own_columns(D, dtype):
    """With columns (a beam's ancestors' slots): row b reads keys columns[b, :] of K/V row
    b // K alone, what the ancestry's mask over every column leaves; a column outside the
    buffer is refused before anything is read."""
    g = torch.Generator().manual_seed(D)
    for N, K, t1 in ((3, 4, 7), (2, 5, 37), (4, 1, 17)):  # t + 1 positions: a block of 16 keys and its tail
        H, capacity = 2, (t1 + 3) * K  # buffers wider than (t + 1) K
        q = torch.randn(N * K, H, 1, D, generator=g)
        k, v = (torch.randn(N, H, capacity, D, generator=g).to(dtype) for _ in range(2))
        ancestry = torch.randint(0, K, (N * K, t1), generator=g)
        columns = ancestry + K * torch.arange(t1)
        mask = torch.full((N * K, capacity), NEG_INF).scatter_(1, columns, 0.0)  # the ancestry's mask
        sentence = torch.arange(N * K) // K
        exact = few_query_attention(q.double(), k.double()[sentence], v.double()[sentence],
                                    mask.double()[:, None, None])
        for cols in (columns, columns.t().contiguous().t()):  # its rows contiguous, or not
            got = torch.ops.s2s.few_query_attention(q, k, v, None, True, cols)
            torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-4)
    for wrong in (columns + capacity, columns - columns.max() - 1):
        with pytest.raises(ValueError, match="column outside"):
            torch.ops.s2s.few_query_attention(q, k, v, None, True, wrong)
    with pytest.raises(ValueError, match="columns"):
        torch.ops.s2s.few_query_attention(q, k, v, mask[:, None, None], True, columns)  # columns take no mask


@needs_kernel
def test_beams_through_their_columns_search_what_the_masked_slots_search():
    """A beam search whose self-attention reads each beam's own columns through the kernel
    (s2s.model.attention.slot_attention) finds the hypotheses torch's masked products find,
    fp32 and bf16 models alike; the kernel is given the columns, and not called at all with the
    kernel off."""
    src = right_pad([tokens(5, seed=40), tokens(3, seed=41), tokens(7, seed=42), tokens(4, seed=43)])
    ids = SpecialIds(bos_id=2, eos_id=3, pad_id=0)
    for dtype in (torch.float32, torch.bfloat16):
        found = []
        for on in (True, False):
            model = make_model(activation="relu", d_model=128, heads=2, d_ff=128).to(dtype)
            model.lay_out_for_steps()
            use_native_attention(model, on)
            assert model.script_step()
            with torch.inference_mode(), kernel_calls() as calls:
                found.append(search(ModelDecoder(model, src), torch.full((4,), 4 + CACHE_BUCKET),
                                    DecodeConfig(beam=4, nbest=2, alpha=0.6), ids))
            assert any(shapes[5] != [] for shapes, _ in calls) if on else not calls
        tol = 1e-4 if dtype == torch.float32 else 0.05
        for got, want in zip(*found):
            assert [h.tokens for h in got] == [h.tokens for h in want]
            assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=tol)


@contextlib.contextmanager
def kernel_calls(name: str = "s2s::few_query_attention", inputs: int = 6):
    """The calls of operator ``name`` made inside the block (from Python or a scripted step), as
    (input shapes, input dtypes) of its ``inputs`` arguments each (an absent one: [] and ''),
    recorded by torch's profiler.  (A scripted call's record starts with values of the
    interpreter's stack: the operator's own are the last.)  Read from the profiler's own events:
    torch 2.11's FunctionEvents carry no dtypes."""
    calls: list[tuple[list, list]] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        yield calls
    events = prof.profiler.kineto_results.events()
    calls.extend((e.shapes()[-inputs:], e.dtypes()[-inputs:]) for e in events if e.name() == name)


@needs_kernel
def test_scripted_and_python_steps_through_the_kernel_search_alike():
    """fp32, d_head 64 (the vector path), laid out as ``s2s translate`` lays it out, the beams'
    self-attention K/V in fp32 or in bf16 slots: greedy, beams, n-best, sampling, a prefix and
    constraints search the same hypotheses scripted and in Python, bit for bit, both through
    the kernel (with bf16 slots, their self-attention through its bf16 path)."""
    model = make_model(activation="relu", d_model=128, heads=2, d_ff=128).float()
    model.lay_out_for_steps()
    assert use_native_attention(model, True)
    for slot_dtype, kv_dtypes in ((None, {"float"}), (torch.bfloat16, {"float", "c10::BFloat16"})):
        model.beam_slot_dtype = slot_dtype
        with kernel_calls() as calls:
            assert_same_searches(model)
        assert {dtypes[1] for _, dtypes in calls} == kv_dtypes  # K's


@needs_kernel
def test_translate_takes_the_kernel_on_one_thread_only(prepared, tmp_path, monkeypatch):
    """On one thread, any precision: the attention modules take the kernel; on two threads or
    with $S2S_NATIVE_ATTENTION=0: torch's route."""
    from s2s.translate import Translator
    from tests.conftest import untrained_model_dir

    model_dir = untrained_model_dir(prepared, tmp_path / "model")

    def routes(precision: str) -> set[bool]:
        tr = Translator.from_dirs([model_dir], precision=precision)
        return {m.native for m in tr.model.modules() if hasattr(m, "native")}

    torch.set_num_threads(1)
    assert routes(precision="fp32") == {True}
    assert routes(precision="auto") == {True}
    assert routes(precision="bf16") == {True}
    monkeypatch.setenv(native.DISABLE, "0")
    assert routes(precision="fp32") == {False}
    monkeypatch.delenv(native.DISABLE)
    torch.set_num_threads(2)
    assert routes(precision="fp32") == {False}


def test_without_a_compiler_decoding_takes_torchs_route(tmp_path, monkeypatch):
    """No compiler: no kernel, no library file, and a translator built then decodes through torch's
    products (the same outputs as with the kernel switched off)."""
    monkeypatch.setenv("S2S_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv(native.DISABLE, raising=False)
    native.library.cache_clear()
    try:
        assert not native.available()
        assert not list(tmp_path.rglob("*.so*"))  # no partial library left behind
        model = make_model(activation="relu", d_model=128, heads=2, d_ff=128).float()
        assert not use_native_attention(model)
        assert {m.native for m in model.modules() if hasattr(m, "native")} == {False}
    finally:
        native.library.cache_clear()


def test_without_a_cplusplus_compiler_nothing_is_compiled(tmp_path, monkeypatch):
    """A C compiler but no C++ one (gcc without g++): no kernel, found before the C files are
    compiled (every process would pay that), and no marker (installing g++ is enough)."""
    monkeypatch.setenv("S2S_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))

    def no_compiler(*a, **kw):
        raise AssertionError("compiled")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    with pytest.raises(OSError, match="no such compiler"):
        native.compile_library()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_failing_compile_leaves_a_marker_not_a_library(tmp_path, monkeypatch):
    """A compiler that fails (here: `false`) is an unavailable kernel: no library in the cache, and
    a marker with its message, so that the next process does not run it again."""
    monkeypatch.setenv("S2S_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match="false failed"):
        native.compile_library()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.suffix for p in files] == [".failed"]

    def no_compiler(*a, **kw):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    with pytest.raises(OSError, match="failed before"):
        native.compile_library()


@needs_kernel
def test_the_route_leaves_to_torch_what_the_kernel_does_not_take():
    """inference_attention with ``native``: a mask of one column broadcast over the keys, a bf16
    mask with fp32 queries, more than 16 queries, a q whose last dimension is strided: torch's
    route, the same values bit for bit; and the operator itself refuses what it cannot read (a
    strided q, K fp32 with V bf16) and widens a bf16 mask."""
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 2, 20, 64
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (1, S, S))
    bf16_mask = (q, k, v, padded_mask(B, S, [S, 3]).bfloat16())
    strided_q = (torch.randn(B, H, 1, 2 * D, generator=g)[..., ::2], k, v, None)
    for q_, k_, v_, m in [(q, k, v, torch.zeros(B, 1, 1, 1)), bf16_mask,
                          (torch.randn(B, H, 17, D, generator=g), k, v, None), strided_q]:
        got = inference_attention(q_, k_, v_, m, True, native=True)
        assert torch.equal(got, inference_attention(q_, k_, v_, m, True, native=False))
    for q_, k_, v_, m in [strided_q, (q, k, v.bfloat16(), None)]:
        with pytest.raises(ValueError, match="few_query_attention"):
            kernel(q_, k_, v_, m)
    torch.testing.assert_close(kernel(q, k, v, torch.zeros(B, 1, 1, 1)), few_query_attention(q, k, v, None))
    assert torch.equal(kernel(*bf16_mask), kernel(q, k, v, bf16_mask[3].float()))


@needs_kernel
def test_a_row_with_every_key_masked_is_nan_as_in_torch():
    B, H, S, D = 2, 2, 19, 64
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    mask = padded_mask(B, S, [S, 0])
    got, want = kernel(q, k, v, mask), few_query_attention(q, k, v, mask)
    assert got[1].isnan().all() and want[1].isnan().all()
    torch.testing.assert_close(got[0], want[0])


@needs_kernel
def test_the_library_is_compiled_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("S2S_CACHE_DIR", str(tmp_path))
    built = native.compile_library()
    assert built.parent == tmp_path / "native" and built.exists()

    def no_compiler(*a, **kw):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.compile_library() == built


@needs_kernel
@pytest.mark.parametrize("V", [8000, 37, 16, 1])
def test_argmax_rows_finds_the_first_maximum_of_bf16_rows(V):
    """The kernel's argmax over bf16 rows: numpy's first maximum of the widened scores, ties
    across its blocks of 512 and inside one included; a row of -inf gives index 0; rows that are
    a view of wider ones are read in place."""
    g = torch.Generator().manual_seed(V)
    wide = (torch.randn(6, V + 5, generator=g) * 4).bfloat16()
    z = wide[:, :V]  # rows V + 5 apart
    if V > 600:
        z[1, 20] = z[1, 600] = z[1].max() + 1  # a tie across blocks: the first
        z[2, 7] = z[2, 9] = z[2].max() + 1  # inside one
    z[3] = float("-inf")
    best, index = native.argmax_rows(z)
    want = torch.from_numpy(z.float().numpy().argmax(axis=1))
    assert torch.equal(index, want) and index.dtype == torch.int64
    assert torch.equal(best, z.float().gather(1, want[:, None]).squeeze(1))
    if V > 600:
        assert index[1] == 20 and index[2] == 7
    assert index[3] == 0


@needs_kernel
def test_argmax_rows_leaves_to_the_caller_what_it_does_not_take(monkeypatch):
    """A row holding NaN, fp32 scores, a strided last dimension, the kernels switched off: None
    (best_tokens then widens and asks numpy, which gives the same maximum and index)."""
    from s2s.search import best_tokens

    z = torch.randn(3, 50).bfloat16()
    with_nan = z.clone()
    with_nan[1, 4] = float("nan")
    assert native.argmax_rows(with_nan) is None
    assert native.argmax_rows(z.float()) is None
    assert native.argmax_rows(torch.randn(3, 100).bfloat16()[:, ::2]) is None
    monkeypatch.setenv(native.DISABLE, "0")
    assert native.argmax_rows(z) is None
    fallback = best_tokens(z.clone())
    monkeypatch.delenv(native.DISABLE)
    kernel_route = best_tokens(z.clone())
    assert torch.equal(fallback[1], kernel_route[1]) and torch.equal(fallback[0], kernel_route[0])
    assert best_tokens(with_nan)[1][1] == 4  # numpy's: the first NaN


@needs_kernel
def test_greedy_search_on_bf16_scores_picks_what_the_fp32_scores_pick(monkeypatch):
    """A bf16 model's greedy search with no score to show: the step's bf16 scores are searched
    as they are (the kernel's argmax), and choose the tokens of the normalized fp32 log p, and
    of the same scores widened (the kernel switched off)."""
    from s2s.config import DecodeConfig
    from s2s.search import ModelDecoder, SpecialIds, search
    from tests.test_model import right_pad, tokens

    calls = []
    real = native.argmax_rows
    monkeypatch.setattr(native, "argmax_rows", lambda z: calls.append(z.dtype) or real(z))
    model = make_model(activation="relu", d_model=128, heads=2, d_ff=128).to(torch.bfloat16)
    src = right_pad([tokens(5, seed=90), tokens(3, seed=91), tokens(7, seed=92)])
    ids, max_len, greedy = SpecialIds(bos_id=1, eos_id=2, pad_id=0), torch.full((3,), 12), DecodeConfig(beam=1)

    def found(normalized: bool) -> list[list[int]]:
        return [s[0].tokens for s in search(ModelDecoder(model, src, normalized=normalized), max_len, greedy, ids)]

    raw = found(False)
    assert calls and set(calls) == {torch.bfloat16}
    assert raw == found(True)
    monkeypatch.setenv(native.DISABLE, "0")
    assert raw == found(False)
