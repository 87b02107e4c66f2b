"""Greedy and beam search without torch (s2s.native_search, s2s/model/native_search.c).

Where the route is taken: the C search gives what torch's own search (greedy, and beam search
with each length penalty and stop rule) gives with the C search's arithmetic (weights and every
product's input and output rounded to bf16, or for int8 products W and x quantized row by row,
the residual stream, the norms, the attention and the scores in fp32), for every model option
it takes, on each kernel this CPU has: greedy line for line, beam search but for near ties;
``s2s translate`` decodes through it without importing torch, one line out per line in, empty
lines kept, in threads, and a bad input line stops it with the lines before it written.
Everywhere: which settings it takes and which it leaves to torch's route."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from s2s import native_search
from s2s.config import DecodeConfig, ModelConfig
from s2s.workers import TranslatorSpec


def runs(products: str) -> bool:
    """Whether the search's library runs ``products`` (bf16 or int8) here."""
    lib = native_search.library() if os.environ.get(native_search.DISABLE, "1") != "0" else None
    return lib is not None and native_search.has_products(lib, products)


PRODUCTS = [p for p in ("bf16", "int8") if runs(p)]  # bf16 on AMX or AVX512-BF16, int8 on AVX2
ROUTE = PRODUCTS[0] if PRODUCTS else None  # what the tests of everything but the products run
needs_route = pytest.mark.skipif(ROUTE is None, reason="the search's library is not built, or has no kernel here")
ARITHMETIC = {"bf16": {"precision": "bf16"}, "int8": {"precision": "fp32", "quantize": "int8"}}  # spec's


def needs(products: str) -> None:
    if products not in PRODUCTS:
        pytest.skip(f"no {products} products here")


def route_spec(directory: Path, decode: dict, products: Optional[str] = None, **kw) -> TranslatorSpec:
    """The spec of ``directory`` on the CPU whose products are ``products`` (default: ROUTE's)."""
    return TranslatorSpec(models=(str(directory),), overrides=decode, device="cpu",
                          **ARITHMETIC[products or ROUTE], **kw)


def route_args(products: Optional[str] = None) -> list[str]:
    """`s2s translate`'s options for ``products`` (default: ROUTE's), on the CPU (where a GPU
    driver is, auto is the GPU and torch's route)."""
    options = [a for key, value in ARITHMETIC[products or ROUTE].items() for a in (f"--{key}", value)]
    return options + ["--device", "cpu"]
REPO = Path(__file__).resolve().parents[1]

# model options the C search implements, each variant a few at once
VARIANTS = {
    "pre-norm": {},
    "post-norm, rmsnorm, gelu, learned positions": dict(norm="post", norm_type="rmsnorm", activation="gelu",
                                                        positions="learned", max_positions=256),
    "gated silu, no biases, unscaled attention, own output matrix and bias": dict(
        gated_ffn=True, activation="silu", bias=False, attention_scale=False, tie_output=False, output_bias=True),
    "bart-like: embedding norm, offset positions, gelu_tanh, scaled output": dict(
        embed_norm=True, positions="learned", max_positions=256, position_offset=2, activation="gelu_tanh",
        scale_embeddings=False, scale_output=True),
}


def model_dir(prepared: Path, directory: Path, **model) -> Path:
    """A model directory of the tiny config with ``model`` options, its weights drawn with seed 0
    and every parameter moved a little (norms and biases not at their 1 and 0)."""
    from s2s.config import load_config
    from s2s.modeldir import build_model, save_model_dir
    from s2s.tokenizer import Tokenizer

    cfg = load_config(prepared)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))
    tok = Tokenizer.load(cfg.data.dir, cfg.tokenizer, cfg.data)
    torch.manual_seed(0)
    net = build_model(cfg, tok)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_model_dir(directory, net, cfg, Path(cfg.data.dir), {"step": 0})
    return directory


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def quantized_rows(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """native_int8.c's q(W), s_W: each row's int8 values (as floats) and scale, in its fp32 steps."""
    top = W.abs().amax(1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))  # (one division)
    return (W * inv).round().clamp(-127, 127), top / 127.0


