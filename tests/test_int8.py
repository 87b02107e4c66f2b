"""Decoding's int8 matrices (s2s.model.int8): each product picks int8 or fp32 by its size."""

import pytest
import torch
import torch.nn.functional as F

from s2s.config import ModelConfig
from s2s.model import make_model
from s2s.model.int8 import INT8_MIN_MACS, Int8Linear, int8_pays, quantize_int8


def test_int8_pays_rule():
    # the measured crossovers (s2s/model/int8.py): a 192 x 576 matrix wins from 19 rows, a
    # 192 x 192 one from 57, W_U (192 x 4000, 3 MB in fp32) at any rows
    assert not int8_pays(18, 192, 576) and int8_pays(19, 192, 576)
    assert not int8_pays(56, 192, 192) and int8_pays(57, 192, 192)
    assert int8_pays(1, 192, 4000)
    assert int8_pays(1, 1024, 1024) and not int8_pays(1, 256, 512)
    assert int8_pays(INT8_MIN_MACS, 1, 1) and not int8_pays(INT8_MIN_MACS - 1, 1, 1)


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
    rows = -(-INT8_MIN_MACS // (64 * 96))
    many = torch.randn(3, rows, 64, generator=g)  # int8: close to fp32, not equal
    want, got = F.linear(many, W, b), layer(many)
    assert got.shape == want.shape == (3, rows, 96)
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    torch.testing.assert_close(got, layer.int8(many))


def _model(tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, heads=4, enc_layers=1, dec_layers=1, d_ff=128, dropout=0.0, tie_output=tie,
                      share_embeddings=tie, output_bias=not tie)
    return make_model(cfg, 2048, 2048).eval()


@pytest.mark.parametrize("tie", [True, False])
def test_quantized_model_scores_close_to_fp32_and_output_projection_in_int8(tie):
    model = _model(tie)
    src = torch.randint(4, 2048, (6, 9))
    tgt = torch.randint(4, 2048, (6, 7))
    with torch.no_grad():
        want = model(src, tgt)
        W_U = model.tgt_embed.weight if tie else model.output_proj.weight
        keys = set(model.state_dict())
        quantize_int8(model)
        got = model(src, tgt)
    assert isinstance(model.output_int8, Int8Linear) and model.output_int8.weight.data_ptr() == W_U.data_ptr()
    assert int8_pays(42, 64, 2048)  # so the 6 x 7 target positions' logits ran in int8
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    # the int8 argmax agrees with fp32's almost everywhere on random weights
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    # a shortlist reads the fp32 W_U rows, and the model's own keys are all still there
    ids = torch.tensor([3, 10, 700])
    torch.testing.assert_close(model.vocab_subset(ids).W, W_U.index_select(0, ids))
    assert keys <= set(model.state_dict())


def test_auto_int8_where_avx2():
    from s2s.precision import auto_int8

    cpu = torch.device("cpu")
    assert auto_int8(cpu, {"fma", "avx", "avx2"}) == (True, "CPU flag avx2")
    assert auto_int8(cpu, {"sse4_2", "avx"}) == (False, "no avx2 among the CPU flags")
    assert auto_int8(torch.device("cuda"), {"avx2"}) == (False, "device cuda")


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
    assert int8 == avx2 and tr.precision == "fp32"
    assert ("--precision auto: fp32 with int8 matrices where they are faster (no avx512_bf16/amx_bf16 among "
            "the CPU flags; CPU flag avx2)" in caplog.text) == avx2
    assert caplog.text.count("--precision auto") == 1
    assert len(tr.translate(["a b c", "d e"])) == 2
    plain = Translator.from_dirs([model_dir], precision="fp32")  # an explicit fp32 stays fp32
    assert not any(isinstance(m, Int8Linear) for m in plain.model.modules())
