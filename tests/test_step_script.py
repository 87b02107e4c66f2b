"""The decoder step as one TorchScript program (s2s.model.step_script, issue 15's lever 3):
the same hypotheses and scores as the Python step, bit for bit, over every arithmetic and
layout it covers; the Python step wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

import s2s.model.int8 as int8_module
import s2s.model.transformer as transformer_module
from s2s.config import DecodeConfig
from s2s.constraints import pad_constraints
from s2s.model import gemm
from s2s.model.cache import CACHE_BUCKET
from s2s.model.int8 import quantize_int8
from s2s.model.step_script import unsupported
from s2s.search import ModelDecoder, SpecialIds, search
from tests.test_model import make_model, right_pad, tokens

IDS = SpecialIds(bos_id=1, eos_id=2, pad_id=0)


def python_step(model) -> None:
    object.__setattr__(model, "step_script", None)


def searched(model, src: torch.Tensor, s: DecodeConfig, scripted: bool, normalized: bool = True, **kw):
    """Every hypothesis (tokens, score, log p) of a search, the step scripted (every step: counted)
    or in Python; the scores as their repr, exact (and a greedy search's unscored NaN equal to
    NaN).  Outputs of up to 36 tokens: past a self-attention buffer's first bucket (32)."""
    assert model.script_step(), unsupported(model)
    if not scripted:
        python_step(model)
    max_len = torch.full((src.size(0),), 4 + CACHE_BUCKET)
    calls, real = [], transformer_module.run_step_script
    transformer_module.run_step_script = lambda *a: calls.append(1) or real(*a)
    try:
        with torch.inference_mode():
            decoder = ModelDecoder(model, src, normalized=normalized)
            found = search(decoder, max_len, s, IDS, **kw)
    finally:
        transformer_module.run_step_script = real
    assert len(calls) == (decoder.cache.step if scripted else 0)
    return [[(h.tokens, repr(h.score), repr(h.log_prob)) for h in hyps] for hyps in found]


def assert_same_searches(model, normalized: bool = True) -> None:
    src = right_pad([tokens(5, seed=30), tokens(3, seed=31), tokens(7, seed=32), tokens(4, seed=33)])
    for s in (DecodeConfig(beam=1), DecodeConfig(beam=3, nbest=2), DecodeConfig(beam=4, alpha=0.6),
              DecodeConfig(beam=1, sampling=True, nbest=2, seed=3)):
        if not normalized and s.beam > 1:
            continue
        want = searched(model, src, s, scripted=False, normalized=normalized or s.sampling)
        got = searched(model, src, s, scripted=True, normalized=normalized or s.sampling)
        assert got == want, s
    if normalized:  # a forced prefix; lexical constraints (beams regrouped as they are allocated)
        prefix = torch.tensor([[7, 8], [9, -1], [-1, -1], [5, -1]])
        constraints = pad_constraints([[[11, 12]], [[13]], [[14]], [[6]]])
        for kw in (dict(prefix=prefix), dict(constraints=constraints)):
            s = DecodeConfig(beam=3)
            assert searched(model, src, s, True, **kw) == searched(model, src, s, False, **kw), kw


@pytest.mark.parametrize("overrides", [
    {},  # pre-norm, sinusoidal positions, GELU
    dict(norm="post", positions="learned", activation="relu"),
    dict(embed_norm=True, activation="silu", scale_embeddings=False),
    dict(activation="gelu_tanh", bias=False, tie_output=False),
])
def test_scripted_steps_search_what_python_steps_search(overrides):
    """fp64, as the model tests build it: greedy, beam search with n-best, and sampling (a
    sentence's rows grouped), rows and sentences leaving as they end."""
    assert_same_searches(make_model(**overrides))


def test_scripted_steps_in_fp32_laid_out_for_steps_and_unnormalized_greedy():
    """fp32 on the CPU: the attention through few_query_attention, W column-major as
    ``s2s translate`` lays it out; and greedy search's raw scores (no log-softmax)."""
    model = make_model(activation="relu").float()
    model.lay_out_for_steps()
    assert_same_searches(model)
    assert_same_searches(model, normalized=False)


