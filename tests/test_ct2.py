"""`s2s export ct2` of imported Hugging Face families: CTranslate2's greedy output equals s2s's.

Each family is a small random model built by transformers from its config class (as in
tests/test_hf.py), read with `s2s import hf`, exported, and decoded by both engines on the
same token ids: MarianMT with a swish (SiLU) FFN and final-logits bias, BART with a
final-logits bias and embedding norms, T5 v1.0 (ReLU, tied output rescaled by d^-1/2) and
T5 v1.1 (gated GELU, untied, d_kv * heads != d_model), both with relative position bias
and RMSNorm.
"""

import json

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

from s2s.export import export_ct2  # noqa: E402
from s2s.hf import import_hf  # noqa: E402
from s2s.translate import Translator  # noqa: E402
from tests.test_hf import FAMILIES, small, write_tokenizer  # noqa: E402

MAX_LEN = 12  # s2s: at most 12 tokens with </s>; CTranslate2: at most 11 before it


def _vocabularies(out):
    """CTranslate2's source and target token lists, as the export saved them."""
    shared = out / "shared_vocabulary.json"
    if shared.is_file():
        v = json.loads(shared.read_text())
        return v, v
    return (json.loads((out / "source_vocabulary.json").read_text()),
            json.loads((out / "target_vocabulary.json").read_text()))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mbart"])
def test_ct2_greedy_equals_s2s_greedy(family, corpus, tmp_path):
    torch.manual_seed(FAMILIES.index(family))
    hf_dir = tmp_path / "hf"
    hf = small(family)
    hf.save_pretrained(hf_dir)
    write_tokenizer(family, hf_dir, (corpus / "train.en").read_text().splitlines())
    import_hf(hf_dir, tmp_path / "s2s")
    export_ct2(tmp_path / "s2s", tmp_path / "ct2")

    tr = Translator.from_dir(tmp_path / "s2s", beam=1, max_len_a=0.0, max_len_b=MAX_LEN)
    lines = (corpus / "dev.en").read_text().splitlines()[:6]
    src_ids = tr.encode_lines(lines, 1)
    ours = tr.search_sorted(src_ids)
    src_vocab, tgt_vocab = _vocabularies(tmp_path / "ct2")
    assert len(tgt_vocab) == hf.config.vocab_size and len(set(tgt_vocab)) == len(tgt_vocab)
    tok = tr.tok
    skip = 1 if tok.prefix_id >= 0 else 0  # CTranslate2 adds BART's <s> and every </s> itself
    pieces = [[src_vocab[i] for i in ids[skip:-1]] for ids in src_ids]
    blocked = [[tgt_vocab[tok.pad_id]]] + ([[tgt_vocab[tok.bos_id]]] if tok.bos_id != tok.eos_id else [])
    theirs = ctranslate2.Translator(str(tmp_path / "ct2")).translate_batch(
        pieces, beam_size=1, max_decoding_length=MAX_LEN - 1, suppress_sequences=blocked)
    got = [t.hypotheses[0] for t in theirs]
    want = [[tgt_vocab[i] for i in h[0].tokens] for h in ours]
    assert got == want
    assert sum(map(len, want)) > len(want)  # the outputs are not all empty: the comparison means something
