"""Decoding's int8 matrices (s2s.model.int8): each product picks int8 or fp32 by its size."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import s2s.model.int8 as int8_module
from s2s.config import ModelConfig
from s2s.model import make_model
from s2s.model.int8 import (
    INT8_MIN_MACS,
    INT8_MIN_MACS_VNNI,
    ONEDNN_MIN_ROWS,
    Int8Linear,
    int8_min_rows,
    int8_pays,
    onednn_pays,
    quantize_int8,
)


def test_int8_pays_rule(monkeypatch):
    monkeypatch.setattr(int8_module, "vnni_int8", lambda: False)
    # the rule's thresholds (fitted to the figures in s2s/model/int8.py): a 192 x 576 matrix
    # takes int8 from 19 rows, a 192 x 192 one from 57, W_U (192 x 4000, 3 MB in fp32) at any rows
    assert not int8_pays(18, 192, 576) and int8_pays(19, 192, 576)
    assert not int8_pays(56, 192, 192) and int8_pays(57, 192, 192)
    assert int8_pays(1, 192, 4000)
    assert int8_pays(1, 1024, 1024) and not int8_pays(1, 256, 512)
    assert int8_pays(INT8_MIN_MACS, 1, 1) and not int8_pays(INT8_MIN_MACS - 1, 1, 1)
    for d_in, d_out in ((192, 576), (192, 192), (768, 192), (192, 4000), (64, 96)):
        rows = int8_min_rows(d_in, d_out)
        assert int8_pays(rows, d_in, d_out) and (rows == 1 or not int8_pays(rows - 1, d_in, d_out))
    assert int8_min_rows(192, 4000) == 1 and int8_min_rows(192, 576) == 19


def test_int8_pays_from_fewer_rows_with_vnni(monkeypatch):
    """With AVX-512 VNNI the threshold is INT8_MIN_MACS_VNNI multiply-adds (the second table in
    s2s/model/int8.py): a 256 x 768 matrix takes int8 from one row, a 256 x 256 one from three."""
    monkeypatch.setattr(int8_module, "vnni_int8", lambda: True)
    assert int8_module.int8_min_macs() == INT8_MIN_MACS_VNNI < INT8_MIN_MACS
    assert int8_pays(1, 256, 768) and int8_min_rows(256, 256) == 3
    assert not int8_pays(2, 256, 256) and int8_pays(3, 256, 256)
    assert int8_min_rows(192, 576) == 2 and int8_min_rows(192, 4000) == 1
    monkeypatch.setattr(int8_module, "vnni_int8", lambda: False)
    assert int8_min_rows(256, 256) == 32 and int8_min_rows(256, 768) == 11


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_takes_int8_above_the_threshold_and_fp32_below(bias):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(96, 64, generator=g) / 8
    b = torch.randn(96, generator=g) if bias else None
    layer = Int8Linear(W, b)
    assert layer.weight.data_ptr() == W.data_ptr()  # the fp32 matrix is shared, not copied
    few = torch.randn(2, 64, generator=g)  # 2 * 64 * 96 multiply-adds: fp32, exactly F.linear
    assert not int8_pays(2, 64, 96)
    assert torch.equal(layer(few), F.linear(few, W, b))
    rows = int8_min_rows(64, 96)
    many = torch.randn(3, rows, 64, generator=g)  # int8: close to fp32, not equal
    want, got = F.linear(many, W, b), layer(many)
    assert got.shape == want.shape == (3, rows, 96)
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    torch.testing.assert_close(got, layer.int8(many))


@pytest.mark.parametrize("bias", [True, False])
def test_int8_products_are_torchs_dynamic_quantized_linear(bias):
    """The packed copy gives what torch's DynamicQuantizedLinear.from_float of the same
    Linear gives, bit for bit (2-D and 3-D inputs)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(192, 576, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(576, 192, generator=g) / 10)
    linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
    torchs = DynamicLinear.from_float(linear)
    ours = Int8Linear(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
    for x in (torch.randn(64, 192, generator=g), torch.randn(3, 7, 192, generator=g)):
        assert torch.equal(ours.int8(x), torchs(x))


def test_onednn_pays_rule(monkeypatch):
    monkeypatch.setattr(int8_module, "onednn_int8", lambda: True)
    assert onednn_pays(ONEDNN_MIN_ROWS, 256, 8000) and not onednn_pays(ONEDNN_MIN_ROWS - 1, 256, 8000)
    assert onednn_pays(320, 192, 4000) and onednn_pays(320, 192, 1500)  # W_U, a shortlist's rows of it
    assert not onednn_pays(320, 256, 1024) and not onednn_pays(320, 256, 768)  # an FFN's W_1, a fused QKV
    assert not onednn_pays(640, 1024, 256)
    monkeypatch.setattr(int8_module, "onednn_int8", lambda: False)  # no VNNI, or no oneDNN in torch
    assert not onednn_pays(320, 256, 8000)


@pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines, reason="torch without oneDNN int8")
@pytest.mark.parametrize("bias", [True, False])
def test_wide_int8_product_with_many_rows_runs_through_a_onednn_copy_giving_the_same_values(monkeypatch, bias):
    monkeypatch.setattr(int8_module, "onednn_int8", lambda: True)
    g = torch.Generator().manual_seed(2)
    W = torch.randn(1000, 64, generator=g) / 8
    b = torch.randn(1000, generator=g) if bias else None
    layer = Int8Linear(W, b)
    engine = torch.backends.quantized.engine
    few = torch.randn(ONEDNN_MIN_ROWS - 1, 64, generator=g)
    layer(few)
    assert layer.packed_onednn is None  # packed only when a product has the rows for it
    many = torch.randn(2, ONEDNN_MIN_ROWS, 64, generator=g)
    got = layer(many)
    assert layer.packed_onednn is not None and torch.backends.quantized.engine == engine
    fbgemm = torch.ops.quantized.linear_dynamic(many, layer.packed, True)  # the same int8 W and scale
    assert got.shape == fbgemm.shape == (2, ONEDNN_MIN_ROWS, 1000)
    torch.testing.assert_close(got, fbgemm, rtol=1e-5, atol=1e-5)
    want = F.linear(many, W, b)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def _model(arch: str, tie: bool, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, d_model=64, heads=4, enc_layers=1, dec_layers=1, d_ff=128, dropout=0.0,
                      tie_output=tie, share_embeddings=tie or arch != "encoder_decoder", **kw)
    return make_model(cfg, 2048, 2048).eval()


