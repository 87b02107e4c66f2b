"""The vocabulary shortlist: the table builder, the subset logits, the search over a subset."""

import sys

import numpy as np
import pytest
import torch

from s2s.config import DecodeConfig, ModelConfig, load_config
from s2s.model import Seq2SeqTransformer, make_model
from s2s.shortlist import (
    FILE,
    Shortlist,
    build_shortlist,
    conditional_probability,
    dice,
    flatten_pairs,
    load_shortlist,
    save_shortlist,
)
from tests.conftest import untrained_model_dir

V = 12


def tiny_model(**kw) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=32, **kw)
    return make_model(cfg, V, V, pad_id=0).eval()


@pytest.mark.parametrize("kw", [{}, {"tie_output": False, "output_bias": True, "share_embeddings": False},
                                {"scale_output": True}, {"arch": "prefix_lm"}])
def test_subset_logits_equal_full_logits_at_the_ids(kw):
    """z'_t = z_t[ids]: in logits() and in a decoding step.  Equal to float32 rounding, not bit
    for bit: a BLAS may sum a product of 6 output columns in another order than one of 12
    (AVX2-only CPUs do)."""
    model = tiny_model(**kw)
    if model.output_bias is not None:
        torch.nn.init.normal_(model.output_bias)
    ids = torch.tensor([0, 2, 3, 5, 9, 11])
    h = torch.randn(3, 1, 16)
    sub = model.vocab_subset(ids)
    torch.testing.assert_close(model.logits(h, sub), model.logits(h)[..., ids], rtol=1e-6, atol=1e-6)

    src = torch.tensor([[4, 5, 6, 3], [7, 8, 3, 0]])
    y = torch.tensor([[2], [2]])
    full_cache = model.start_decoding(model.encode(src))
    sub_cache = model.start_decoding(model.encode(src))
    sub_cache.vocab_subset = sub
    for step in range(3):
        z_full, _ = model.decode_step(y, full_cache)
        z_sub, _ = model.decode_step(y, sub_cache)
        assert z_sub.shape == (2, len(ids))
        torch.testing.assert_close(z_sub, z_full[:, ids], rtol=1e-6, atol=1e-6, msg=f"step {step}")
        y = torch.tensor([[5], [9]])


def test_copy_model_refuses_a_subset():
    model = tiny_model(copy=True)
    cache = model.start_decoding(model.encode(torch.tensor([[4, 5, 3]])))
    cache.vocab_subset = model.vocab_subset(torch.tensor([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="copy model"):
        model.decode_step(torch.tensor([[2]]), cache)


def test_dice_and_conditional_probability_formulas():
    c_st, c_s, c_t = np.array([2.0]), np.array([3.0]), np.array([5.0])
    assert dice(c_st, c_s, c_t)[0] == 2 * 2 / (3 + 5)
    assert conditional_probability(c_st, c_s)[0] == 2 / 3


def test_builder_on_a_hand_made_corpus():
    """Source 5 ~ target 8, source 6 ~ target 9; target 7 is in every sentence (frequent)."""
    pairs = [(np.array([5, 5, 3]), np.array([8, 7, 3])),
             (np.array([5, 6, 3]), np.array([8, 9, 7, 3])),
             (np.array([6, 3]), np.array([9, 7, 3])),
             (np.array([4, 3]), np.array([7, 10, 3]))]
    sl = build_shortlist(*flatten_pairs(pairs), V, V, k=2, frequent=2, score="dice")
    # c(5)=2, c(6)=2, c(4)=1; c(8)=2, c(9)=2, c(7)=4, c(10)=1, c(3)=4
    # dice(5, 8) = 2*2/(2+2) = 1; dice(5, 3) = dice(5, 7) = 2*2/(2+4) = 2/3 (ties: the lower id); dice(5, 9) = 1/2
    assert sl.top[5].tolist() == [8, 3]
    assert sl.top[6].tolist() == [9, 3]
    assert sl.top[4].tolist() == [10, 3]  # dice(4, 10) = 1, dice(4, 3) = dice(4, 7) = 2/5: the lower id
    assert sl.top[0].tolist() == [-1, -1] and sl.top[11].tolist() == [-1, -1]  # never seen
    assert sl.frequent.tolist() == [3, 7]  # 4 tokens each; ties: the lower id first
    prob = build_shortlist(*flatten_pairs(pairs), V, V, k=3, frequent=0, score="prob")
    assert prob.top[5].tolist() == [3, 7, 8]  # p = 1, 1, 1: ties by id
    assert prob.top[4].tolist() == [3, 7, 10]
    assert prob.frequent.tolist() == []
    # a batch's subset: its sources' lists, the frequent pieces and the given ids, ascending
    assert sl.subset(torch.tensor([[5, 3], [4, 0]]), [0, 1, 2, 3]).tolist() == [0, 1, 2, 3, 7, 8, 10]


def test_builder_counts_across_chunks():
    """Counting in chunks gives the same table as counting at once."""
    from s2s.shortlist import cooccurrence

    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, V, 5), rng.integers(0, V, 4)) for _ in range(50)]
    whole = cooccurrence(*flatten_pairs(pairs), V, V, chunk=1000)
    chunked = cooccurrence(*flatten_pairs(pairs), V, V, chunk=7)
    for a, b in zip(whole, chunked):
        assert np.array_equal(a, b)
    # against counting pair by pair
    c_st = np.zeros((V, V), dtype=np.int64)
    for src, tgt in pairs:
        for s in set(src.tolist()):
            for t in set(tgt.tolist()):
                c_st[s, t] += 1
    s, t, c, c_s, c_t = whole
    assert np.array_equal(c, c_st[s, t]) and c_st.sum() == c.sum()
    assert c_s.tolist() == [sum(x in set(p[0].tolist()) for p in pairs) for x in range(V)]


