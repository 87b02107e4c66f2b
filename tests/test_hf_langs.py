"""Imported checkpoints keep their languages: Marian's >>xx<< tokens, mBART's language codes,
and M2M100 (and NLLB's tokenizer), each reachable with --tgt-lang and kept whole when typed.

As in tests/test_hf.py, every model is small, random and built offline from transformers'
own config classes; outputs are compared with transformers' greedy generate."""

import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from s2s.errors import S2SError  # noqa: E402
from s2s.hf import import_hf, model_from_hf  # noqa: E402
from s2s.modeldir import load_spec  # noqa: E402
from s2s.translate import Translator  # noqa: E402
from tests.test_bad_inputs import assert_error, cli, cli_ok  # noqa: E402
from tests.test_hf import TOL, EndAtMaxLength, V, small, write_tokenizer  # noqa: E402


def lines_of(corpus, n=4):
    return (corpus / "dev.en").read_text().splitlines()[:n]


def hf_greedy(hf, src_ids: list[list[int]], forced: int, max_new: int) -> list[list[int]]:
    """transformers' greedy generate from the decoder start, the first token forced to ``forced``
    (forced_bos_token_id), </s> the only choice at the last position; the start symbol dropped."""
    cfg = hf.config
    pad = cfg.pad_token_id
    src = torch.full((len(src_ids), max(map(len, src_ids))), pad)
    for i, ids in enumerate(src_ids):
        src[i, :len(ids)] = torch.tensor(ids)
    out = hf.generate(input_ids=src, attention_mask=(src != pad).long(), num_beams=1, do_sample=False,
                      max_new_tokens=max_new, min_length=0, decoder_start_token_id=cfg.decoder_start_token_id,
                      forced_bos_token_id=forced, forced_eos_token_id=None, no_repeat_ngram_size=0,
                      suppress_tokens=[pad],
                      logits_processor=transformers.LogitsProcessorList([EndAtMaxLength(max_new + 1,
                                                                                        cfg.eos_token_id)]))
    rows = []
    for row in out[:, 1:].tolist():
        rows.append(row[:row.index(cfg.eos_token_id)] if cfg.eos_token_id in row else row)
    return rows


# --------------------------------------------------------------------------- #
# Marian: >>de<< at the start of the source
@pytest.fixture(scope="module")
def marian(corpus, tmp_path_factory):
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("marian-multi")
    hf = small("marian")
    hf.save_pretrained(path)
    write_tokenizer("marian", path, (corpus / "train.en").read_text().splitlines())
    vocab = json.loads((path / "vocab.json").read_text())
    vocab.update({">>de<<": V - 3, ">>fr<<": V - 2})  # two target languages, ids no piece uses
    (path / "vocab.json").write_text(json.dumps(vocab))
    import_hf(path, path.parent / "marian-multi-s2s")
    return hf, path, path.parent / "marian-multi-s2s"


def test_marian_language_tokens_stay_whole_as_transformers_keeps_them(marian, corpus):
    hf, path, model = marian
    cfg, tok = load_spec(model)
    assert (cfg.tokenizer.lang_scheme, cfg.tokenizer.lang_tokens) == ("target_tag", (">>de<<", ">>fr<<"))
    theirs = transformers.MarianTokenizer(str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json"))
    typed = [f">>de<< {line}" for line in lines_of(corpus)] + [f">>fr<<{line}" for line in lines_of(corpus)]
    ours = tok.encode_src(typed)
    assert ours == [theirs(line)["input_ids"] for line in typed]
    assert all(ids[0] == V - 3 for ids in ours[:4]) and all(ids[0] == V - 2 for ids in ours[4:])


def test_marian_tgt_lang_puts_the_models_token_first(marian, corpus, capsys, monkeypatch):
    hf, path, model = marian
    lines = lines_of(corpus)
    chosen = Translator.from_dir(model, tgt_lang="fr", beam=1, max_len_a=0.0, max_len_b=8)
    typed = Translator.from_dir(model, beam=1, max_len_a=0.0, max_len_b=8)
    assert chosen.encode_lines(lines, 1) == typed.encode_lines([f">>fr<< {x}" for x in lines], 1)
    assert Translator.from_dir(model, tgt_lang=">>fr<<").encode_lines(lines, 1) == chosen.encode_lines(lines, 1)
    assert chosen.translate(lines) == typed.translate([f">>fr<< {x}" for x in lines])
    src = path.parent / "marian-in.txt"
    src.write_text("\n".join(lines) + "\n")
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "de", "--beam", "1")
    assert len(out.splitlines()) == len(lines)
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src),
                 "line 1: which target language?", "de (>>de<<), fr (>>fr<<)")
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "es"),
                 "--tgt-lang: 'es' is not a target language of this model", "de (>>de<<), fr (>>fr<<)")
    out, _ = cli_ok(capsys, monkeypatch, "info", model)
    assert "de (>>de<<), fr (>>fr<<)" in out