@pytest.mark.parametrize("arch, tie, kw", [
    ("encoder_decoder", True, {}),
    ("encoder_decoder", False, {"output_bias": True}),
    ("encoder_decoder", True, {"output_bias": True, "scale_output": True}),
    ("decoder_only", True, {}),
    ("prefix_lm", False, {}),
])
def test_quantized_model_scores_close_to_fp32_and_output_projection_in_int8(arch, tie, kw):
    model = _model(arch, tie, **kw)
    src = torch.randint(4, 2048, (6, 9))
    tgt = torch.randint(4, 2048, (6, 7))
    with torch.no_grad():
        want = model(src, tgt)
        W_U = model.tgt_embed.weight if tie else model.output_proj.weight
        keys = set(model.state_dict())
        quantize_int8(model)
        got = model(src, tgt)
        calls = []
        int8 = model.output_int8.int8
        model.output_int8.int8 = lambda x: calls.append(1) or int8(x)
        model(src, tgt)
        del model.output_int8.int8
    assert calls  # the logits came from W_U's int8 copy
    assert isinstance(model.output_int8, Int8Linear) and model.output_int8.weight.data_ptr() == W_U.data_ptr()
    if not tie:
        assert model.output_int8 is model.output_proj  # one int8 copy of an untied W_U, not two
    assert int8_pays(42, 64, 2048)  # so the 6 x 7 target positions' logits ran in int8
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    # the int8 argmax agrees with fp32's almost everywhere on random weights
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # a shortlist gathers the fp32 W_U rows and quantizes them once: its logits are the
    # subset's fp32 ones within int8's error, and the model's own keys are all still there
    ids = torch.arange(3, 2048, 3)
    subset = model.vocab_subset(ids)
    torch.testing.assert_close(subset.W, W_U.index_select(0, ids))
    assert isinstance(subset.int8, Int8Linear) and subset.int8.weight is subset.W
    h = torch.randn(64, 64)
    with torch.no_grad():
        got, want = model.logits(h, subset), model.logits(h)[:, ids]
        subset.int8 = None
        fp32 = model.logits(h, subset)
    assert int8_pays(64, 64, ids.numel()) and not torch.equal(got, fp32)
    assert (got - fp32).abs().max() < 0.1 * fp32.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert keys <= set(model.state_dict())


def test_quantizing_draws_nothing_from_torchs_generator():
    model = _model("encoder_decoder", True)
    torch.manual_seed(5)
    quantize_int8(model)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


