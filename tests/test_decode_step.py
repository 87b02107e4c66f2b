"""The fixed-shape decoder step and the decoding precision (issue 15, levers 3 and 4):
the preallocated self-attention cache against torch.cat, bf16 weights against fp32,
and what --precision auto picks."""

from __future__ import annotations

import math

import pytest
import torch

import s2s.model.cache as cache_module
from s2s.model.attention import FEW_QUERIES, attention, few_query_attention
from s2s.model.cache import CACHE_BUCKET, LayerCache, bucketed, tail_moves
from s2s.search import ModelDecoder, tail_filled
from s2s.translate import auto_precision
from tests.test_model import make_model, right_pad, tokens


@pytest.mark.parametrize("scale", [True, False])
def test_few_query_attention_equals_the_reference(scale):
    """One query, and a sentence's 5 beams as queries, against K/V read as strided views of a
    preallocated cache; without a mask, with a padding mask, and with a per-head bias too."""
    g = torch.Generator().manual_seed(7)
    B, H, T_k, e = 3, 4, 11, 8
    k_buf, v_buf = (torch.randn(B + 1, H, CACHE_BUCKET, e, generator=g) for _ in range(2))
    k, v = k_buf[:B, :, :T_k], v_buf[:B, :, :T_k]
    pad = torch.zeros(B, 1, 1, T_k)
    pad[1, ..., 8:] = float("-inf")
    for T_q in (1, 5, FEW_QUERIES):
        q = torch.randn(B, H, T_q, e, generator=g)
        bias = torch.randn(1, H, T_q, T_k, generator=g)
        for mask in (None, pad, pad + bias):
            want = attention(q, k, v, mask, scale=scale)[0]
            torch.testing.assert_close(few_query_attention(q, k, v, mask, scale), want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_steps_with_column_major_weights_and_few_query_attention_equal_the_reference():
    """A model laid out for steps (fp32, CPU: the bmm attention path) gives the logits of the
    model as built, stepped with the reference attention (need_weights), step by step and
    with beams sharing their sentence's cross-attention K/V."""
    ref, fast = make_model().float(), make_model().float()
    fast.lay_out_for_steps()
    linears = [m for m in fast.decoder_layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in linears)
    assert all(m.weight.is_contiguous() for m in fast.encoder_layers.modules() if isinstance(m, torch.nn.Linear))
    for name, p in fast.state_dict().items():
        assert torch.equal(p, ref.state_dict()[name]), name
    src = right_pad([tokens(5, seed=20), tokens(3, seed=21)])
    tgt = tokens(6, 4, seed=22)
    caches = [m.start_decoding(m.encode(src)) for m in (ref, fast)]
    expand = torch.tensor([0, 0, 0, 1, 1, 1])
    for cache in caches:
        cache.select(expand, group=3)
    for t in range(tgt.size(1)):
        y = tgt[:, t:t + 1]
        want = ref.decode_step(y, caches[0], need_weights=True)[0]
        got = fast.decode_step(y, caches[1])[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bucketed_rounds_up_to_a_bucket():
    assert bucketed(1) == CACHE_BUCKET and bucketed(CACHE_BUCKET) == CACHE_BUCKET
    assert bucketed(CACHE_BUCKET + 1) == 2 * CACHE_BUCKET and bucketed(0) == CACHE_BUCKET


def test_preallocated_cache_equals_concatenation():
    """append/select_rows hold exactly what torch.cat/index_select would, across a bucket
    boundary, rows duplicated (beams), reordered and dropped."""
    g = torch.Generator().manual_seed(0)
    cache = LayerCache(cross_k=None, cross_v=None)
    ref_k = ref_v = None
    B = 2
    for t in range(CACHE_BUCKET + 5):
        if t == 3:
            index = torch.tensor([0, 0, 1, 1, 1])  # expand to beams: more rows than the buffers
        elif t % 4 == 1 and t > 3:
            index = torch.randperm(B, generator=g)[:max(1, B - (t % 2))]  # reorder, sometimes shrink
        else:
            index = None
        if index is not None:
            cache.select_rows(index)
            ref_k, ref_v = ref_k[index], ref_v[index]
            B = index.numel()
        k, v = torch.randn(B, 2, 1, 3, generator=g), torch.randn(B, 2, 1, 3, generator=g)
        ref_k = k if ref_k is None else torch.cat([ref_k, k], 2)
        ref_v = v if ref_v is None else torch.cat([ref_v, v], 2)
        got_k, got_v = cache.append(k, v)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    assert cache.k_buf.size(2) == 2 * CACHE_BUCKET  # grew once, a bucket at a time


@torch.no_grad()
def test_beams_reordered_within_their_sentences_keep_the_per_sentence_rows():
    """select: a beam reorder (each sentence keeps its K rows) leaves the source mask as it
    was, and the beams' self-attention keys where they are (in their slots); the next step
    equals a cache of one row per beam whose rows were gathered from scratch."""
    model = make_model()
    src = right_pad([tokens(5, seed=2), tokens(3, seed=3)])  # (2, 5), the second padded
    fast, ref = (model.start_decoding(model.encode(src)) for _ in range(2))
    ref.beam_slots = False
    expand = torch.tensor([0, 0, 0, 1, 1, 1])
    fast.select(expand, group=3)
    ref.select(expand, group=3)
    assert fast.slots == 3 and ref.slots == 1
    y = tokens(6, 1, seed=4)
    model.decode_step(y, fast), model.decode_step(y, ref)
    mask, keys = fast.src_mask, fast.layers[0].k_buf
    reorder = torch.tensor([2, 0, 0, 5, 3, 4])
    fast.select(reorder)
    assert fast.src_mask is mask and fast.layers[0].k_buf is keys  # neither gathered again
    ref.src_mask = ref.src_mask.index_select(0, reorder)
    for layer in ref.layers:
        layer.select_rows(reorder)
    torch.testing.assert_close(model.decode_step(y, fast)[0], model.decode_step(y, ref)[0])
    fast.select(torch.tensor([3, 4, 5]), group=3)  # the first sentence leaves
    assert torch.equal(fast.src_mask, mask[3:])


def test_tail_filled_keeps_the_rows_that_go_on_and_moves_only_the_tail():
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        B = int(torch.randint(1, 40, (1,), generator=g))
        done = torch.rand(B, generator=g) < float(torch.rand(1, generator=g))
        index = tail_filled(done)
        n = int((~done).sum())
        assert sorted(index.tolist()) == (~done).nonzero().flatten().tolist()  # each row that goes on, once
        stay = (~done[:n]).nonzero().flatten()
        assert torch.equal(index[stay], stay)  # below n, a row that goes on stays where it is
        moves = tail_moves(index, B)
        if moves is not None:
            targets, sources = moves
            assert torch.equal(targets, done[:n].nonzero().flatten()) and bool((sources >= n).all())
        else:  # more than half of the rows move, or none leave
            assert n == B or 2 * int(done[:n].sum()) > n


def _gathered(cache, index, monkeypatch):
    """cache.select(index) by the gather of every row (tail moves off)."""
    with monkeypatch.context() as m:
        m.setattr(cache_module, "tail_moves", lambda *args: None)
        cache.select(index)


@pytest.mark.parametrize("K,layout", [(1, "rows"), (3, "slots"), (3, "rows")])
@pytest.mark.parametrize("kw", [dict(), dict(positions="t5_bias"), dict(coverage=True)],
                         ids=["sinusoidal", "t5_bias", "coverage"])
@torch.no_grad()
def test_sentences_leaving_by_tail_moves_equal_a_gather_of_every_row(kw, K, layout, monkeypatch):
    """select of a tail-filled index (greedy's rows, K = 1, or beam search's sentences of K
    beams, in slots or a row per beam) moves only the sentences that fill the ended ones'
    places, in the cache's own tensors; every next step equals that of a cache whose every
    row was gathered, across beam reorders and a bucket boundary."""
    model = make_model(**kw)
    g = torch.Generator().manual_seed(7)
    src = right_pad([tokens(n, seed=10 + n) for n in (5, 3, 7, 4, 6, 2, 5, 3)])  # (8, 7)
    moved, gathered = (model.start_decoding(model.encode(src)) for _ in range(2))
    N = src.size(0)
    for cache in (moved, gathered):
        cache.beam_slots = layout == "slots"
        if K > 1:
            cache.select(torch.arange(N).repeat_interleave(K), group=K)
    assert moved.slots == (K if layout == "slots" else 1)
    leave = {2: [0, 2], 5: [1], CACHE_BUCKET + 1: [0]}  # sentences that end at these steps
    for t in range(CACHE_BUCKET + 4):
        y = torch.randint(1, 20, (N * K, 1), generator=g)
        assert torch.equal(model.decode_step(y, moved)[0], model.decode_step(y, gathered)[0])
        if K > 1:  # the beams reordered within their sentences, as every step of a beam search
            index = (torch.randint(0, K, (N, K), generator=g) + torch.arange(N)[:, None] * K).flatten()
            moved.select(index), _gathered(gathered, index, monkeypatch)
        if t in leave:
            done = torch.zeros(N, dtype=torch.bool)
            done[leave[t]] = True
            keep = tail_filled(done)
            index = (keep[:, None] * K + torch.arange(K)).flatten()
            keys, mask = moved.layers[0].k_buf, moved.src_mask
            moved.select(index)
            assert moved.layers[0].k_buf is keys and moved.src_mask.data_ptr() == mask.data_ptr()  # in place
            _gathered(gathered, index, monkeypatch)
            N = keep.numel()
    assert N == 4 and moved.batch_size == 4 * K


@torch.no_grad()
def test_tail_moves_leave_the_encoder_state_and_inference_tensors_alone():
    """The moves write only the cache's own tensors: another cache of the same encoder
    state, and the state's mask, keep their rows; a cache made in inference mode and
    selected outside it gathers as before (torch forbids writing its tensors there)."""
    model = make_model()
    src = right_pad([tokens(n, seed=20 + n) for n in (5, 3, 7, 4)])
    enc = model.encode(src)
    mask = enc.src_mask.clone()
    first, second = model.start_decoding(enc), model.start_decoding(enc)
    y = tokens(4, 1, seed=1)
    model.decode_step(y, first), model.decode_step(y, second)
    first.select(tail_filled(torch.tensor([True, False, False, False])))  # row 3 moves to row 0
    assert first.batch_size == 3 and torch.equal(first.src_mask, mask[[3, 1, 2]])
    assert torch.equal(enc.src_mask, mask) and torch.equal(second.src_mask, mask)
    with torch.inference_mode():
        frozen = model.start_decoding(model.encode(src))
        model.decode_step(y, frozen)
    frozen.select(tail_filled(torch.tensor([True, False, False, False])))  # outside inference mode
    assert torch.equal(frozen.src_mask, mask[[3, 1, 2]])
    torch.testing.assert_close(model.decode_step(y[:3], frozen)[0], model.decode_step(y[:3], first)[0])


def _slot_and_row_caches(model, src, K):
    """Two caches of ``model`` over ``src``, each sentence made K beams: one with beam slots
    (what a beam search gets), one with a buffer row per beam (the layout slots replace)."""
    slots, rows = (model.start_decoding(model.encode(src)) for _ in range(2))
    rows.beam_slots = False
    expand = torch.arange(src.size(0)).repeat_interleave(K)
    for cache in (slots, rows):
        cache.select(expand, group=K)
    assert slots.slots == K and rows.slots == 1
    return slots, rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # fp32 on the CPU: the bmm path
@pytest.mark.parametrize("kw", [dict(), dict(positions="t5_bias"), dict(norm="post"), dict(coverage=True),
                                dict(copy=True)], ids=["sinusoidal", "t5_bias", "post-norm", "coverage", "copy"])
@torch.no_grad()
def test_beam_slots_equal_a_row_per_beam(kw, dtype):
    """Random beam reorders within sentences, sentences leaving, a bucket boundary crossed
    and at last the beams regrouped one by one (group 1: the slots become rows again):
    every step's scores equal those of the cache with one row per beam."""
    model = make_model(**kw).to(dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    g = torch.Generator().manual_seed(5)
    K, N = 3, 3
    src = right_pad([tokens(5, seed=30), tokens(3, seed=31), tokens(4, seed=32)])
    slots, rows = _slot_and_row_caches(model, src, K)
    for t in range(CACHE_BUCKET + 4):
        y = torch.randint(1, 20, (N * K, 1), generator=g)
        got, want = model.decode_step(y, slots)[0], model.decode_step(y, rows)[0]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        parents = torch.randint(0, K, (N, K), generator=g) + torch.arange(N)[:, None] * K
        index = parents.flatten()
        if t == 6:  # the second sentence leaves
            index = parents[[0, 2]].flatten()
            N = 2
        if t == CACHE_BUCKET + 2:  # rows leave one by one from now on
            index = torch.tensor([0, 2, 3, 4, 5])
            for cache in (slots, rows):
                cache.select(index, group=1)
            assert slots.slots == 1 and slots.ancestry is None
            N, K = 5, 1
            continue
        for cache in (slots, rows):
            cache.select(index)


@pytest.mark.parametrize("kw", [dict(), dict(positions="t5_bias")], ids=["sinusoidal", "t5_bias"])
@torch.no_grad()
def test_bf16_beam_slots_read_whole_follow_a_row_per_beam_in_fp32(kw):
    """Slots in bf16 (a cache's slot_dtype, as --precision auto keeps them on a CPU with native
    bf16) are whole buffers, zeros past t K, read whole under a mask with -inf there, across
    WHOLE_BUCKET boundaries, beams reordered, a sentence leaving and at last the beams regrouped
    (back to fp32 rows): every step's log-probabilities stay within bf16's rounding of those of
    the fp32 cache with one row per beam."""
    from s2s.model.cache import WHOLE_BUCKET

    model = make_model(**kw).float()
    g = torch.Generator().manual_seed(6)
    K, N = 3, 3
    src = right_pad([tokens(5, seed=60), tokens(3, seed=61), tokens(4, seed=62)])
    slots, rows = (model.start_decoding(model.encode(src)) for _ in range(2))
    slots.slot_dtype, rows.beam_slots = torch.bfloat16, False
    for cache in (slots, rows):
        cache.select(torch.arange(3).repeat_interleave(K), group=K)
    worst = 0.0
    for t in range(2 * WHOLE_BUCKET + 3):
        y = torch.randint(1, 20, (N * K, 1), generator=g)
        got, want = (torch.log_softmax(model.decode_step(y, c)[0], -1) for c in (slots, rows))
        worst = max(worst, (got - want).abs().max().item())
        if K > 1:
            layer = slots.layers[0]
            assert layer.k_buf.dtype == torch.bfloat16 and layer.k_buf.size(2) == K * bucketed(t + 1, WHOLE_BUCKET)
            assert not layer.k_buf[:, :, (t + 1) * K:].any()  # zeros past t K: finite, masked
        parents = torch.randint(0, K, (N, K), generator=g) + torch.arange(N)[:, None] * K
        index = parents.flatten()
        if t == 4:  # the second sentence leaves
            index, N = parents[[0, 2]].flatten(), 2
        if t == WHOLE_BUCKET + 5:  # rows leave one by one from now on: fp32 rows again
            for cache in (slots, rows):
                cache.select(torch.tensor([0, 2, 3, 4, 5]), group=1)
            assert slots.slots == 1 and slots.layers[0].k_buf.dtype == torch.float32
            N, K = 5, 1
            continue
        for cache in (slots, rows):
            cache.select(index)
    assert 0 < worst < 0.05  # bf16's rounding, not a key read unmasked (fp32 rows: 0 apart)


@torch.no_grad()
def test_searches_over_bf16_beam_slots_run_every_decode_feature():
    """With a model whose beams keep bf16 slots: n-best, a forced prefix, the coverage penalty
    (the last layer's attention weights) and lexical constraints (beams regrouped as the
    constraints allocate them) all search to the end, every hypothesis holding its constraint."""
    from s2s.config import DecodeConfig
    from s2s.constraints import pad_constraints, unmet_constraints
    from s2s.search import SpecialIds, search

    model = make_model()
    model.beam_slot_dtype = torch.bfloat16
    src = right_pad([tokens(5, seed=70), tokens(3, seed=71), tokens(6, seed=72)])
    ids, max_len = SpecialIds(bos_id=1, eos_id=2, pad_id=0), torch.full((3,), 10)
    prefix = torch.tensor([[7, 8], [9, -1], [-1, -1]])
    wanted = [[[11, 12]], [[13]], [[14]]]
    for kw, constraints in [(dict(nbest=3), None), (dict(coverage_penalty=0.2), None), (dict(nbest=2), wanted)]:
        decoder = ModelDecoder(model, src, track_attention="coverage_penalty" in kw)
        assert decoder.cache.slot_dtype == torch.bfloat16
        cons = None if constraints is None else pad_constraints(constraints)
        found = search(decoder, max_len, DecodeConfig(beam=4, **kw), ids,
                       prefix=prefix if constraints is None else None, constraints=cons)
        assert [len(h) for h in found] == [kw.get("nbest", 1)] * 3
        for n, hyps in enumerate(found):
            for h in hyps:
                assert math.isfinite(h.score)
                if constraints is None:
                    assert h.tokens[:int((prefix[n] >= 0).sum())] == prefix[n][prefix[n] >= 0].tolist()
                else:
                    assert unmet_constraints(h.tokens, constraints[n]) == []


@torch.no_grad()
def test_greedy_search_over_bf16_kv_reads_the_rounded_kv():
    """greedy_kv_dtype bf16 (a greedy search's under --precision auto on a CPU with native bf16,
    the attention through the C kernel): every layer's cross-attention K/V are the fp32 ones
    rounded to bf16, and its self-attention buffers bf16, written as each step computes them;
    the Python step and the scripted one keep the same dtypes and search the same tokens, to
    fp32's rounding of the scores; through torch's route too (whose products round q and the
    scores to bf16 as well, so to bf16's).  A coverage layer's K/V stay fp32, and a decoder
    tracking attention keeps them as computed."""
    import s2s.model.native as native
    from s2s.config import DecodeConfig
    from s2s.search import SpecialIds, search

    src = right_pad([tokens(5, seed=80), tokens(3, seed=81), tokens(6, seed=82)])
    ids, max_len, greedy = SpecialIds(bos_id=1, eos_id=2, pad_id=0), torch.full((3,), 10), DecodeConfig(beam=1)
    found = {}
    for kernel in (False, True) if native.available() else (False,):
        for scripted in (False, True):
            model = make_model(activation="relu").float()
            model.lay_out_for_steps()
            native.use_native_attention(model, kernel)
            if scripted:
                model.script_step()
                assert model.step_script is not None
            narrow = ModelDecoder(model, src, greedy_kv_dtype=torch.bfloat16)
            wide = ModelDecoder(model, src)
            for n, w in zip(narrow.cache.layers, wide.cache.layers):
                assert n.cross_k.dtype == n.cross_v.dtype == torch.bfloat16
                assert torch.equal(n.cross_k, w.cross_k.bfloat16()) and torch.equal(n.cross_v, w.cross_v.bfloat16())
            hyps = search(narrow, max_len, greedy, ids)
            assert {(lc.k_buf.dtype, lc.v_buf.dtype) for lc in narrow.cache.layers} == {(torch.bfloat16,) * 2}
            found[kernel, scripted] = [(s[0].tokens, s[0].score) for s in hyps]
    for kernel, scripted in found:
        got, want = found[kernel, scripted], found[kernel, False]
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, abs=1e-4 if kernel else 2e-2)
    model = make_model().float()
    tracked = ModelDecoder(model, src, track_attention=True, greedy_kv_dtype=torch.bfloat16)
    assert {lc.cross_k.dtype for lc in tracked.cache.layers} == {torch.float32}
    assert {lc.kv_dtype for lc in tracked.cache.layers} == {None}
    cache = model.start_decoding(model.encode(src))
    cache.layers[-1].coverage = torch.zeros(3, src.size(1))
    cache.narrow_kv(torch.bfloat16)
    assert [lc.cross_k.dtype for lc in cache.layers] == [torch.bfloat16] * (len(cache.layers) - 1) + [torch.float32]


def test_few_query_attention_with_narrower_kv_multiplies_in_their_dtype():
    """bf16 K/V with an fp32 query: the products of the K/V's dtype, the softmax of q's, the
    output in q's dtype, equal to the reference on the same bf16-rounded operands."""
    g = torch.Generator().manual_seed(8)
    B, H, T_q, T_k, e = 2, 4, 5, 9, 8
    q = torch.randn(B, H, T_q, e, generator=g)
    k, v = (torch.randn(B, H, T_k, e, generator=g).bfloat16() for _ in range(2))
    mask = torch.zeros(B, 1, T_q, T_k)
    mask[0, ..., 6:] = float("-inf")
    got = few_query_attention(q, k, v, mask)
    assert got.dtype == torch.float32
    scores = (q / e ** 0.5).bfloat16().float() @ k.float().transpose(-1, -2)
    A = torch.softmax(scores.bfloat16().float() + mask, -1).bfloat16().float()
    torch.testing.assert_close(got, (A @ v.float()).bfloat16().float(), atol=1e-2, rtol=1e-2)


def test_beam_slots_regrouped_before_a_step_and_with_gradients():
    """Regrouping to one row per beam before any step leaves slots at once (no keys yet);
    with autograd on, a sentence leaving a slot cache still works (no out= gathers)."""
    model = make_model()
    src = right_pad([tokens(5, seed=50), tokens(3, seed=51)])
    with torch.no_grad():
        cache = model.start_decoding(model.encode(src))
        cache.select(torch.tensor([0, 0, 0, 1, 1, 1]), group=3)
        cache.select(torch.tensor([0, 1, 2, 3, 4]), group=1)
        assert cache.slots == 1 and cache.ancestry is None
        model.decode_step(tokens(5, 1, seed=52), cache)
    slots, rows = _slot_and_row_caches(model, src, 3)
    y = tokens(6, 1, seed=53)
    for cache in (slots, rows):
        model.decode_step(y, cache)
        cache.select(torch.tensor([3, 4, 5]))  # the first sentence leaves
    got, want = model.decode_step(y[:3], slots)[0], model.decode_step(y[:3], rows)[0]
    torch.testing.assert_close(got, want)
    got.sum().backward()  # gradients flow through the gathered keys


@torch.no_grad()
def test_beam_search_with_slots_finds_what_rows_find():
    """A whole beam search (sentences finishing at different steps) with slots and without."""
    from s2s.config import DecodeConfig
    from s2s.search import SpecialIds, beam_search

    model = make_model()
    src = right_pad([tokens(5, seed=40), tokens(3, seed=41), tokens(7, seed=42), tokens(2, seed=43)])
    ids = SpecialIds(bos_id=1, eos_id=2, pad_id=0)
    found = []
    for beam_slots in (True, False):
        decoder = ModelDecoder(model, src)
        decoder.cache.beam_slots = beam_slots
        hyps = beam_search(decoder, torch.full((4,), 12), DecodeConfig(beam=4, nbest=2), ids)
        found.append([[(h.tokens, round(h.score, 9)) for h in sent] for sent in hyps])
        assert decoder.cache.slots == (4 if beam_slots else 1) or not decoder.cache.layers
    assert found[0] == found[1]


def test_beam_slots_in_bf16_only_for_an_fp32_model_on_a_cpu_with_native_bf16():
    from s2s.precision import beam_slot_dtype

    cpu, zen5 = torch.device("cpu"), {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert beam_slot_dtype(cpu, "fp32", zen5) == torch.bfloat16
    assert beam_slot_dtype(cpu, "fp32", {"avx2", "amx_bf16", "amx_tile"}) == torch.bfloat16
    assert beam_slot_dtype(cpu, "bf16", zen5) is None  # its K/V are bf16 already
    assert beam_slot_dtype(cpu, "fp32", {"avx2", "avx512f"}) is None
    assert beam_slot_dtype(torch.device("cuda"), "fp32", zen5) is None
    from s2s.precision import greedy_kv_dtype  # the same CPUs: a greedy search's cross-attention K/V

    assert greedy_kv_dtype(cpu, "fp32", zen5) == torch.bfloat16
    assert greedy_kv_dtype(cpu, "bf16", zen5) is None
    assert greedy_kv_dtype(cpu, "fp32", {"avx2", "avx512f"}) is None


def test_auto_precision_reads_the_cpu_flags():
    cpu = torch.device("cpu")
    assert auto_precision(cpu, {"avx512f", "avx512_bf16"})[0] == "bf16"
    assert auto_precision(cpu, {"avx2", "amx_bf16", "amx_tile"})[0] == "bf16"
    assert auto_precision(cpu, {"avx512f", "avx512bw", "avx512vl"}) == (
        "fp32", "no avx512_bf16/amx_bf16 among the CPU flags")


@pytest.mark.parametrize("arch_kw", [{}, {"coverage": True}, {"copy": True}])
@torch.no_grad()
def test_bf16_weights_decode_close_to_fp32(arch_kw):
    """The model converted to bf16 once: each step's log-probs stay close to fp32's."""
    model = make_model(**arch_kw).float()
    low = make_model(**arch_kw).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in low.parameters())
    src = right_pad([tokens(5, seed=60), tokens(9, seed=61)])
    tgt = tokens(2, 6, seed=62)
    ref, got = ModelDecoder(model, src, track_attention=True), ModelDecoder(low, src, track_attention=True)
    for t in range(tgt.size(1)):
        lp_ref, lp_got = ref.step(tgt[:, t:t + 1]), got.step(tgt[:, t:t + 1])
        assert lp_got.dtype == torch.float32  # log_softmax of fp32 logits
        torch.testing.assert_close(lp_got, lp_ref, atol=0.1, rtol=0)
        torch.testing.assert_close(got.attention(), ref.attention(), atol=0.02, rtol=0)


@torch.no_grad()
def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    """Where torch.compile fails, --compile decodes eagerly (same outputs) and warns once."""
    from s2s.config import DecodeConfig
    from s2s.search import SpecialIds, search
    from s2s.translate import compile_decode_step

    def broken_compile(fn, **kwargs):
        def call(*args, **kw):
            raise RuntimeError("no C++ compiler\nmore detail")
        return call

    model = make_model(dropout=0.0, attention_dropout=0.0).float()
    src = right_pad([tokens(5, seed=70), tokens(8, seed=71)])
    s, ids = DecodeConfig(beam=3), SpecialIds(bos_id=1, eos_id=2, pad_id=0)
    max_len = torch.full((2,), 9)
    eager = search(ModelDecoder(model, src), max_len, s, ids)
    monkeypatch.setattr(torch, "compile", broken_compile)
    compile_decode_step(model)
    with caplog.at_level("WARNING", logger="s2s"):
        got = search(ModelDecoder(model, src), max_len, s, ids)
    assert got == eager
    warnings = [r.getMessage() for r in caplog.records if "--compile" in r.getMessage()]
    assert warnings == ["--compile: torch.compile failed (RuntimeError: no C++ compiler); decoding without it"]
