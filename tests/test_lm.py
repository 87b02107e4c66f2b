"""prefix_lm and decoder_only: the mask of docs/model.md (8), the cache against teacher forcing, the pipeline."""

import pytest
import torch

from s2s.config import DecodeConfig, ExperimentConfig, ModelConfig, TrainConfig, check_arch_supports, load_config
from s2s.errors import ConfigError, S2SError
from s2s.model import DecoderOnlyLM, make_model
from s2s.model.lm import lm_mask, prefix_lm_mask
from s2s.search import ModelDecoder, SpecialIds, search
from s2s.tokenizer import BOS_ID, EOS_ID, PAD_ID

IDS = SpecialIds(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)

INF = float("-inf")


def test_prefix_lm_mask_cell_by_cell():
    """M_ij = 0 if j <= n; 0 if n < j <= i; -inf if j > i and j > n   (1-based i, j; n = 3)."""
    n, L = 3, 6
    M = prefix_lm_mask(n, L)
    for i in range(1, L + 1):
        for j in range(1, L + 1):
            expected = 0.0 if j <= n or j <= i else INF
            assert M[i - 1, j - 1].item() == expected, (i, j)


def test_decoder_only_mask_is_causal():
    M = lm_mask("decoder_only", 3, 5)
    assert torch.equal(M == 0, torch.ones(5, 5).tril().bool())


def tiny(arch: str, positions: str = "sinusoidal") -> DecoderOnlyLM:
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=32, dropout=0.0,
                      positions=positions, max_positions=64)
    return make_model(cfg, 40, 40, pad_id=0).eval()


@pytest.mark.parametrize("arch", ["prefix_lm", "decoder_only"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_cached_steps_match_teacher_forcing_and_ignore_batch_padding(arch, positions):
    model = tiny(arch, positions)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])  # the second is padded
    tgt_in = torch.tensor([[2, 11, 12, 13], [2, 14, 15, 16]])
    with torch.no_grad():
        forced = model(src, tgt_in)  # (2, 4, V)
        cache = model.start_decoding(model.encode(src))
        steps = torch.stack([model.decode_step(tgt_in[:, t:t + 1], cache)[0] for t in range(4)], dim=1)
        alone = model(src[1:, :3], tgt_in[1:])
    assert torch.allclose(forced, steps, atol=1e-5)
    assert torch.allclose(forced[1:], alone, atol=1e-5)  # padding between x and y changes nothing


def test_prefix_lm_sees_the_whole_prefix_decoder_only_does_not():
    """Changing the last prefix token changes the first prefix position's keys in the second
    block in prefix_lm (position 1 looks ahead in block 1), never in decoder_only."""
    for arch, differs in (("prefix_lm", True), ("decoder_only", False)):
        model = tiny(arch)
        a = torch.tensor([[5, 6, 3]])
        b = torch.tensor([[5, 7, 3]])
        with torch.no_grad():
            ca = model.encode(a).prefix
            cb = model.encode(b).prefix
        assert len(model.layers) == 2
        k_first = (ca[1].self_k[:, :, 0], cb[1].self_k[:, :, 0])
        assert (not torch.allclose(*k_first)) == differs


@pytest.mark.parametrize("arch", ["prefix_lm", "decoder_only"])
def test_beam_search_runs_on_the_cache(arch):
    model = tiny(arch)
    src = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]])
    with torch.no_grad():
        found = search(ModelDecoder(model, src), torch.tensor([6, 6]), DecodeConfig(beam=3), IDS)
        one = search(ModelDecoder(model, src[1:, :2]), torch.tensor([6]), DecodeConfig(beam=3), IDS)
    assert found[1][0].tokens == one[0][0].tokens


@pytest.mark.parametrize("arch", ["prefix_lm", "decoder_only"])
def test_train_translate_score_through_the_same_commands(prepared, tmp_path, arch):
    from s2s.trainer import train
    from s2s.translate import Translator

    run = train(load_config(prepared, [f"model.arch={arch}", "train.max_steps=2", "train.validate_every=2"]),
                tmp_path / arch, show_progress=False)
    out = Translator.from_dir(run, beam=2).translate(["Clipboard management", "", "port scanner"])
    assert len(out) == 3 and out[1] == ""
    # the coverage penalty reads a cross-attention this stack lacks: one line, not an IndexError
    with pytest.raises(S2SError, match="^decode.coverage_penalty: needs cross-attention; model.arch"):
        Translator.from_dir(run, beam=2, coverage_penalty=0.3).translate(["port scanner"])


def test_lm_arch_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="model.copy"):
        ModelConfig(arch="prefix_lm", copy=True)
    with pytest.raises(ConfigError, match="share_embeddings"):
        ModelConfig(arch="decoder_only", share_embeddings=False)
    for arch in ("prefix_lm", "decoder_only"):
        with pytest.raises(ConfigError, match="decode.coverage_penalty: needs cross-attention"):
            ExperimentConfig(model=ModelConfig(arch=arch), decode=DecodeConfig(coverage_penalty=0.2))
        with pytest.raises(ConfigError, match="train.coverage_weight: the coverage loss needs cross-attention"):
            ExperimentConfig(model=ModelConfig(arch=arch), train=TrainConfig(coverage_weight=1.0))
        with pytest.raises(ConfigError, match="--alignments: model.arch .* has no cross-attention"):
            check_arch_supports(ModelConfig(arch=arch), DecodeConfig(), alignments=True)
    check_arch_supports(ModelConfig(), DecodeConfig(coverage_penalty=0.2), alignments=True)


@pytest.mark.parametrize("arch", ["encoder_decoder", "prefix_lm", "decoder_only"])
def test_every_arch_shares_one_output_head(arch):
    """z_t = (s_U h_t) W_U: with model.scale_output the same weights give logits / sqrt(d_model)
    in every architecture (the stacks' states h are unchanged)."""
    src = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]])
    tgt_in = torch.tensor([[2, 11, 12], [2, 14, 15]])
    z = {}
    for scale in (False, True):
        torch.manual_seed(0)
        cfg = ModelConfig(arch=arch, d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=32, dropout=0.0,
                          scale_output=scale)
        with torch.no_grad():
            z[scale] = make_model(cfg, 40, 40).eval()(src, tgt_in)  # (B, T, V)
    torch.testing.assert_close(z[True], z[False] / 16 ** 0.5)


@pytest.mark.parametrize("arch", ["encoder_decoder", "prefix_lm", "decoder_only"])
def test_every_arch_offers_the_model_interface(arch):
    """encode gives one EncoderState type; start_decoding and decode_step then run alike."""
    from s2s.model import EncoderState

    torch.manual_seed(0)
    model = make_model(ModelConfig(arch=arch, d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=32,
                                   dropout=0.0), 40, 40).eval()
    src = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]])
    with torch.no_grad():
        enc = model.encode(src)
        assert isinstance(enc, EncoderState) and enc.src is src and enc.src_mask.shape == (2, 1, 1, 4)
        one_stack = arch != "encoder_decoder"
        assert (enc.h_enc is None) == one_stack and (enc.prefix is None) == (not one_stack)
        cache = model.start_decoding(enc)
        scores, weights = model.decode_step(torch.tensor([[2], [2]]), cache)
        assert scores.shape == (2, 40) and cache.step == 1
        torch.testing.assert_close(scores, model(src, torch.tensor([[2], [2]]))[:, 0])