def test_auto_arithmetic_adds_int8_on_avx2_without_amx():
    """fp32 weights with int8 matrices on every CPU with AVX2 but not AMX: AVX2 alone (Zen 2) and
    AVX-512 with VNNI but without bf16 (a Zen 4 capped to Cascade Lake's instructions), benchmarks/README.md's
    figures; AVX-512 without VNNI (Skylake-SP) keeps fp32, int8 unmeasured there."""
    from s2s.precision import auto_arithmetic

    cpu = torch.device("cpu")
    none = "no avx512_bf16/amx_bf16 among the CPU flags"
    for flags in ({"fma", "avx", "avx2"}, {"avx2", "avx512f", "avx512_vnni"}):
        assert auto_arithmetic(cpu, flags) == ("fp32", True, none + "; int8 matrices where they are faster "
                                                                   "(avx2, no AMX)")
    assert auto_arithmetic(cpu, {"avx2", "avx512f", "avx512bw"}) == (
        "fp32", False, none + "; int8 unmeasured with AVX-512 without avx512_vnni")
    assert auto_arithmetic(cpu, {"sse4_2", "avx"}) == ("fp32", False, none + "; no avx2 for int8")


def test_auto_arithmetic_takes_int8_over_bf16_without_amx():
    """AVX-512 BF16 but no AMX (AMD EPYC Zen 4 and 5): int8 decoded faster than bf16 there;
    with AMX (Intel Xeon) bf16 did."""
    from s2s.precision import auto_arithmetic

    cpu = torch.device("cpu")
    zen5 = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"}
    assert auto_arithmetic(cpu, zen5) == (
        "fp32", True, "CPU flags avx512_bf16 but no amx_bf16: int8 matrices (faster than bf16 there)")
    assert auto_arithmetic(cpu, zen5 | {"amx_bf16", "amx_int8"}) == (
        "bf16", False, "CPU flags amx_bf16 avx512_bf16")
    assert auto_arithmetic(cpu, {"avx512f", "avx512_bf16"})[:2] == ("bf16", False)  # (no avx2: none seen)


@pytest.mark.parametrize("avx2", [True, False])
def test_translator_precision_auto_adds_int8_where_it_pays(prepared, tmp_path, monkeypatch, caplog, avx2):
    import logging

    from s2s import precision
    from s2s.translate import Translator
    from tests.conftest import untrained_model_dir

    model_dir = untrained_model_dir(prepared, tmp_path / "m")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"fma", "avx", "avx2"} if avx2 else {"avx"}))
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda flags=None: [])
    with caplog.at_level(logging.INFO, logger="s2s"):
        tr = Translator.from_dirs([model_dir], precision="auto", decode={"beam": 2})
    int8 = any(isinstance(m, Int8Linear) for m in tr.model.modules())
    assert int8 == avx2 == tr.int8 and tr.precision == "fp32"
    assert ("--precision auto: fp32 and int8 (" in caplog.text) == avx2
    assert caplog.text.count("--precision auto") == 1
    fp32_lines = Translator.from_dirs([model_dir], precision="fp32", decode={"beam": 2}).translate(["a b c", "d e"])
    assert tr.translate(["a b c", "d e"]) == fp32_lines  # the tiny model's products are all fp32's
    if avx2:  # with every product in int8, the search runs through the int8 kernels end to end
        for m in tr.model.modules():  # each layer's threshold (int8_pays's rule) at 0 rows
            if isinstance(m, Int8Linear):
                monkeypatch.setattr(m, "int8_numel", 0)
        object.__setattr__(tr.model, "step_script", None)  # the Python step, whose products are seen here
        taken, int8_product = [], Int8Linear.int8
        monkeypatch.setattr(Int8Linear, "int8", lambda self, x, relu=False: taken.append(
            x.numel() // self.in_features) or int8_product(self, x, relu))
        lines = tr.translate(["a b c", "d e"])
        assert len(lines) == 2
        assert len(taken) > 10 and 4 in taken  # the decoder's steps: 2 x 2 beams
        assert tr.model.script_step() and tr.translate(["a b c", "d e"]) == lines  # the scripted step's too
    plain = Translator.from_dirs([model_dir], precision="fp32")  # an explicit fp32 stays fp32
    assert not any(isinstance(m, Int8Linear) for m in plain.model.modules())


def test_translator_precision_auto_keeps_beam_slots_in_bf16_where_bf16_is_native(prepared, tmp_path, monkeypatch,
                                                                                  caplog):
    """On a CPU with AVX-512 BF16 and VNNI but no AMX (AMD EPYC Zen 5): fp32 with int8 matrices,
    and a beam search's self-attention K/V in bf16; explicit fp32 keeps them fp32."""
    import logging

    from s2s import precision
    from s2s.translate import Translator
    from tests.conftest import untrained_model_dir

    model_dir = untrained_model_dir(prepared, tmp_path / "m")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}))
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda flags=None: ["avx512_bf16"])
    with caplog.at_level(logging.INFO, logger="s2s"):
        tr = Translator.from_dirs([model_dir], precision="auto", decode={"beam": 3})
    assert tr.int8 and tr.precision == "fp32" and tr.model.beam_slot_dtype == torch.bfloat16
    import s2s.model.native as native

    greedy_too = " and greedy search's attention K/V" if native.available() else ""  # (where the kernel reads them)
    assert f"--precision auto: fp32 and int8, beams' self-attention K/V{greedy_too} in bf16 (" in caplog.text
    from s2s.search import ModelDecoder

    decoder = ModelDecoder(tr.model, torch.tensor([[5, 6, 7, 2]]))
    assert decoder.cache.slot_dtype == torch.bfloat16
    assert len(tr.translate(["a b c", "d e"])) == 2
    assert Translator.from_dirs([model_dir], precision="fp32", decode={"beam": 3}).model.beam_slot_dtype is None


