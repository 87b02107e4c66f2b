"""The encoder's packed path (s2s.model.packing): position-wise layers on the real positions only."""

import pytest
import torch

from s2s.config import ModelConfig
from s2s.model import make_model
from s2s.model.interface import EncoderState
from s2s.model.packing import MIN_PADDING, Packing

PAD = 0


def _sources(lengths: list[int], vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        src[i, :n] = torch.randint(1, vocab, (n,), generator=g)
    return src


def test_pack_and_pad_round_trip():
    src = _sources([5, 2, 4])
    packing = Packing.of(src, PAD)
    assert packing is not None and packing.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13]
    x = torch.randn(3, 5, 7)
    packed = packing.pack(x)
    assert packed.shape == (11, 7)
    real = src != PAD
    assert torch.equal(packed, x[real])
    padded = packing.pad(packed)
    assert torch.equal(padded[real], x[real]) and not padded[~real].any()


def test_too_little_padding_is_not_packed():
    assert Packing.of(_sources([4, 4, 4]), PAD) is None  # no padding
    lengths = [10] * 9 + [10 - int(MIN_PADDING * 100) + 1]  # 9 of 100 positions padded: under 10%
    assert Packing.of(_sources(lengths), PAD) is None
    assert Packing.of(_sources([10] * 9 + [10 - int(MIN_PADDING * 100)]), PAD) is not None  # 10 of 100


@pytest.mark.parametrize("kw", [{}, {"norm": "post"}, {"positions": "t5_bias"}, {"norm_type": "rmsnorm"},
                                {"gated_ffn": True, "activation": "silu"}, {"embed_norm": True}])
def test_packed_encoder_equals_padded_at_every_real_position(kw):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=2, dec_layers=1, d_ff=64, dropout=0.0, **kw)
    model = make_model(cfg, 60, 60, pad_id=PAD).eval()
    src = _sources([9, 3, 7, 1, 9, 2] if len(kw) % 2 else [20, 3, 7, 1, 20, 2])  # > 16 keys: torch's SDPA
    real = src != PAD
    assert Packing.of(src, PAD) is not None
    with torch.enable_grad():  # training's path: every position through every layer
        padded = model.encode(src).h_enc.detach()
    assert padded[~real].abs().sum() > 0  # the padded positions were computed: not packed
    with torch.no_grad():
        packed = model.encode(src).h_enc
    torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-6)
    assert not packed[~real].any()  # H_enc is 0 where the padding mask hides it
    with torch.no_grad():  # and so are the next-token scores of a decoding step
        y = torch.full((src.size(0), 1), 2)
        enc = model.encode(src)
        packed_step = model.decode_step(y, model.start_decoding(enc))[0]
        padded_step = model.decode_step(y, model.start_decoding(EncoderState(src, enc.src_mask, padded)))[0]
    torch.testing.assert_close(packed_step, padded_step, rtol=1e-5, atol=1e-5)


def test_packed_int8_and_copy_models_stay_close_to_padded():
    from s2s.model.int8 import int8_pays, quantize_int8

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=128, heads=4, enc_layers=2, dec_layers=1, d_ff=512, dropout=0.0, copy=True)
    model = make_model(cfg, 60, 60, pad_id=PAD).eval()
    src = _sources([60, 4, 40, 60, 2, 30])
    real = src != PAD
    assert int8_pays(int(real.sum()), 128, 3 * 128) and int8_pays(int(real.sum()), 128, 512)  # int8 runs packed
    y = torch.full((src.size(0), 1), 2)
    for m in (model, quantize_int8(make_model(cfg, 60, 60, pad_id=PAD).eval())):
        with torch.enable_grad():
            padded = m.encode(src).h_enc.detach()
        with torch.no_grad():
            enc = m.encode(src)
            packed_step = m.decode_step(y, m.start_decoding(enc))[0]  # copy: log P over the source too
            padded_step = m.decode_step(y, m.start_decoding(EncoderState(src, enc.src_mask, padded)))[0]
        tol = 1e-5 if m is model else 0.1  # int8 quantizes over the real rows only: close, not equal
        torch.testing.assert_close(enc.h_enc[real], padded[real], rtol=0, atol=tol)
        torch.testing.assert_close(packed_step, padded_step, rtol=0, atol=10 * tol)


def test_a_packed_batch_takes_no_cache():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=1, dec_layers=1, d_ff=64, dropout=0.0)
    layer = make_model(cfg, 60, 60, pad_id=PAD).encoder_layers[0]
    src = _sources([5, 2])
    packing = Packing.of(src, PAD)
    from s2s.model.cache import LayerCache

    with pytest.raises(ValueError, match="no cache"):
        layer(torch.randn(7, 32), None, LayerCache(None, None), packing=packing)
