"""Hugging Face interop: s2s runs MarianMT, BART, mBART and T5 checkpoints number for number.

No hub access: each family is a small random model built from its config
class and saved to a temporary directory.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from s2s.config import DecodeConfig  # noqa: E402
from s2s.errors import S2SError  # noqa: E402
from s2s.hf import export_hf, import_hf, model_from_hf  # noqa: E402
from s2s.search import ModelDecoder, SpecialIds, search  # noqa: E402

V = 320  # byte-level BPE needs 256 byte symbols
TOL = 1e-4


def small(family: str):
    """A random small model of ``family`` (eval mode) with non-zero logits biases."""
    T = transformers
    dims = dict(vocab_size=V, d_model=24, encoder_layers=2, decoder_layers=2, encoder_attention_heads=3,
                decoder_attention_heads=3, encoder_ffn_dim=40, decoder_ffn_dim=40, max_position_embeddings=64)
    if family == "marian":  # OPUS-MT's layout: </s> = 0, <unk> = 1, <pad> = last, swish FFN, x sqrt(d)
        m = T.MarianMTModel(T.MarianConfig(**dims, pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1,
                                           activation_function="swish", scale_embedding=True))
    elif family == "bart":
        m = T.BartForConditionalGeneration(T.BartConfig(**dims))
    elif family == "mbart":
        m = T.MBartForConditionalGeneration(T.MBartConfig(**dims, decoder_start_token_id=2))
    elif family == "t5":  # v1.0: ReLU FFN, tied output with the d^-1/2 rescale
        m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=40, num_layers=2,
                                                    num_heads=3, feed_forward_proj="relu"))
    else:  # t5v11: gated-GELU, no rescale, d_kv * heads != d_model
        m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=24, d_kv=10, d_ff=40, num_layers=2,
                                                    num_decoder_layers=1, num_heads=3,
                                                    feed_forward_proj="gated-gelu", tie_word_embeddings=False))
    with torch.no_grad():
        if hasattr(m, "final_logits_bias"):
            m.final_logits_bias.normal_(std=0.5)
    return m.eval()


FAMILIES = ["marian", "bart", "mbart", "t5", "t5v11"]


def write_tokenizer(family: str, path, lines: list[str]) -> None:
    """The family's tokenizer files in ``path``, trained on ``lines``, every id < V."""
    import io

    import sentencepiece as spm

    def train(**ids) -> bytes:
        out = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=out, vocab_size=120,
                                       model_type="unigram", minloglevel=2, hard_vocab_limit=False, **ids)
        return out.getvalue()

    if family == "marian":  # pieces -> ids by vocab.json: </s> 0, <unk> 1, pieces, <pad> V - 1
        model = train()
        (path / "source.spm").write_bytes(model)
        (path / "target.spm").write_bytes(model)
        proc = spm.SentencePieceProcessor(model_proto=model)
        pieces = [proc.id_to_piece(i) for i in range(3, proc.get_piece_size())]
        vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}, "<pad>": V - 1}
        (path / "vocab.json").write_text(json.dumps(vocab))
        (path / "tokenizer_config.json").write_text(json.dumps({"source_lang": "en", "target_lang": "de"}))
    elif family.startswith("t5"):  # SentencePiece ids are the model's: pad 0, eos 1, unk 2
        (path / "spiece.model").write_bytes(train(pad_id=0, eos_id=1, unk_id=2, bos_id=-1))
    elif family == "mbart":  # fairseq's dictionary over SentencePiece's default ids
        (path / "sentencepiece.bpe.model").write_bytes(train())
    else:
        from tokenizers import ByteLevelBPETokenizer

        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(lines, vocab_size=V, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
        bpe.save_model(str(path))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory, corpus):
    torch.manual_seed(FAMILIES.index(request.param))
    hf = small(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    write_tokenizer(request.param, path, (corpus / "train.en").read_text().splitlines())
    model, sections = model_from_hf(path)
    return hf, model, sections, path


def inputs(hf, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pad, eos = hf.config.pad_token_id, hf.config.eos_token_id
    src = torch.randint(4, V - 2, (4, 9), generator=g)
    src[:, -1] = eos
    src[1, 6:] = pad  # a shorter sentence: </s> then padding
    src[1, 5] = eos
    return src, (src != pad).long()


def test_encoder_outputs_match(pair):
    hf, model, _, _ = pair
    src, mask = inputs(hf)
    with torch.no_grad():
        theirs = hf.get_encoder()(input_ids=src, attention_mask=mask).last_hidden_state
        mine = model.encode(src).h_enc
    assert (theirs - mine)[mask.bool()].abs().max() < TOL


def test_teacher_forced_logits_match(pair):
    hf, model, sections, _ = pair
    src, mask = inputs(hf)
    tgt = torch.randint(4, V - 2, (4, 6), generator=torch.Generator().manual_seed(1))
    start = sections["tokenizer"]["bos_id"]
    tgt_in = torch.cat([torch.full((4, 1), start), tgt[:, :-1]], dim=1)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
        mine = model(src, tgt_in)
    assert theirs.shape == mine.shape
    assert (theirs - mine).abs().max() < TOL


def s2s_generate(model, sections, src, beam: int, max_new: int) -> list[list[int]]:
    ids = sections["tokenizer"]
    settings = DecodeConfig(beam=beam, alpha=1.0, length_penalty="power")
    special = SpecialIds(bos_id=ids["bos_id"], eos_id=ids["eos_id"], pad_id=ids["pad_id"])
    with torch.no_grad():
        found = search(ModelDecoder(model, src), torch.full((src.size(0),), max_new), settings, special)
    return [hyps[0].tokens for hyps in found]


class EndAtMaxLength(transformers.LogitsProcessor):
    """</s> the only choice at the last position, at the model's own log p (s2s and fairseq).
    transformers' forced_eos_token_id gives it log p = 0 instead, which ranks beams differently."""

    def __init__(self, max_length: int, eos: int):
        self.max_length, self.eos = max_length, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] == self.max_length - 1:
            keep = scores[:, self.eos].clone()
            scores[:] = float("-inf")
            scores[:, self.eos] = keep
        return scores


def hf_generate(hf, src, mask, beam: int, max_new: int) -> list[list[int]]:
    cfg = hf.config
    start = getattr(cfg, "decoder_start_token_id", None)
    start = cfg.pad_token_id if start is None else start
    out = hf.generate(input_ids=src, attention_mask=mask, num_beams=beam, do_sample=False,
                      max_new_tokens=max_new, min_length=0, length_penalty=1.0, no_repeat_ngram_size=0,
                      decoder_start_token_id=start, forced_eos_token_id=None,
                      logits_processor=transformers.LogitsProcessorList([EndAtMaxLength(max_new + 1,
                                                                                        cfg.eos_token_id)]),
                      forced_bos_token_id=None, suppress_tokens=sorted({cfg.pad_token_id, start} - {cfg.eos_token_id}),
                      early_stopping=True, num_return_sequences=1)
    rows = []
    for row in out[:, 1:].tolist():  # drop the start symbol
        rows.append(row[:row.index(cfg.eos_token_id)] if cfg.eos_token_id in row else row)
    return rows


@pytest.mark.parametrize("beam", [1, 4])
def test_search_matches_generate(pair, beam):
    hf, model, sections, _ = pair
    src, mask = inputs(hf, seed=2)
    assert s2s_generate(model, sections, src, beam, 12) == hf_generate(hf, src, mask, beam, 12)


def test_export_round_trip(pair, tmp_path):
    """import -> s2s model directory -> export -> from_pretrained: the same logits."""
    hf, _, _, path = pair
    import_hf(path, tmp_path / "s2s")
    export_hf(tmp_path / "s2s", tmp_path / "hf")
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    src, mask = inputs(hf, seed=3)
    tgt_in = torch.randint(4, V - 2, (4, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
        b = again(input_ids=src, attention_mask=mask, decoder_input_ids=tgt_in).logits
    assert (a - b).abs().max() < TOL


def test_imported_model_translates_like_generate(pair, tmp_path, corpus):
    """The CLI path: import, then `s2s translate` gives what generate gives on the same ids."""
    from s2s.translate import Translator

    hf, _, sections, path = pair
    import_hf(path, tmp_path / "s2s")
    translator = Translator.from_dir(tmp_path / "s2s", beam=3, max_len_b=10, alpha=1.0, length_penalty="power")
    lines = (corpus / "dev.en").read_text().splitlines()[:3]
    src_ids = translator.encode_lines(lines, 1)
    hyps = translator.search_sorted(src_ids)
    pad = hf.config.pad_token_id
    src = torch.full((len(src_ids), max(map(len, src_ids))), pad)
    for i, ids in enumerate(src_ids):
        src[i, :len(ids)] = torch.tensor(ids)
    expected = hf_generate(hf, src, (src != pad).long(), 3, 10)
    assert [h[0].tokens for h in hyps] == expected


def test_tokenizer_ids_match_transformers(pair, tmp_path, corpus):
    """s2s's encoding of the imported tokenizer equals the family's own tokenizer class."""
    from s2s.modeldir import load_spec

    hf, _, _, path = pair
    family = hf.config.model_type
    if family == "mbart":
        pytest.skip("mBART: its language codes are tested in tests/test_hf_langs.py (MBartTokenizer adds them)")
    import_hf(path, tmp_path / "s2s")
    _, tok = load_spec(tmp_path / "s2s")
    theirs = transformers.AutoTokenizer.from_pretrained(path) if family != "marian" else \
        transformers.MarianTokenizer(str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json"))
    lines = (corpus / "dev.en").read_text().splitlines()[:20]
    assert tok.encode_src(lines) == [theirs(line)["input_ids"] for line in lines]


FINETUNE_YAML = """\
data: {{src_lang: en, tgt_lang: de, train: {d}/train, dev: {d}/dev, dir: {w}/prep,
        max_tokens_per_sentence: 60}}
train: {{init_from: {w}/imported, max_steps: 4, validate_every: 2, log_every: 1, dev_bleu_sentences: 4,
        warmup_steps: 2, max_tokens: 400, threads: 1, lr: 0.0001}}
decode: {{beam: 2, max_len_b: 8, max_len_a: 0}}
"""


@pytest.mark.parametrize("family", ["marian", "bart"])
def test_import_finetune_translate_export_through_the_cli(family, corpus, tmp_path, capsys, monkeypatch):
    """s2s import hf -> prepare -> train (init_from) -> translate -> export hf -> from_pretrained."""
    from tests.test_bad_inputs import cli_ok

    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    small(family).save_pretrained(hf_dir)
    write_tokenizer(family, hf_dir, (corpus / "train.en").read_text().splitlines())
    cli_ok(capsys, monkeypatch, "import", "hf", hf_dir, "-o", tmp_path / "imported")
    recipe = tmp_path / "ft.yaml"
    recipe.write_text(FINETUNE_YAML.format(d=corpus, w=tmp_path))
    cli_ok(capsys, monkeypatch, "prepare", recipe)
    cli_ok(capsys, monkeypatch, "train", recipe, "-o", tmp_path / "ft")
    before = load_weights(tmp_path / "imported")
    after = load_weights(tmp_path / "ft")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    monkeypatch.setattr("sys.stdin", open(corpus / "dev.en"))
    out, _ = cli_ok(capsys, monkeypatch, "translate", "-m", tmp_path / "ft")
    assert len(out.splitlines()) == len((corpus / "dev.en").read_text().splitlines())
    cli_ok(capsys, monkeypatch, "export", "hf", "-m", tmp_path / "ft", "-o", tmp_path / "ft-hf")
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ft-hf").eval()
    assert again.config.model_type == family


def test_import_and_export_replace_only_their_own_output(corpus, tmp_path, capsys, monkeypatch):
    """`import hf SRC -o SRC` is refused; a second import or export into the same -o needs
    --force, and then replaces it; one command never replaces the other's output."""
    from tests.test_bad_inputs import assert_error, cli, cli_ok

    torch.manual_seed(0)
    src = tmp_path / "hf"
    small("marian").save_pretrained(src)
    write_tokenizer("marian", src, (corpus / "train.en").read_text().splitlines())
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert_error(cli(capsys, monkeypatch, "import", "hf", src, "-o", src, "--force"),
                 f"{src}: is the input {src} of s2s import hf")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    imported, exported = tmp_path / "s2s", tmp_path / "back"
    for args, out in ((["import", "hf", src], imported), (["export", "hf", "-m", imported], exported)):
        command = " ".join(args[:2])
        cli_ok(capsys, monkeypatch, *args, "-o", out)
        assert json.loads((out / "s2s-output.json").read_text())["command"] == command
        assert_error(cli(capsys, monkeypatch, *args, "-o", out), f"{out}: holds an earlier output of s2s {command}")
        cli_ok(capsys, monkeypatch, *args, "-o", out, "--force")
    assert_error(cli(capsys, monkeypatch, "export", "hf", "-m", imported, "-o", imported, "--force"),
                 f"{imported}: is the input")
    assert_error(cli(capsys, monkeypatch, "import", "hf", src, "-o", exported, "--force"),
                 f"{exported}: is an output of s2s export hf, not of s2s import hf")
    assert transformers.AutoModelForSeq2SeqLM.from_pretrained(exported).config.model_type == "marian"


def load_weights(directory):
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


# --------------------------------------------------------------------------- #
# Bad checkpoints
# --------------------------------------------------------------------------- #

def test_unsupported_family_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(S2SError, match="model_type 'gpt2' is not supported"):
        model_from_hf(tmp_path)


def test_missing_weight_is_named(pair, tmp_path):
    hf, _, _, path = pair
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    victim = next(k for k in sorted(state) if "layers.1" in k or "block.1" in k)
    del state[victim]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(S2SError, match=victim.replace(".", r"\.")):
        model_from_hf(tmp_path)


def test_mismatched_shape_is_named(pair, tmp_path):
    hf, _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    cfg["d_model"] = 30  # the weights are 24 wide
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(S2SError, match="has shape"):
        model_from_hf(tmp_path)


def test_config_missing_a_key_is_named(pair, tmp_path):
    hf, _, _, path = pair
    cfg = json.loads((path / "config.json").read_text())
    del cfg["d_model"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(S2SError, match="no 'd_model' key"):
        model_from_hf(tmp_path)


def test_no_weights_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "marian", "vocab_size": 8}))
    with pytest.raises(S2SError, match="no model.safetensors or pytorch_model.bin"):
        model_from_hf(tmp_path)


def test_s2s_default_architecture_is_not_exportable(prepared, tmp_path):
    from s2s.config import load_config
    from s2s.hf import hf_family

    with pytest.raises(S2SError, match="matches no Hugging Face family; nearest is"):
        hf_family(load_config(prepared))


def test_cli_errors_are_one_line(tmp_path, capsys, monkeypatch, prepared):
    from tests.test_bad_inputs import assert_error, cli

    assert_error(cli(capsys, monkeypatch, "import", "hf", tmp_path / "nope", "-o", tmp_path / "x"), "nope")
    assert_error(cli(capsys, monkeypatch, "import", "hf", tmp_path, "-o", tmp_path / "x"), "config.json")
    (tmp_path / "config.json").write_text("{not json")
    assert_error(cli(capsys, monkeypatch, "import", "hf", tmp_path, "-o", tmp_path / "x"), "config.json", "JSON")
    assert not (tmp_path / "x").exists()


def test_bin_and_sharded_checkpoints_load_the_same(tmp_path):
    """pytorch_model.bin (read with weights_only, no code runs) and sharded safetensors."""
    torch.manual_seed(5)
    hf = small("marian")
    hf.save_pretrained(tmp_path / "one")
    reference, _ = model_from_hf(tmp_path / "one")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    for variant in ("bin", "sharded"):
        model, _ = model_from_hf(tmp_path / variant)
        for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), (variant, name)


def test_pickled_code_in_a_bin_file_is_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "marian", "vocab_size": 8}))
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"x": Evil()}, f)
    with pytest.raises(S2SError, match="cannot read as plain weights"):
        model_from_hf(tmp_path)