def test_translator_precision_auto_keeps_greedy_kv_in_bf16_where_bf16_is_native(prepared, tmp_path, monkeypatch):
    """The same CPU, one thread, the C kernel built: a greedy search keeps its attention K/V in
    bf16 (the cross-attention's computed in fp32 once, then rounded), a beam search and sampling
    keep the model's; so do explicit fp32 with int8, and auto where the kernel does not run
    (two threads)."""
    import s2s.model.native as native
    from s2s import precision
    from s2s.search import ModelDecoder
    from s2s.translate import Translator
    from tests.conftest import untrained_model_dir

    if not native.available():
        pytest.skip("the C kernel is not built here")
    model_dir = untrained_model_dir(prepared, tmp_path / "m")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}))
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda flags=None: ["avx512_bf16"])
    tr = Translator.from_dirs([model_dir], precision="auto", decode={"beam": 1})
    assert tr.model.greedy_kv_dtype == torch.bfloat16
    narrowed = []
    real = ModelDecoder.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        narrowed.append({lc.cross_k.dtype for lc in self.cache.layers} | {lc.kv_dtype for lc in self.cache.layers})

    monkeypatch.setattr(ModelDecoder, "__init__", recording)
    greedy = tr.translate(["a b c", "d e"])
    assert len(greedy) == 2 and narrowed == [{torch.bfloat16}]
    tr.decode = replace(tr.decode, beam=3)
    tr.translate(["a b c"])
    assert narrowed[-1] == {torch.float32, None}  # a beam search reads them as computed
    tr.decode = replace(tr.decode, beam=1, sampling=True)
    tr.translate(["a b c"])
    assert narrowed[-1] == {torch.float32, None}
    explicit = Translator.from_dirs([model_dir], precision="fp32", quantize="int8", decode={"beam": 1})
    assert explicit.model.greedy_kv_dtype is None
    explicit.translate(["a b c"])
    assert narrowed[-1] == {torch.float32, None}
    torch.set_num_threads(2)
    assert Translator.from_dirs([model_dir], precision="auto", decode={"beam": 1}).model.greedy_kv_dtype is None


def test_relu_ffn_fuses_the_relu_into_its_int8_product(monkeypatch):
    """A ReLU FFN whose W_1 takes int8 runs max(0, x W_1^T + b_1) as one fused int8 call, with
    the values of the ReLU after the int8 product, bit for bit; below the threshold, fp32."""
    from s2s.model.layers import FeedForward

    torch.manual_seed(0)
    ffn = quantize_int8(FeedForward(64, 256, "relu", 0.0).eval())
    calls = []
    int8 = Int8Linear.int8

    def spy(self, x, relu=False):
        calls.append(relu)
        return int8(self, x, relu)
    monkeypatch.setattr(Int8Linear, "int8", spy)
    x = torch.randn(2, int8_min_rows(64, 256), 64)
    with torch.no_grad():
        got = ffn(x)
        calls_fused = list(calls)
        want = ffn.w_2(torch.relu(int8(ffn.w_1, x)))
    assert calls_fused[0] is True and torch.equal(got, want)
    few = torch.randn(1, 64)  # 16K multiply-adds: fp32 under either rule
    assert not int8_pays(1, 64, 256)
    assert torch.equal(ffn(few), ffn.w_2(torch.relu(F.linear(few, ffn.w_1.weight, ffn.w_1.bias))))