def test_the_tables_move_to_another_device_once():
    sl = Shortlist(torch.tensor([[1, -1], [2, 3]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), {})
    top, frequent = sl.tables_on(torch.device("cpu"))
    assert top is sl.top and frequent is sl.frequent
    top, frequent = sl.tables_on(torch.device("meta"))  # a GPU's place in a batch's subset()
    assert top.device.type == frequent.device.type == "meta" and top.shape == (2, 2)
    again = sl.tables_on(torch.device("meta"))
    assert again[0] is top and again[1] is frequent


def test_save_and_load_round_trip(tmp_path):
    sl = Shortlist(torch.tensor([[1, -1], [2, 3]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                   {"k": 2, "frequent": 1, "score": "dice", "sentences": 1})
    save_shortlist(sl, tmp_path)
    back = load_shortlist(tmp_path, 2, 4)
    assert torch.equal(back.top, sl.top) and torch.equal(back.frequent, sl.frequent)
    assert back.settings == sl.settings
    assert not list(tmp_path.glob(".*tmp*"))
    from s2s.errors import S2SError

    with pytest.raises(S2SError, match="does not fit"):
        load_shortlist(tmp_path, 3, 4)


# --------------------------------------------------------------------------- #
# translating with a shortlist: a model directory from the tiny prepared corpus
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory):
    """An untrained model directory on the tiny prepared data (decoding only needs weights)."""
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("shortlist") / "model")


SOURCES = ["The program shows the time.", "A small library for reading files.", "", "Hello world"]


@pytest.mark.parametrize("beam", [1, 2])
def test_a_shortlist_of_every_id_translates_identically(model_dir, beam):
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir, beam=beam, nbest=beam)
    V_src, V_tgt = tr.model.src_embed.num_embeddings, tr.model.tgt_embed.num_embeddings
    full = list(tr.translate_lines(SOURCES))
    prefixed = list(tr.translate_lines(SOURCES, prefixes=["Das", "", "", "Hallo"]))
    tr.shortlist = Shortlist(torch.full((V_src, 1), -1, dtype=torch.int32),
                             torch.arange(V_tgt, dtype=torch.int32), {})
    tr.decode = DecodeConfig(**{**tr.decode.__dict__, "shortlist": True})
    for want, got in ((full, list(tr.translate_lines(SOURCES))),
                      (prefixed, list(tr.translate_lines(SOURCES, prefixes=["Das", "", "", "Hallo"])))):
        assert [t.texts for t in got] == [t.texts for t in want]
        assert [[(h.tokens, h.score) for h in t.hypotheses] for t in got] == \
               [[(h.tokens, h.score) for h in t.hypotheses] for t in want]


def test_a_small_shortlist_keeps_outputs_inside_it(model_dir):
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir, beam=2, shortlist=True)
    V_src = tr.model.src_embed.num_embeddings
    allowed = [5, 6, 7]
    tr.shortlist = Shortlist(torch.full((V_src, 1), -1, dtype=torch.int32),
                             torch.tensor(allowed, dtype=torch.int32), {})
    forced = tr.tok.encode_tgt(["Hallo"])[0][:-1]
    for t in tr.translate_lines(SOURCES, prefixes=["Hallo", "", "", ""]):
        for h in t.hypotheses:
            assert set(h.tokens) <= set(allowed) | {tr.tok.unk_id} | set(forced)
            if t.line_no == 1:
                assert h.tokens[:len(forced)] == forced


def test_shortlist_command_and_translate(model_dir, prepared, tmp_path, capsys, monkeypatch):
    from tests.test_bad_inputs import assert_error, cli, cli_ok

    src = tmp_path / "in.en"
    src.write_text("\n".join(SOURCES) + "\n", encoding="utf-8")
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model_dir, "--shortlist", "-i", src),
                 model_dir / FILE, f"s2s shortlist CONFIG -m {model_dir}")
    out, _ = cli_ok(capsys, monkeypatch, "shortlist", prepared, "-m", model_dir, "--k", "5", "--frequent", "20")
    assert out.strip() == str(model_dir / FILE)
    from s2s.data import BinDataset
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir)
    sl = load_shortlist(model_dir, tr.model.src_embed.num_embeddings, tr.model.tgt_embed.num_embeddings)
    assert sl.top.shape[1] == 5 and len(sl.frequent) == 20
    pairs = len(BinDataset(load_config(prepared).data.dir, "train"))
    assert sl.settings == {"k": 5, "frequent": 20, "score": "dice", "sentences": pairs}
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", model_dir, "--shortlist", "-i", src, "--beam", "2")
    assert len(out.splitlines()) == len(SOURCES)
    assert_error(cli(capsys, monkeypatch, "shortlist", prepared, "-m", model_dir, "--k", "0"), "--k")


def test_copy_model_refuses_shortlist(model_dir):
    from s2s.errors import S2SError
    from s2s.translate import Translator

    tr = Translator.from_dir(model_dir, shortlist=True)
    tr.model.cfg = ModelConfig(**{**tr.model.cfg.__dict__, "copy": True})
    with pytest.raises(S2SError, match="copy model"):
        tr.translate(["Hello"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