def test_t5_ids_past_the_sentencepiece_pieces_decode_like_transformers(pair, tmp_path, corpus):
    """An imported T5 whose vocabulary (V = 320) is larger than its SentencePiece model: ids past
    the pieces are transformers' <extra_id_N> sentinels (the last of them <extra_id_0>), ids past
    those decode to nothing, and translating never crashes on them."""
    from s2s.modeldir import load_spec
    from s2s.translate import Translator

    hf, _, _, path = pair
    if hf.config.model_type != "t5":
        pytest.skip("T5's sentinels")
    import_hf(path, tmp_path / "s2s")
    _, tok = load_spec(tmp_path / "s2s")
    n = tok.tgt.get_piece_size()
    assert n + tok.extra_ids <= V  # some ids are sentinels, some are past even those
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    assert theirs.convert_tokens_to_ids("<extra_id_0>") == n + tok.extra_ids - 1
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(3, V, (12,), generator=g).tolist()
        assert tok.decode_tgt(ids) == theirs.decode(ids), ids
    assert tok.decode_tgt([n + tok.extra_ids - 1, 10**9]) == "<extra_id_0>"
    translator = Translator.from_dir(tmp_path / "s2s", beam=2, max_len_b=20)
    model = translator.model
    out_rows = model.tgt_embed.weight if model.output_proj is None else model.output_proj.weight  # (V, d)
    with torch.no_grad():  # make the sentinels' output rows win: the random model then emits them
        out_rows[n:n + tok.extra_ids] *= 10
    lines = (corpus / "dev.en").read_text().splitlines()[:8]
    found = translator.search_sorted(translator.encode_lines(lines, 1))
    assert any(i >= n for hyps in found for i in hyps[0].tokens)  # the case that crashed
    texts = translator.translate(lines)
    assert len(texts) == len(lines) and any("<extra_id_" in t for t in texts)