def int8_product(x: torch.Tensor, q: torch.Tensor, s_w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """native_int8.c's y = s_x s_W (sum_k (u(x) - z) q(W)) + b of bf16 x (rows, K) and quantized W:
    x's rows quantized to 7 bits over their range (0 included), the sums exact (integers in
    float64), scaled and biased with one rounding to fp32 as its fused multiply-add gives (a row
    whose range is below 2^-100 as zeros)."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    s_x = (hi - lo) / 127.0
    s_x = torch.where(s_x >= 2.0 ** -100, s_x, torch.zeros_like(s_x))
    inv = torch.where(s_x > 0, 1.0 / s_x, torch.zeros_like(s_x))
    z = torch.where(s_x > 0, (-lo * inv).round(), torch.zeros_like(s_x))
    u = ((x * inv).round() + z).clamp(0, 127)
    exact = (u.double() - z.double()) @ q.double().t()
    y = exact * (s_x * s_w.t()).double()
    return (y + (0 if b is None else b.double())).float()


def emulated_model(directory: Path, products: str = "bf16"):
    """The model directory ``directory`` loaded (s2s.modeldir.load_model_dir) with its model
    computing in the C search's arithmetic: each matrix and bias rounded to bf16, each product's
    input and output too (hooks on every nn.Linear, and the output projection's input), or with
    ``products`` int8 each product native_int8.c's (:func:`int8_product`, its output rounded to
    bf16), the rest, and the scores, in fp32."""
    from s2s.modeldir import load_model_dir

    loaded = load_model_dir(directory)
    model = loaded.model
    int8 = products == "int8"
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                if m.bias is not None:
                    m.bias.copy_(bf16(m.bias))
                if int8:
                    q, s_w = quantized_rows(m.weight)
                    m.forward = lambda x, q=q, s_w=s_w, b=m.bias: bf16(int8_product(bf16(x), q, s_w, b))
                    continue
                m.weight.copy_(bf16(m.weight))
                m.register_forward_pre_hook(lambda _, args: (bf16(args[0]),))
                m.register_forward_hook(lambda _, args, out: bf16(out))
    W_U = model.tgt_embed.weight if model.output_proj is None else model.output_proj.weight
    b_U = model.output_bias
    q_U, s_U = quantized_rows(W_U.detach())

    def logits(h, subset=None):  # (in fp32: the C search's scores are its sums, not rounded)
        ids = slice(None) if subset is None else subset.ids  # (a shortlist: its rows of W_U and b_U)
        b = None if b_U is None else bf16(b_U[ids])
        x = bf16(h * model.output_scale)
        if int8:
            return int8_product(x, q_U[ids], s_U[ids], b)
        z = x @ bf16(W_U[ids]).t()
        return z + (0 if b is None else b)

    model.logits = logits
    return loaded


def emulated(directory: Path, lines: list[str], decode: dict, products: str = "bf16",
             prefixes: Optional[list[str]] = None, tgt_first: tuple[int, ...] = ()) -> list[tuple[str, float]]:
    """torch's greedy search (s2s.translate.Translator) of the model in ``directory`` with the C
    search's arithmetic (:func:`emulated_model`).  ``prefixes``: --prefix-file's lines;
    ``tgt_first``: a target language's token(s) to force (as an imported mBART's or M2M100's)."""
    from s2s.modeldir import model_decode_settings
    from s2s.translate import Translator

    loaded = emulated_model(directory, products)
    settings = model_decode_settings(directory, loaded.cfg, decode, {})
    translator = Translator(loaded.model, loaded.tokenizer, settings)
    translator.directory = directory  # (its shortlist, where decode asks for one)
    translator.lang = dataclasses.replace(translator.lang, tgt_first=tgt_first)
    return [(t.text, t.hypotheses[0].score if t.hypotheses else math.nan)
            for t in translator.translate_lines(lines, prefixes=prefixes)]


def emulated_translations(directory: Path, lines: list[str], decode: dict, products: str = "bf16", **kw) -> list:
    """:func:`emulated`'s s2s.translate.Translation of each line (hypotheses, scores, texts)."""
    from s2s.translate import Translator

    captured, real = [], Translator.translate_lines

    def keep(self, *args, **kw):
        out = real(self, *args, **kw)
        captured.extend(out)
        return out

    Translator.translate_lines = keep
    try:
        emulated(directory, lines, decode, products, **kw)
    finally:
        Translator.translate_lines = real
    return captured


def native(directory: Path, lines: list[str], threads: int = 1, decode: Optional[dict] = None,
           products: Optional[str] = None) -> list[str]:
    from concurrent.futures import ThreadPoolExecutor

    engine = native_search.engine_for(route_spec(directory, decode or {"beam": 1}, products))
    assert engine is not None
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    return engine.translate_lines(lines, range(1, len(lines) + 1), pool)[0]


def dev_lines(prepared: Path, n: int) -> list[str]:
    return (prepared.parent / "dev.en").read_text(encoding="utf-8").splitlines()[:n]


SEARCHES = {
    "greedy": {"beam": 1},
    "greedy, min_len": {"beam": 1, "min_len": 4},
    "beam 4": {"beam": 4},
    "beam 3, power, early stop, min_len": {"beam": 3, "length_penalty": "power", "alpha": 1.0, "stop": "early",
                                           "min_len": 3},
    "beam 2, no length penalty, long outputs": {"beam": 2, "length_penalty": "none", "max_len_a": 2.0},
    # (short outputs: a long one with its n-grams blocked is left among a random model's flattest
    # choices, where two tokens tie to 1e-4 of log p and bf16's rounding picks either)
    "greedy, no_repeat_ngram 2": {"beam": 1, "no_repeat_ngram": 2, "max_len_a": 0.0, "max_len_b": 12},
    "beam 3, no_repeat_ngram 1": {"beam": 3, "no_repeat_ngram": 1},
}


def native_scores(directory: Path, lines: list[str], decode: dict, products: str) -> list[float]:
    """The C search's score of each line's output (NaN: greedy, or an empty line), all lines in
    one batch (a sentence's search does not depend on its batch)."""
    from s2s.tokenizer import encode_source_lines

    engine = native_search.engine_for(route_spec(directory, decode, products))
    ids = encode_source_lines(engine.tok, engine.lang, lines, range(1, len(lines) + 1), 0, engine.max_input)
    todo = [x for x in ids if x is not None]
    d = engine.decode
    found = iter(engine.model.search(todo, [native_search.max_output_length(len(x) - 1, d.max_len_a, d.max_len_b,
                                                                            engine.cap) for x in todo], d))
    return [math.nan if x is None else next(found)[0][1] for x in ids]


@pytest.mark.parametrize("products", ["bf16", "int8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("search", list(SEARCHES))
def test_the_c_search_is_torchs_with_its_arithmetic(prepared, tmp_path, variant, search, products):
    """Greedy search: line for line the same.  Beam search: the same but for a line or two, the
    same outputs scored alike (within 1e-3 of their size), and where a line differs, neither
    search's best much better than the other's (1%).  Its sums run in another order than torch's,
    and a last bit changed in an fp32 sum can round a bf16 input the other way: log p moves by
    1e-4 of its size over a sentence, enough to reorder two beams that all but tie (a random
    model's long repetitive outputs: 4 lines of 276 in the searches below when this was written,
    at 6e-6, 0.4%, 0.4% and 0.5% of their scores, the C search's better in two).  Each kind of
    products this CPU has: bf16 (AMX or AVX512-BF16), int8 (AVX2)."""
    needs(products)
    assert_searches_as_torch(model_dir(prepared, tmp_path / "m", **VARIANTS[variant]), dev_lines(prepared, 20),
                             SEARCHES[search], products)


def assert_searches_as_torch(d: Path, dev: list[str], decode: dict, products: str = "bf16") -> None:
    """test_the_c_search_is_torchs_with_its_arithmetic's check of model ``d`` on lines ``dev``."""
    lines = dev + ["", "   ", "x"]
    got, want = native(d, lines, decode=decode, products=products), emulated(d, lines, decode, products)
    assert got[20] == got[21] == ""
    assert native(d, lines, threads=2, decode=decode, products=products) == got  # threads share the batches out
    differ = [i for i, (text, (wanted, _)) in enumerate(zip(got, want)) if text != wanted]
    if decode["beam"] == 1:
        assert not differ
        return
    assert len(differ) <= 2, [(got[i], want[i][0]) for i in differ]
    scores = native_scores(d, lines, decode, products)
    for i in range(len(lines)):
        if lines[i].strip():
            assert scores[i] == pytest.approx(want[i][1], rel=1e-2 if i in differ else 1e-3), (
                f"line {i + 1}: {got[i]!r} against {want[i][0]!r}")


@pytest.mark.parametrize("kernel", [1, 2], ids=["amx_bf16", "avx512_bf16"])
@pytest.mark.parametrize("search", ["greedy", "beam 4"])
def test_each_kernel_of_the_products_searches_alike(prepared, tmp_path, kernel, search):
    """The products on each of native_linear.c's kernels this CPU has (s2s_bf16_linear_use): AMX's
    tiles or AVX512-BF16's vdpbf16ps; the same check."""
    needs("bf16")
    lib = native_search.library()
    try:
        if lib.s2s_bf16_linear_use(kernel) != kernel:
            pytest.skip("this CPU has not got that kernel")
        assert_searches_as_torch(model_dir(prepared, tmp_path / "m", **VARIANTS["post-norm, rmsnorm, gelu, learned "
                                                                                "positions"]),
                                 dev_lines(prepared, 20), SEARCHES[search])
    finally:
        lib.s2s_bf16_linear_use(0)


def random_shortlist(V_src: int, V_tgt: int, k: int = 3, frequent: int = 5, seed: int = 0, same: bool = False):
    """A shortlist table: k random target ids per source id (-1 in places; ``same``: one list for
    every source id, so that every batch's subset is the same) and ``frequent`` random frequent ones."""
    from s2s.shortlist import Shortlist

    g = torch.Generator().manual_seed(seed)
    top = torch.randint(0, V_tgt, (1 if same else V_src, k), generator=g, dtype=torch.int32).expand(V_src, k).clone()
    top[::7, -1] = -1
    return Shortlist(top, torch.randint(0, V_tgt, (frequent,), generator=g, dtype=torch.int32),
                     {"k": k, "frequent": frequent, "score": "dice", "sentences": 0})


def save_random_shortlist(d: Path, **kw) -> None:
    """random_shortlist for the model in ``d``, saved there (s2s.shortlist's file)."""
    from s2s.modeldir import load_model_dir
    from s2s.shortlist import save_shortlist

    model = load_model_dir(d).model
    save_shortlist(random_shortlist(model.src_embed.num_embeddings, model.tgt_embed.num_embeddings, **kw), d)


def test_a_batchs_shortlist_is_torchs():
    """s2s_shortlist_subset: the union of the batch's source ids' lists, the frequent ids and the
    special ids, ascending, as s2s.shortlist.Shortlist.subset computes it."""
    import ctypes

    lib = native_search.library()
    if lib is None:
        pytest.skip("the search's library is not built")
    V_src, V_tgt = 50, 300
    for seed in range(4):
        table = random_shortlist(V_src, V_tgt, k=4 + seed, frequent=3 * seed, seed=seed)
        src = torch.randint(0, V_src, (2 + 5 * seed,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
        always = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        mark, ids = (ctypes.c_ubyte * V_tgt)(), (ctypes.c_int32 * V_tgt)()
        top, frequent = table.top.contiguous(), table.frequent.contiguous()
        n = lib.s2s_shortlist_subset(top.data_ptr(), top.size(1), src.data_ptr(), len(src), frequent.data_ptr(),
                                     len(frequent), always.data_ptr(), 4, V_tgt, mark, ids)
        assert ids[:n] == table.subset(src.long().view(1, -1), always.tolist()).tolist()


@pytest.mark.parametrize("products", ["bf16", "int8"])
@pytest.mark.parametrize("search", ["greedy", "beam 4"])
def test_a_shortlist_searches_its_ids_alone_as_torch_does(prepared, tmp_path, search, products):
    """decode.shortlist: each batch's outputs are its shortlist's ids (its sources' lists, the
    frequent ids, the special ids), W_U's rows for them packed per batch; the same check as
    above against torch's route with the same shortlist."""
    needs(products)
    d = model_dir(prepared, tmp_path / "m")
    save_random_shortlist(d, k=40, same=True)  # (every batch's subset the same: torch's batches are not these)
    decode = {**SEARCHES[search], "shortlist": True}
    assert native_search.engine_for(route_spec(d, decode, products)) is not None
    assert_searches_as_torch(d, dev_lines(prepared, 20), decode, products)
    full = native(d, dev_lines(prepared, 20), decode=SEARCHES[search], products=products)
    assert native(d, dev_lines(prepared, 20), decode=decode, products=products) != full  # (a random list)


@needs_route
def test_a_shortlist_that_does_not_fit_is_left_to_torchs_error(prepared, tmp_path):
    d = model_dir(prepared, tmp_path / "m")
    spec = route_spec(d, {"beam": 1, "shortlist": True})
    assert native_search.engine_for(spec) is None  # (none there)
    (d / "shortlist.safetensors").write_bytes(b"not a table")
    assert native_search.engine_for(spec) is None
    save_random_shortlist(d)
    assert native_search.engine_for(spec) is not None
    from s2s.shortlist import Shortlist, save_shortlist

    save_shortlist(Shortlist(torch.full((3, 2), 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), {}), d)
    assert native_search.engine_for(spec) is None  # (3 source rows: not this model's)


@needs_route
def test_translate_decodes_without_torch(prepared, tmp_path):
    """`s2s translate --beam 1 --precision bf16 --workers 2` (`--quantize int8` on a CPU with
    int8 products alone): the C search's lines, one per input line, and torch never imported;
    with $S2S_NATIVE_SEARCH=0 (one worker), torch's route in this process."""
    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 20)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines[:10] + [""] + lines[10:]) + "\n", encoding="utf-8")
    probe = ("import atexit, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, "
             "file=sys.stderr)); sys.argv = ['s2s'] + sys.argv[1:]; from s2s.launch import main; main()")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["-m", str(d), "--beam", "1", *route_args(), "--workers", "2", "--input", str(src)]
    done = subprocess.run([sys.executable, "-c", probe, "translate", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stderr
    assert done.stdout.splitlines() == native(d, lines[:10] + [""] + lines[10:])
    one = [a if a != "2" else "1" for a in args]  # (torch's workers would import it in their own processes)
    done = subprocess.run([sys.executable, "-c", probe, "translate", *one], capture_output=True, text=True,
                          env={**env, native_search.DISABLE: "0"})
    assert done.returncode == 0, done.stderr
    assert "torch imported: True" in done.stderr and len(done.stdout.splitlines()) == 21


@needs_route
def test_a_bad_line_stops_the_threads_with_the_chunks_before_it_written(prepared, tmp_path):
    """Invalid UTF-8 on line 1,205: the first chunk of 1,000 lines is written, then the error
    naming the line, and a non-zero exit."""
    d = model_dir(prepared, tmp_path / "m")
    lines = (dev_lines(prepared, 20) * 61)[:1204]
    src = tmp_path / "in.txt"
    src.write_bytes(("\n".join(lines) + "\n").encode() + b"bad \xff line\nmore\n")
    done = subprocess.run([sys.executable, "-m", "s2s", "translate", "-m", str(d), "--beam", "1", *route_args(),
                           "--workers", "2", "--input", str(src)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    assert "1205" in done.stderr
    assert done.stdout.splitlines() == native(d, lines[:1000])


def spec(**kw) -> TranslatorSpec:
    return TranslatorSpec(**{"models": ("m",), "precision": "auto", "device": "cpu", **kw})


@pytest.mark.parametrize("kw,why", [
    (dict(models=("a", "b")), "ensemble"), (dict(device="cuda"), "--device"),
    (dict(precision="fp32"), "--precision"), (dict(quantize="int8", precision="bf16"), "--quantize"),
    (dict(alignments=True), "alignments")])
def test_settings_left_to_torch(kw, why, monkeypatch):
    monkeypatch.setattr(native_search.cbuild, "cpu_flags", lambda: frozenset({"amx_bf16", "avx2", "fma"}))
    assert native_search.spec_why_not(spec()) is None
    assert why in native_search.spec_why_not(spec(**kw))
    monkeypatch.setenv(native_search.DISABLE, "0")
    assert "0" in native_search.spec_why_not(spec())


AVX2 = {"avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # Intel's Cascade Lake, Ice Lake
ZEN4 = AVX512 | {"avx512_bf16"}  # AMD's Zen 4 and 5
AMX = ZEN4 | {"amx_bf16", "amx_int8", "amx_tile"}  # Intel's Xeons since Sapphire Rapids
SKYLAKE = AVX512 - {"avx512_vnni"}  # Intel's Skylake-SP


@pytest.mark.parametrize("flags,precision,quantize,want", [
    (ZEN4, "auto", None, "int8"), (ZEN4, "bf16", None, "bf16"), (AMX, "auto", None, "bf16"),
    (AMX, "bf16", None, "bf16"), (ZEN4, "auto", "int8", "int8"), (AMX, "auto", "int8", None),
    (ZEN4, "bf16", "int8", None), (ZEN4, "fp32", "int8", "int8"), (SKYLAKE, "auto", None, "int8"),
    (AMX, "fp32", "int8", "int8"), (AVX2, "auto", None, "int8"), (AVX2, "fp32", "int8", "int8"),
    (AVX2, "bf16", None, None), (AVX2, "fp32", None, None), (AVX512, "auto", None, "int8"),
    (AVX512, "bf16", None, None), (AVX512, "fp32", "int8", "int8"), ({"avx"}, "auto", None, None),
    ({"avx"}, "fp32", "int8", None), (AVX2, "bf16", "int8", None), (ZEN4, "fp16", None, None)])
def test_the_products_follow_the_cpu_and_the_precision(flags, precision, quantize, want):
    """--precision auto: bf16 products on AMX's tiles, int8 on every other CPU with AVX2 (VNNI's
    vpdpbusd beat vdpbf16ps on the Zen 4; benchmarks/README.md), as torch's route picks int8 matrices there too
    (s2s.precision.auto_arithmetic); --precision bf16: bf16 where the CPU has bf16 products (AMX
    or AVX512-BF16); --quantize int8 with fp32 on AVX2, and with auto where auto is int8 (on AMX
    torch's route refuses it); fp32 and fp16 are torch's, as is any CPU without AVX2."""
    got, why = native_search.products_for(precision, quantize, frozenset(flags))
    assert got == want, why
    if want is None:
        assert why


def test_auto_picks_int8_where_torchs_auto_does():
    """products_for's int8 for --precision auto is where s2s.precision.auto_arithmetic picks
    int8 matrices, and its bf16 where that picks bf16; but for AVX-512 without VNNI, where the
    int8 products of this route were measured (a Zen 4 capped to Skylake-SP's instructions) and
    torch's int8 matrices were not, so torch's route keeps fp32."""
    from s2s.precision import auto_arithmetic

    for flags in (AVX2, AVX512, ZEN4, AMX, {"avx"}, SKYLAKE):
        precision, int8, _ = auto_arithmetic(torch.device("cpu"), set(flags))
        got = native_search.products_for("auto", None, frozenset(flags))[0]
        if flags == SKYLAKE:
            assert (got, precision, int8) == ("int8", "fp32", False)
            continue
        assert (got == "int8") == int8 and (got == "bf16") == (precision == "bf16"), flags


@pytest.mark.parametrize("model,decode,why", [
    ({}, {}, None), (dict(arch="decoder_only"), {}, "arch"), (dict(positions="t5_bias"), {}, "positions"),
    (dict(copy=True), {}, "copy"), (dict(d_model=48, heads=2), {}, "d_model"), (dict(d_ff=100), {}, "d_ff"),
    ({}, dict(beam=5), None), ({}, dict(sampling=True), None), ({}, dict(coverage_penalty=0.2), "coverage"),
    ({}, dict(beam=5, nbest=2), None),
    ({}, dict(no_repeat_ngram=3), None), ({}, dict(shortlist=True), None),
    ({}, dict(glossary="g.tsv"), "glossary"), ({}, dict(split_sentences=True), None),
    ({}, dict(markup=True), "markup")])
def test_models_and_searches_left_to_torch(model, decode, why):
    m = ModelConfig(**{"d_model": 64, "heads": 2, "d_ff": 128, **model})
    got = native_search.model_why_not(m, DecodeConfig(**{"beam": 1, **decode}))
    assert got is None if why is None else why in got


def test_scores_nbest_rows_and_json_are_written_here():
    assert native_search.spec_why_not(spec(scores=True, nbest_rows=True)) is None
    assert native_search.spec_why_not(spec(output_format="jsonl")) is None


def scores_agree(rows: list[str], captured: list) -> int:
    """How many of the C search's --scores rows (TEXT, TAB, confidence) have the text of torch's
    route's Translation in ``captured``, each of those with its confidence (within 1e-3 of its size)."""
    from s2s.output import confidence

    agree = 0
    for row, t in zip(rows, captured):
        text, score = row.rsplit("\t", 1)
        if text != t.text:
            continue
        agree += 1
        want = confidence(t.hypotheses[0] if t.hypotheses else None)
        assert float(score) == pytest.approx(want, rel=1e-3, abs=1e-4), (text, score, want)
    return agree


@needs_route
@pytest.mark.parametrize("decode", [{"beam": 4}, {"beam": 1}, {"beam": 1, "min_len": 3, "max_len_a": 0.0,
                                                                "max_len_b": 4},
                                    {"beam": 1, "min_len": 5, "max_len_a": 0.0, "max_len_b": 3}])
def test_scores_are_the_mean_log_p_torch_gives(prepared, tmp_path, decode):
    """--scores: each line TEXT, TAB, its confidence (s2s.output: log p over its tokens, </s>
    counted) to 4 decimals, as torch's route with the C search's arithmetic gives it (within 1e-3
    of its size where the texts agree); an empty line 0.0000.  Greedy too, its log p summed in C
    (outputs cut at max_len: </s>'s own log p there; before min_len a blocked </s>, 0)."""
    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 20) + [""]
    engine = native_search.engine_for(route_spec(d, decode, scores=True))
    rows = engine.translate_lines(lines, range(1, len(lines) + 1), None)[0]
    assert rows[-1] == "\t0.0000" and all(row.count("\t") == 1 for row in rows)
    captured = emulated_translations(d, lines, decode, ROUTE)
    assert scores_agree(rows, captured) >= len(lines) - 2


@needs_route
@pytest.mark.parametrize("decode,scores,rows", [({"beam": 4, "nbest": 3}, True, False), ({"beam": 3}, False, True)])
def test_nbest_rows_are_torchs(prepared, tmp_path, decode, scores, rows):
    """--nbest K (or --nbest 1's rows): `LINE ||| TEXT ||| SEARCH_SCORE[<TAB>SCORE]` for each of a
    line's K best, best first, as s2s.output.format_translation writes torch's route's with the C
    search's arithmetic (the same rows but for a line or two, numbers within 1e-3 of their size);
    an empty line's row too."""
    from s2s.output import OutputFormat, format_translation

    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 20) + [""]
    engine = native_search.engine_for(route_spec(d, decode, scores=scores, nbest_rows=rows))
    got = engine.translate_lines(lines, range(1, len(lines) + 1), None)[0]
    greedy_rows = route_spec(d, {"beam": 1}, nbest_rows=True)
    assert native_search.engine_for(greedy_rows) is None  # (a greedy search's SEARCH_SCORE: torch's)
    captured = emulated_translations(d, lines, decode, ROUTE)
    fmt = OutputFormat(nbest=True, scores=scores)
    want = [format_translation(t, fmt).rstrip("\n") for t in captured]
    assert got[-1] == want[-1] == "20 |||  ||| 0.0000" + ("\t0.0000" if scores else "")
    differ = 0
    for g, w in zip(got, want):
        g_rows, w_rows = g.split("\n"), w.split("\n")
        assert len(g_rows) == len(w_rows) == (decode.get("nbest", 1) if g_rows[0].split(" ||| ")[1] else 1)
        if [r.split(" ||| ")[:2] for r in g_rows] != [r.split(" ||| ")[:2] for r in w_rows]:
            differ += 1
            continue
        for gr, wr in zip(g_rows, w_rows):
            g_nums = [float(x) for x in gr.split(" ||| ")[2].split("\t")]
            w_nums = [float(x) for x in wr.split(" ||| ")[2].split("\t")]
            assert g_nums == pytest.approx(w_nums, rel=1e-3, abs=2e-4), (gr, wr)
    assert differ <= 2


@needs_route
@pytest.mark.parametrize("decode", [{"beam": 4, "nbest": 2}, {"beam": 1}])
def test_json_lines_are_torchs(prepared, tmp_path, decode):
    """--format jsonl: one object per line, text and score (and "nbest", best first), as
    s2s.output.translation_json writes torch's route's with the C search's arithmetic."""
    import json

    from s2s.output import OutputFormat, format_translation

    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 20) + [""]
    engine = native_search.engine_for(route_spec(d, decode, output_format="jsonl"))
    got = [json.loads(x) for x in engine.translate_lines(lines, range(1, len(lines) + 1), None)[0]]
    captured = emulated_translations(d, lines, decode, ROUTE)
    fmt = OutputFormat(nbest=decode.get("nbest", 1) > 1, format="jsonl")
    want = [json.loads(format_translation(t, fmt)) for t in captured]
    assert got[-1] == want[-1] == ({"text": "", "score": 0.0, "nbest": [{"text": "", "score": 0.0}]}
                                   if "nbest" in decode else {"text": "", "score": 0.0})
    same = [(g, w) for g, w in zip(got, want) if g["text"] == w["text"]]
    assert len(same) >= len(lines) - 2
    for g, w in same:
        assert g.keys() == w.keys() and g["score"] == pytest.approx(w["score"], rel=1e-3, abs=2e-4)




def prefix_lines(prepared: Path, n: int) -> list[str]:
    """--prefix-file lines for the first n dev lines: the first one to three words of each line's
    reference translation, every fifth one empty (it forces nothing)."""
    refs = (prepared.parent / "dev.de").read_text(encoding="utf-8").splitlines()[:n]
    return ["" if i % 5 == 4 else " ".join(ref.split()[:1 + i % 3]) for i, ref in enumerate(refs)]


@pytest.mark.parametrize("products", ["bf16", "int8"])
@pytest.mark.parametrize("search", ["greedy", "beam 4", "beam 3, power, early stop, min_len"])
@pytest.mark.parametrize("shortlist", [False, True], ids=["", "shortlist"])
def test_a_forced_prefix_is_torchs(prepared, tmp_path, search, products, shortlist):
    """--prefix-file: each output starts with its line's prefix, the forced tokens scored at the
    model's log p before the search's rules (s2s.search.constrain), an empty prefix forcing
    nothing, room made for a prefix longer than max_len; with a shortlist the prefix's ids join
    the batch's.  As torch's route with the C search's arithmetic: texts (greedy: every one; beam
    search: but for a line or two) and --scores' confidences."""
    needs(products)
    d = model_dir(prepared, tmp_path / "m")
    decode = {**SEARCHES[search], "max_len_a": 0.0, "max_len_b": 6}  # (the longest prefixes need room)
    if shortlist:
        save_random_shortlist(d, k=3, same=True)  # (few ids: most of the prefixes' are not among them)
        decode["shortlist"] = True
    lines = dev_lines(prepared, 20) + ["", "x"]
    prefixes = prefix_lines(prepared, 20) + ["Paket", "Diese Bibliothek enthält die Dateien für die Entwicklung"]
    engine = native_search.engine_for(route_spec(d, decode, products, scores=True))
    rows = engine.translate_lines(lines, range(1, len(lines) + 1), None, prefixes)[0]
    texts = [row.rsplit("\t", 1)[0] for row in rows]
    for text, prefix in zip(texts[:20] + texts[21:], prefixes[:20] + prefixes[21:]):
        assert text.startswith(prefix), (text, prefix)
    assert rows[20] == "\t0.0000"  # (an empty line: its prefix is not used)
    assert texts != native(d, lines, decode=decode, products=products)
    captured = emulated_translations(d, lines, decode, products, prefixes=prefixes)
    agree = scores_agree(rows, captured)
    assert agree == len(lines) if decode["beam"] == 1 else agree >= len(lines) - 2


def first_step_q(d: Path, src: list[int], temperature: float, top_k: int, top_p: float,
                 products: str) -> torch.Tensor:
    """q of a sampling step's first token for source ids ``src`` in torch with the C search's
    arithmetic (:func:`emulated_model`): the model's log p with the search's rules
    (s2s.search.constrain) through s2s.search.sampling_distribution."""
    from s2s.config import DecodeConfig
    from s2s.search import SpecialIds, constrain, sampling_distribution

    loaded = emulated_model(d, products)
    tok = loaded.tokenizer
    with torch.no_grad():
        z = loaded.model.eval()(torch.tensor([src]), torch.tensor([[tok.bos_id]]))[:, 0]  # (1, V)
        ids = SpecialIds(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
        logp = constrain(torch.log_softmax(z.float(), -1), 0, torch.tensor([2]), DecodeConfig(), ids)
        return sampling_distribution(logp, temperature, top_k, top_p).exp()[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.6), (1.0, 8, 0.8),
                                                     (2.0, 1000, 0.95)])
def test_samples_are_drawn_from_torchs_q(prepared, tmp_path, temperature, top_k, top_p):
    """--sampling: 20,000 draws of a sentence's first token (each sample a row of its own) follow
    q, s2s.search.sampling_distribution's temperature, top-k (ties at the k-th kept) and nucleus
    (the mass before a token counted under q before top-k's cut), q computed by torch with the C
    search's arithmetic: Pearson's chi-square of the draws' counts against q within 6 of its
    standard deviations of its mean (the degrees of freedom: q's tokens but one), and no draw
    outside the tokens q keeps but where a token ties with the last kept one to 1e-3."""
    from s2s.tokenizer import encode_source_lines

    needs(ROUTE)
    d = model_dir(prepared, tmp_path / "m")
    N = 20_000
    decode = {"beam": 1, "sampling": True, "nbest": N, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    engine = native_search.engine_for(route_spec(d, decode))
    src = encode_source_lines(engine.tok, engine.lang, dev_lines(prepared, 1), [1], 0, engine.max_input)[0]
    q = first_step_q(d, src, temperature, top_k, top_p, ROUTE)
    seeds = [native_search.sample_seed(0, 1, 0, k) for k in range(N)]
    found = engine.model.search([src], [2], engine.decode, True, None, seeds)[0]
    assert len(found) == N and all(score <= 0 for _, score, _ in found)
    assert [score for _, score, _ in found] == sorted((score for _, score, _ in found), reverse=True)
    first = torch.tensor([tokens[0] if tokens else engine.tok.eos_id for tokens, _, _ in found])
    counts = torch.bincount(first, minlength=q.numel()).double()
    kept = q > 0
    outside = (counts > 0) & ~kept
    if bool(outside.any()):  # (only a near tie at the edge: the C search's sums are in another order)
        unfiltered = first_step_q(d, src, temperature, 0, 1.0, ROUTE)
        edge = float(unfiltered[kept].min())
        assert bool(((unfiltered[outside] - edge).abs() <= 1e-3 * edge).all()), outside.nonzero().flatten()
    df = int(kept.sum()) - 1
    chi2 = float((((counts - N * q) ** 2)[kept] / (N * q[kept])).sum())
    assert df >= 3 and chi2 <= df + 6 * (2 * df) ** 0.5, (chi2, df)


def test_sampling_keeps_the_searchs_rules(prepared, tmp_path):
    """Sampling under a prefix, decode.no_repeat_ngram and min_len/max_len: with top_k 1 it draws
    what the greedy search chooses under the same rules; with another seed each output still
    starts with its prefix, holds at least min_len tokens and no bigram twice."""
    needs(ROUTE)
    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 12)
    prefixes = prefix_lines(prepared, 12)
    rules = {"beam": 1, "no_repeat_ngram": 2, "min_len": 3, "max_len_a": 0.0, "max_len_b": 12}
    greedy = native_search.engine_for(route_spec(d, rules)).translate_lines(lines, range(1, 13), None, prefixes)[0]
    for decode, same in (({**rules, "sampling": True, "top_k": 1}, True),
                         ({**rules, "sampling": True, "seed": 5}, False)):
        engine = native_search.engine_for(route_spec(d, decode))
        found = engine.translate_sentences(lines, 1, prefixes)
        assert ([t.text for t in found] == greedy) is same
        for t, prefix in zip(found, prefixes):
            tokens, forced = t.hypotheses[0].tokens, len(engine.tok.encode_tgt([prefix])[0]) - 1 if prefix else 0
            assert t.text.startswith(prefix) and len(tokens) + 1 >= 3
            for j in range(max(forced, 1), len(tokens)):  # (a forced token may repeat one: torch's too)
                assert (tokens[j - 1], tokens[j]) not in set(zip(tokens[:j - 1], tokens[1:j])), (t.text, j)


@pytest.mark.parametrize("products", ["bf16", "int8"])
def test_sampling_draws_alike_in_any_batch_thread_or_order(prepared, tmp_path, products):
    """--sampling --seed S: each line's draws come from S, its line number and its sample alone
    (s2s.native_search.sample_seed), so a line is drawn alike in any batch, chunk or thread (torch's
    route draws from one generator per batch); another seed draws other tokens; top_k 1 is the
    greedy search; n samples a line are --nbest's rows, best score first."""
    needs(products)
    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 20)
    decode = {"beam": 1, "sampling": True, "seed": 3}
    got = native(d, lines, decode=decode, products=products)
    assert native(d, lines, threads=2, decode={**decode, "batch_size": 3}, products=products) == got
    engine = native_search.engine_for(route_spec(d, decode, products))
    back = engine.translate_lines(lines[::-1], range(len(lines), 0, -1), None)[0]
    assert back[::-1] == got
    other = native(d, lines, decode={**decode, "seed": 4}, products=products)
    assert sum(a != b for a, b in zip(got, other)) >= len(lines) // 2
    greedy = native(d, lines, decode={"beam": 1}, products=products)
    assert native(d, lines, decode={**decode, "top_k": 1}, products=products) == greedy
    shown = native(d, lines, decode={**decode, "nbest": 3}, products=products)  # (--nbest: rows)
    for text, block in zip(got, shown):
        samples = [row.split(" ||| ") for row in block.split("\n")]
        assert len(samples) == 3 and text in [sample[1] for sample in samples]  # (sample 0 is the same draw)
        assert [float(x[2]) for x in samples] == sorted((float(x[2]) for x in samples), reverse=True)


@pytest.mark.parametrize("search", ["greedy", "beam 4"])
def test_split_sentences_are_searched_and_joined_as_torchs(prepared, tmp_path, search):
    """--split-sentences: each line's sentences searched here (s2s.documents splits them and joins
    their outputs, as for torch's route), a prefix forcing the start of a line's first sentence;
    texts and --scores' confidences (a joined line: its sentences' log p over lp of all their
    tokens) as torch's route gives them with the C search's arithmetic."""
    pytest.importorskip("sentencex")
    needs(ROUTE)
    d = model_dir(prepared, tmp_path / "m")
    dev = [line.rstrip(".") + "." for line in dev_lines(prepared, 18)]
    lines = [" ".join(dev[i:i + 1 + (i // 3) % 3]) for i in range(0, 18, 3)] + ["", dev[0]]  # 1-3 sentences
    prefixes = ["Das", "", "Paket", "", "", "Ein", "", ""]
    decode = {**SEARCHES[search], "split_sentences": True}
    engine = native_search.engine_for(route_spec(d, decode, scores=True))
    assert engine is not None
    rows = engine.translate_lines(lines, range(1, len(lines) + 1), None, prefixes)[0]
    assert rows[6] == "\t0.0000" and rows[0].startswith("Das") and rows[2].startswith("Paket")
    captured = emulated_translations(d, lines, decode, ROUTE, prefixes=prefixes)
    agree = scores_agree(rows, captured)
    assert agree == len(lines) if search == "greedy" else agree >= len(lines) - 2
    whole = native(d, lines, decode=SEARCHES[search])  # (each line one input: another output)
    assert [row.rsplit("\t", 1)[0] for row in rows][:6] != whole[:6]


@pytest.mark.parametrize("search", ["greedy", "beam 4"])
def test_a_target_languages_token_is_forced_as_torch_forces_it(prepared, tmp_path, search):
    """A model whose outputs start with their language's token (an imported mBART's or M2M100's:
    LanguageIds.tgt_first) is searched here, that token forced first and then any prefix, as
    torch's route forces them (s2s.langs.with_forced)."""
    needs(ROUTE)
    d = model_dir(prepared, tmp_path / "m")
    lines = dev_lines(prepared, 12)
    engine = native_search.engine_for(route_spec(d, SEARCHES[search]))
    plain = engine.translate_lines(lines, range(1, len(lines) + 1), None)[0]
    first = (engine.tok.encode_tgt(["Paket"])[0][0],)  # (a target piece: as a language token would be)
    start = engine.tok.decode_tgt(list(first))
    engine.lang = dataclasses.replace(engine.lang, tgt_first=first)
    for prefixes in (None, prefix_lines(prepared, 12)):
        got = engine.translate_lines(lines, range(1, len(lines) + 1), None, prefixes)[0]
        want = [text for text, _ in emulated(d, lines, SEARCHES[search], ROUTE, prefixes=prefixes, tgt_first=first)]
        assert start and all(text.startswith(start) for text in got) and got != plain
        differ = sum(g != w for g, w in zip(got, want))
        assert differ == 0 if search == "greedy" else differ <= 2


@pytest.mark.parametrize("n,a,b,cap,want", [(10, 1.5, 10, 1024, 25), (0, 1.5, 10, 1024, 10), (3, 0.0, 1, 1024, 1),
                                            (100, 2.0, 10, 64, 64), (7, 1.2, 5, 1024, 13), (30, 2.1, 1, 1024, 63),
                                            (90, 0.7, 0, 1024, 63)])
def test_max_output_length_is_the_translators(n, a, b, cap, want):
    from s2s.translate import max_output_lengths

    assert native_search.max_output_length(n, a, b, cap) == want
    assert int(max_output_lengths(torch.tensor([n]), a, b, cap)[0]) == want


@needs_route
def test_a_beam_wider_than_the_vocabulary_is_left_to_torchs_error(prepared, tmp_path):
    d = model_dir(prepared, tmp_path / "m")
    spec = route_spec(d, {"beam": 301})
    assert native_search.engine_for(spec) is None
    assert native_search.engine_for(dataclasses.replace(spec, overrides={"beam": 300})) is not None