# --------------------------------------------------------------------------- #
# mBART: x </s> en_XX, the output starting with the target's code
def test_mbart_codes_go_where_mbart_puts_them(corpus, tmp_path, capsys, monkeypatch):
    torch.manual_seed(12)
    path = tmp_path / "hf"
    hf = small("mbart")
    hf.save_pretrained(path)
    write_tokenizer("mbart", path, (corpus / "train.en").read_text().splitlines())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MBartTokenizer", "src_lang": "en_XX", "tgt_lang": "de_DE",
        "additional_special_tokens": ["de_DE", "en_XX", "fr_XX"]}))
    import_hf(path, tmp_path / "s2s")
    cfg, tok = load_spec(tmp_path / "s2s")
    assert (cfg.tokenizer.lang_scheme, cfg.tokenizer.src_lang_token, cfg.decode.tgt_lang) == \
        ("mbart", "en_XX", "de_DE")
    de, en, fr = (tok.vocab[c] for c in ("de_DE", "en_XX", "fr_XX"))
    assert (de, en, fr) == (max(tok.vocab.values()) - 3, de + 1, de + 2)  # after the pieces, before <mask>
    lines = lines_of(corpus)
    translator = Translator.from_dir(tmp_path / "s2s", tgt_lang="fr", beam=1, max_len_a=0.0, max_len_b=10)
    src_ids = translator.encode_lines(lines, 1)
    plain = tok.encode_src(lines)
    assert src_ids == [x + [en] for x in plain] and all(x[-2] == tok.eos_id for x in src_ids)
    found = [h[0].tokens for h in translator.search_sorted(src_ids, [[fr]] * len(src_ids))]
    assert all(t[0] == fr for t in found)
    with torch.no_grad():
        assert found == hf_greedy(hf, src_ids, fr, 10)
    texts = translator.translate(lines)
    assert texts == [tok.decode_tgt(t) for t in found] and not any("fr_XX" in t for t in texts)
    # the model's own default (tokenizer_config.json's tgt_lang) and a typed code
    default = Translator.from_dir(tmp_path / "s2s", beam=1, max_len_a=0.0, max_len_b=10)
    assert default.lang.tgt_first == (de,)
    assert tok.encode_src([f"{lines[0]} fr_XX"])[0][-2:] == [fr, tok.eos_id]  # typed: one id, not pieces
    with pytest.raises(S2SError, match="--tgt-lang: 'es' is not a target language"):
        Translator.from_dir(tmp_path / "s2s", tgt_lang="es")


# --------------------------------------------------------------------------- #
# M2M100: __en__ x </s>, the output starting with __de__
def m2m100_pair(path, lines, seed: int = 13):
    """A small random M2M100 and its tokenizer (vocab.json + sentencepiece.bpe.model, saved by
    transformers' M2M100Tokenizer); returns the model and the tokenizer."""
    import sentencepiece as spm

    T = transformers
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=120,
                                   model_type="unigram", minloglevel=2, hard_vocab_limit=False)
    path.mkdir(parents=True, exist_ok=True)
    (path / "sentencepiece.bpe.model").write_bytes(out.getvalue())
    proc = spm.SentencePieceProcessor(model_proto=out.getvalue())
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3,
             **{proc.id_to_piece(i): i + 1 for i in range(3, proc.get_piece_size())}}
    (path / "vocab.json").write_text(json.dumps(vocab))
    tok = T.M2M100Tokenizer(str(path / "vocab.json"), str(path / "sentencepiece.bpe.model"),
                            src_lang="en", tgt_lang="de")
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    hf = T.M2M100ForConditionalGeneration(T.M2M100Config(
        vocab_size=256, d_model=24, encoder_layers=2, decoder_layers=2, encoder_attention_heads=3,
        decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64,
        scale_embedding=True, activation_function="relu", pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2)).eval()
    hf.save_pretrained(path)
    return hf, tok


@pytest.fixture(scope="module")
def m2m100(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("m2m100") / "hf"
    hf, theirs = m2m100_pair(path, (corpus / "train.en").read_text().splitlines())
    import_hf(path, path.parent / "s2s")
    return hf, theirs, path, path.parent / "s2s"


def test_m2m100_numbers_match_transformers(m2m100):
    hf, _, path, _ = m2m100
    model, sections = model_from_hf(path)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 120, (3, 9), generator=g)
    src[:, -1] = 2
    src[1, 5], src[1, 6:] = 2, 1  # a shorter sentence: </s>, then padding
    mask = (src != 1).long()
    tgt_in = torch.cat([torch.full((3, 1), 2), torch.randint(4, 120, (3, 6), generator=g)], dim=1)
    with torch.no_grad():
        theirs = hf.get_encoder()(input_ids=src, attention_mask=mask).last_hidden_state
        assert (theirs - model.encode(src).h_enc)[mask.bool()].abs().max() < TOL
        logits = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
        assert (logits - model(src, tgt_in)).abs().max() < TOL
    m = sections["model"]
    assert (m["norm"], m["positions"], m["position_offset"], m["output_bias"], m["embed_norm"]) == \
        ("pre", "learned", 2, False, False)