def test_scripted_steps_over_bf16_beam_slots():
    """fp32 weights with the beams' self-attention K/V in bf16 slots read whole (what
    --precision auto keeps on a CPU with native bf16)."""
    model = make_model(activation="relu").float()
    model.beam_slot_dtype = torch.bfloat16
    assert_same_searches(model)


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("activation, rows", [("relu", 1), ("gelu", 1), ("relu", 3)])
def test_scripted_steps_with_int8_products(monkeypatch, onednn, activation, rows):
    """--quantize int8: the products int8 from ``rows`` rows of a 32 x 32 matrix on (the threshold
    lowered: 1 row for all; 3 rows, where each matrix has its own), the FFN's ReLU inside the int8
    product; with ``onednn`` the wide matrices (the FFN's W_1 here) through their oneDNN copy."""
    if onednn and "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch without oneDNN int8")
    monkeypatch.setattr(int8_module, "int8_min_macs", lambda: 1 if rows == 1 else rows * 32 * 32)
    monkeypatch.setattr(int8_module, "onednn_int8", lambda: onednn)
    monkeypatch.setattr(int8_module, "ONEDNN_MIN_ROWS", rows)
    monkeypatch.setattr(int8_module, "ONEDNN_MIN_WIDTH", 2)  # the FFN's W_1 (32 -> 64) is "wide"
    model = make_model(activation=activation).float()
    quantize_int8(model)
    thresholds = {m.int8_numel // m.in_features for m in model.modules() if isinstance(m, int8_module.Int8Linear)}
    assert thresholds == {1} if rows == 1 else {1, 2, 3} <= thresholds  # 3: the 32 x 32 ones
    assert_same_searches(model)
    model.beam_slot_dtype = torch.bfloat16
    assert_same_searches(model)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_scripted_steps_in_bf16_with_packed_weights(activation):
    """--precision bf16: bf16 weights, each W packed for oneDNN (the FFN's activation inside the
    packed product, as its post-op); pre- and post-norm."""
    for norm in ("pre", "post"):
        model = make_model(activation=activation, norm=norm).to(torch.bfloat16)
        if not gemm.use_packed_bf16(model):
            pytest.skip("oneDNN cannot pack bf16 weights here")
        assert_same_searches(model)


def test_a_failing_script_hands_the_step_to_python(caplog):
    """A script that raises when it runs (a torch that scripts but cannot run it): one warning,
    the Python step from then on, the same hypotheses."""
    model = make_model()
    src = right_pad([tokens(5, seed=60), tokens(3, seed=61)])
    s = DecodeConfig(beam=2)
    want = searched(model, src, s, scripted=False)

    def broken(*args):
        raise RuntimeError("cannot run")

    object.__setattr__(model, "step_script", broken)
    with caplog.at_level("WARNING", logger="s2s"), torch.inference_mode():
        found = search(ModelDecoder(model, src), torch.full((2,), 4 + CACHE_BUCKET), s, IDS)
    assert model.step_script is None
    assert caplog.text.count("the scripted decoder step failed (cannot run); decoding in Python") == 1
    assert [[(h.tokens, repr(h.score), repr(h.log_prob)) for h in hyps] for hyps in found] == want


@pytest.mark.parametrize("overrides, why", [
    (dict(copy=True), "copy or coverage"),
    (dict(coverage=True), "copy or coverage"),
    (dict(positions="t5_bias"), "relative positions"),
    (dict(norm_type="rmsnorm"), "RMSNorm"),
    (dict(gated_ffn=True), "a gated FFN"),
])
def test_models_the_script_does_not_cover_step_in_python(overrides, why):
    model = make_model(**overrides)
    assert unsupported(model) == why
    assert not model.script_step() and model.step_script is None
    src = right_pad([tokens(5, seed=40), tokens(3, seed=41)])
    with torch.inference_mode():
        found = search(ModelDecoder(model, src), torch.full((2,), 6), DecodeConfig(beam=2), IDS)
    assert [len(h) for h in found] == [1, 1]


def test_a_torch_that_cannot_script_steps_in_python(monkeypatch, caplog):
    def no_script(*args, **kwargs):
        raise RuntimeError("TorchScript is gone")

    monkeypatch.setattr(torch.jit, "script", no_script)
    model = make_model()
    with caplog.at_level("DEBUG", logger="s2s"):
        assert not model.script_step()
    assert "not scripted (RuntimeError: TorchScript is gone)" in caplog.text


def test_the_script_is_no_part_of_the_model_state():
    """Not a submodule: the state dict, the parameters and the modules are the model's own."""
    model = make_model()
    keys, params, modules = list(model.state_dict()), list(model.parameters()), list(model.modules())
    assert model.script_step()
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    assert list(model.modules()) == modules


def test_steps_that_need_python_do_not_run_the_script(monkeypatch):
    """Attention weights asked for (alignments, the coverage penalty), autograd, training,
    and a copy model's cache: the Python step."""
    model = make_model()
    assert model.script_step()
    calls = []
    real = transformer_module.run_step_script
    monkeypatch.setattr(transformer_module, "run_step_script", lambda *a: calls.append(1) or real(*a))
    src = right_pad([tokens(5, seed=50), tokens(3, seed=51)])
    y = torch.full((2, 1), IDS.bos_id)

    def step(**kw) -> None:
        cache = model.start_decoding(model.encode(src))
        model.decode_step(y, cache, **kw)

    with torch.no_grad():
        step(need_weights=True)
        step(need_last=True)
        model.train()
        step()
        model.eval()
    step()  # autograd on
    assert calls == []
    with torch.no_grad():
        step()
    assert calls == [1]


def test_translator_scripts_its_models_and_compile_takes_the_python_step(prepared, tmp_path):
    """Translator.set_arithmetic scripts each member once its matrices are set; --compile
    (torch.compile traces Python) drops the script."""
    from s2s.translate import Translator, compile_decode_step
    from tests.conftest import untrained_model_dir

    translator = Translator.from_dir(untrained_model_dir(prepared, tmp_path / "m"), beam=2)
    fp32 = translator.model.step_script
    assert fp32 is not None and fp32.layers[0].qkv_proj.int8 is None
    translator.quantize_int8()  # called alone too: its int8 copies scripted in
    int8 = translator.model.step_script
    assert int8 is not fp32 and int8.layers[0].qkv_proj.int8 is not None
    compile_decode_step(translator.model)
    assert translator.model.step_script is None


def test_debug_log_names_the_scripted_step(prepared, tmp_path):
    """``s2s --debug translate`` says the step was scripted (and how long that took); without
    --debug nothing is said."""
    from tests.conftest import untrained_model_dir
    from tests.test_cli import s2s

    model_dir = untrained_model_dir(prepared, tmp_path / "m")
    debug = s2s("--debug", "translate", "-m", model_dir, input="a b c\nd e\n")
    plain = s2s("translate", "-m", model_dir, input="a b c\nd e\n")
    assert debug.returncode == plain.returncode == 0 and debug.stdout == plain.stdout
    assert "s2s: decoder step scripted in " in debug.stderr and "scripted" not in plain.stderr


def test_scripted_steps_of_an_ensemble_over_a_vocabulary_subset(monkeypatch):
    """Two members, each scripted or each in Python, interpolated (EnsembleDecoder), scoring a
    shortlist's subset of the vocabulary: the same hypotheses."""
    from s2s.search import EnsembleDecoder

    members = [make_model(seed=0), make_model(seed=1, norm="post")]
    src = right_pad([tokens(5, seed=80), tokens(3, seed=81), tokens(6, seed=82)])
    ids = torch.tensor([0, 1, 2, 4, 5, 7, 8, 11, 13, 17, 19])  # the subset: pad, bos, eos and some
    sub_ids = SpecialIds(bos_id=1, eos_id=2, pad_id=0)  # their positions in the subset (ids[:3])
    found, calls, real = {}, [], transformer_module.run_step_script
    monkeypatch.setattr(transformer_module, "run_step_script", lambda *a: calls.append(1) or real(*a))
    for scripted in (False, True):
        for m in members:
            assert m.script_step()
            if not scripted:
                python_step(m)
        with torch.inference_mode():
            decoder = EnsembleDecoder([ModelDecoder(m, src, vocab_subset=ids) for m in members], [0.3, 0.7])
            hyps = search(decoder, torch.full((3,), 12), DecodeConfig(beam=3, nbest=2), sub_ids)
        found[scripted] = [[(h.tokens, repr(h.score)) for h in hs] for hs in hyps]
    assert found[True] == found[False] and all(len(hs) == 2 for hs in found[True])
    assert calls and len(calls) % 2 == 0  # both members' steps, scripted
