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


@pytest.mark.parametrize("kw", [{}, {"norm": "post"}, {"positions": "t5_bias"}, {"tie_output": False}])
def test_packed_teacher_forcing_equals_padded_states_and_gradients(kw, monkeypatch):
    """Training's decoder pass (head=False) on the kept target positions only: the states and
    every parameter's gradient as through the padded layout (float64, no dropout)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=1, dec_layers=2, d_ff=64, dropout=0.0, **kw)
    model = make_model(cfg, 60, 60, pad_id=PAD).double().train()
    src = _sources([7, 3, 9, 5])
    tgt_in = _sources([6, 2, 8, 3])  # 15 of 32 positions padded
    keep = tgt_in != PAD
    calls = []

    def of_real(real, min_padding=MIN_PADDING, real_of=Packing.of_real):
        calls.append(1)
        return real_of(real, min_padding)

    monkeypatch.setattr(Packing, "of_real", staticmethod(of_real))
    packed = model(src, tgt_in, keep=keep, head=False)
    grads = torch.autograd.grad(packed.square().sum(), list(model.parameters()), allow_unused=True)
    assert calls and Packing.of_real(keep) is not None
    monkeypatch.setattr(Packing, "of_real", staticmethod(lambda real, min_padding=MIN_PADDING: None))
    padded = model(src, tgt_in, keep=keep, head=False)
    want = torch.autograd.grad(padded.square().sum(), list(model.parameters()), allow_unused=True)
    assert packed.shape == (int(keep.sum()), 32)
    torch.testing.assert_close(packed, padded, rtol=1e-10, atol=1e-12)
    for (name, _), g, w in zip(model.named_parameters(), grads, want):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=name)


def test_a_packed_decoder_pass_is_teacher_forcing_only():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, heads=4, enc_layers=1, dec_layers=1, d_ff=64, dropout=0.0)
    model = make_model(cfg, 60, 60, pad_id=PAD)
    src, tgt_in = _sources([4, 2]), _sources([4, 1])
    packing = Packing.of(tgt_in, PAD)
    cache = model.start_decoding(model.encode(src))
    cache.group = 2
    with pytest.raises(ValueError, match="teacher forcing from t = 0"):
        model.decoder_layers[0](packing.pack(torch.randn(2, 4, 32)), None, cache.src_mask, cache.layers[0],
                                cache.group, packing=packing)