def test_m2m100_translates_like_generate_into_the_language_asked(m2m100, corpus, capsys, monkeypatch):
    hf, theirs, path, model = m2m100
    cfg, tok = load_spec(model)
    assert (cfg.tokenizer.lang_scheme, cfg.tokenizer.src_lang_token, cfg.decode.tgt_lang) == \
        ("m2m100", "__en__", "__de__")
    assert len(cfg.tokenizer.lang_tokens) == 100 and cfg.tokenizer.lang_tokens[0] == "__af__"
    lines = lines_of(corpus)
    translator = Translator.from_dir(model, tgt_lang="fr", beam=1, max_len_a=0.0, max_len_b=10)
    src_ids = translator.encode_lines(lines, 1)
    theirs.src_lang = "en"
    assert src_ids == [theirs(line)["input_ids"] for line in lines]  # __en__ x </s>
    fr = theirs.get_lang_id("fr")
    found = translator.search_sorted(src_ids, [[fr]] * len(lines))
    with torch.no_grad():
        assert [h[0].tokens for h in found] == hf_greedy(hf, src_ids, fr, 10)
    # typed language tokens are one id each (transformers 4 made them added tokens; 5 cuts them up)
    typed = ["__fr__ " + lines[0], lines[1] + " __de__"]
    plain = tok.encode_src(lines[:2])
    assert tok.encode_src(typed) == [[fr] + plain[0], plain[1][:-1] + [theirs.get_lang_id("de"), 2]]
    src = path.parent / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "fr", "--beam", "1",
                    "--max-len-a", "0", "--max-len-b", "10")
    assert out.splitlines() == translator.translate(lines)
    assert not any("__fr__" in x for x in out.splitlines())
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "xx"),
                 "--tgt-lang: 'xx' is not a target language of this model", "de (__de__)")
    out, _ = cli_ok(capsys, monkeypatch, "info", model)
    assert "m2m100" in out and "__en__" in out


def test_m2m100_language_list_is_transformers_own():
    """transformers 5 saves an M2M100Tokenizer without its language tokens: they are its list."""
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    from s2s.hf import M2M100_LANGUAGES

    assert {k: list(v) for k, v in M2M100_LANGUAGES.items()} == FAIRSEQ_LANGUAGE_CODES


def test_nllb_tokenizer_codes_follow_the_fairseq_dictionary(m2m100, tmp_path):
    """NLLB-200 (dense) is an M2M100 whose tokenizer is mBART's dictionary with codes like
    eng_Latn; transformers 5 records their ids in added_tokens_decoder, which the import keeps."""
    hf, _, path, _ = m2m100
    nllb = tmp_path / "nllb"
    nllb.mkdir()
    for name in ("config.json", "model.safetensors", "sentencepiece.bpe.model"):
        (nllb / name).write_bytes((path / name).read_bytes())
    (nllb / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "NllbTokenizer", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn",
        "extra_special_tokens": ["deu_Latn", "eng_Latn", "fra_Latn", "zho_Hans", "zho_Hant"],
        "added_tokens_decoder": {"200": {"content": "deu_Latn"}, "201": {"content": "eng_Latn"},
                                 "202": {"content": "fra_Latn"}, "203": {"content": "zho_Hans"},
                                 "204": {"content": "zho_Hant"}}}))
    import_hf(nllb, tmp_path / "s2s")
    cfg, tok = load_spec(tmp_path / "s2s")
    assert (cfg.tokenizer.lang_scheme, cfg.tokenizer.src_lang_token, cfg.decode.tgt_lang) == \
        ("m2m100", "eng_Latn", "fra_Latn")
    assert [tok.vocab[c] for c in cfg.tokenizer.lang_tokens] == [200, 201, 202, 203, 204]
    t = Translator.from_dir(tmp_path / "s2s", tgt_lang="deu")
    assert (t.lang.src_before, t.lang.tgt_first) == ((201,), (200,))
    with pytest.raises(S2SError, match="'zho' is ambiguous: say which of zho_Hans, zho_Hant"):
        Translator.from_dir(tmp_path / "s2s", tgt_lang="zho")
