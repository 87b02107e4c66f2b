"""prefix_lm and decoder_only: the mask of docs/model.md (8), the cache against teacher forcing, the pipeline."""

import pytest
import torch

from s2s.config import ModelConfig, load_config
from s2s.model import DecoderOnlyLM, make_model
from s2s.model.lm import lm_mask, prefix_lm_mask
from s2s.search import ModelDecoder, SearchSettings, search

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
        caches, src_mask = model.encode(src)
        cache = model.start_decoding(caches, src_mask, src)
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
            ca, _ = model.encode(a)
            cb, _ = model.encode(b)
        assert len(model.layers) == 2
        k_first = (ca[1].self_k[:, :, 0], cb[1].self_k[:, :, 0])
        assert (not torch.allclose(*k_first)) == differs


@pytest.mark.parametrize("arch", ["prefix_lm", "decoder_only"])
def test_beam_search_runs_on_the_cache(arch):
    model = tiny(arch)
    src = torch.tensor([[5, 6, 7, 3], [9, 3, 0, 0]])
    with torch.no_grad():
        found = search(ModelDecoder(model, src), torch.tensor([6, 6]), SearchSettings(beam=3))
        one = search(ModelDecoder(model, src[1:, :2]), torch.tensor([6]), SearchSettings(beam=3))
    assert found[1][0].tokens == one[0][0].tokens


@pytest.mark.parametrize("arch", ["prefix_lm", "decoder_only"])
def test_train_translate_score_through_the_same_commands(prepared, tmp_path, arch):
    from s2s.trainer import train
    from s2s.translate import Translator

    run = train(load_config(prepared, [f"model.arch={arch}", "train.max_steps=2", "train.validate_every=2"]),
                tmp_path / arch, show_progress=False)
    out = Translator.from_dir(run, beam=2).translate(["Clipboard management", "", "port scanner"])
    assert len(out) == 3 and out[1] == ""


def test_lm_arch_refuses_what_it_cannot_do():
    from s2s.errors import ConfigError

    with pytest.raises(ConfigError, match="model.copy"):
        ModelConfig(arch="prefix_lm", copy=True)
    with pytest.raises(ConfigError, match="share_embeddings"):
        ModelConfig(arch="decoder_only", share_embeddings=False)
