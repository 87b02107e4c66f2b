"""Languages: several pairs in one prepare (target-language tags), --tgt-lang at translate
time and in serve requests, and the language tokens of imported checkpoints kept whole."""

import json

import pytest

from s2s.config import config_from_dict, load_config, to_dict
from s2s.errors import ConfigError, S2SError
from s2s.langs import Languages, language_ids, target_tag, token_code
from tests.test_bad_inputs import assert_error, cli, cli_ok

PAIRS_YAML = """\
seed: 1
tokenizer: {{vocab_size: 300}}
data:
  dir: {w}/prep
  pairs:
    - {{src_lang: en, tgt_lang: de, train: {d}/train, dev: {d}/dev}}
    - {{src_lang: de, tgt_lang: en, train: {d}/train, dev: {d}/dev}}
model: {{d_model: 32, heads: 2, enc_layers: 1, dec_layers: 1, d_ff: 64}}
train: {{max_steps: 2, validate_every: 2, log_every: 1, dev_bleu_sentences: 4, warmup_steps: 2,
        max_tokens: 600, threads: 1}}
decode: {{beam: 2, max_len_a: 0, max_len_b: 4}}
"""


# --------------------------------------------------------------------------- #
# the config
def test_pairs_load_round_trip_and_name_their_errors():
    pairs = [{"src_lang": "en", "tgt_lang": "de", "train": "c/train"},
             {"src_lang": "en", "tgt_lang": "fr", "train": "c/train", "dev": "c/dev"}]
    cfg = config_from_dict({"data": {"pairs": pairs}}, "x.yaml")
    assert cfg.data.target_langs == ("de", "fr")
    assert cfg.data.split_corpora("dev") == [("c/dev", "en", "fr")]
    assert config_from_dict(to_dict(cfg)) == cfg  # lists round-trip through the YAML form
    assert cfg.data.split_corpora("train") == [("c/train", "en", "de"), ("c/train", "en", "fr")]
    with pytest.raises(ConfigError, match=r"x.yaml: data.pairs\[1\].tgt_lang: 'f r' is not a language code"):
        config_from_dict({"data": {"pairs": [pairs[0], {**pairs[1], "tgt_lang": "f r"}]}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"data.pairs\[0\].colour: unknown key"):
        config_from_dict({"data": {"pairs": [{**pairs[0], "colour": 1}]}})
    with pytest.raises(ConfigError, match="the pair en-de is listed twice"):
        config_from_dict({"data": {"pairs": [pairs[0], pairs[0]]}})
    with pytest.raises(ConfigError, match="either in data.pairs or in data.train"):
        config_from_dict({"data": {"pairs": pairs, "train": "c/train"}})
    with pytest.raises(ConfigError, match="data.pairs: several language pairs need one joint vocabulary"):
        config_from_dict({"data": {"pairs": pairs}, "tokenizer": {"joint": False},
                          "model": {"share_embeddings": False}})
    with pytest.raises(ConfigError, match="data.pairs: expected a list"):
        config_from_dict({"data": {"pairs": "en-de"}})


def test_tgt_lang_names_the_token_by_its_code():
    langs = Languages("m2m100", ("__de__", "de_DE", "zho_Hans", "zho_Hant", ">>fr<<"))
    assert [token_code(t) for t in langs.tokens] == ["de", "de_DE", "zho_Hans", "zho_Hant", "fr"]
    assert langs.resolve("de") == "__de__" and langs.resolve("de_DE") == "de_DE"
    assert langs.resolve("fr") == ">>fr<<" and langs.resolve(">>fr<<") == ">>fr<<"
    with pytest.raises(S2SError, match="'zho' is ambiguous: say which of zho_Hans, zho_Hant"):
        langs.resolve("zho")
    with pytest.raises(S2SError, match=r"--tgt-lang: 'xx' is not a target language of this model; it has: de \(__de"):
        langs.resolve("xx")
    ids = {"en_XX": 250004, "de_DE": 250003, "__en__": 128022, "__de__": 128021}.get
    mbart = language_ids(Languages("mbart", ("en_XX", "de_DE"), "en_XX"), ids, "de")
    assert (mbart.wrap([7, 2]), mbart.tgt_first) == ([7, 2, 250004], (250003,))  # x </s> en_XX; de_DE first
    m2m = language_ids(Languages("m2m100", ("__en__", "__de__"), "__en__"), ids, "de")
    assert (m2m.wrap([7, 2]), m2m.tgt_first) == ([128022, 7, 2], (128021,))  # __en__ x </s>; __de__ first
    tag = language_ids(Languages("target_tag", (target_tag("de"), target_tag("fr"))), {"<2de>": 5}.get, "de")
    assert (tag.wrap([7, 2]), tag.tgt_first) == ([5, 7, 2], ())


# --------------------------------------------------------------------------- #
# several pairs in one run: prepare, train, translate, info, serve requests
@pytest.fixture(scope="module")
def multi(corpus, tmp_path_factory):
    """en-de and de-en from the same files: the tokenizer, the prepared data and a 2-step model."""
    from s2s.config import load_training_config
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer
    from s2s.trainer import train

    w = tmp_path_factory.mktemp("multi")
    recipe = w / "multi.yaml"
    recipe.write_text(PAIRS_YAML.format(d=corpus, w=w))
    cfg = load_config(recipe)
    train_tokenizer(cfg.tokenizer, cfg.data, seed=cfg.seed)
    prepare(cfg, workers=1)
    train(load_training_config(recipe), w / "model")
    return recipe, w


def _run(capsys, monkeypatch, *args):
    return cli_ok(capsys, monkeypatch, *args)


def test_prepare_tags_each_source_with_its_target_language(multi, corpus, capsys, monkeypatch):
    from s2s.data import BinDataset
    from s2s.tokenizer import Tokenizer, resolve_tokenizer_config

    recipe, w = multi
    trained = json.loads((w / "prep" / "tokenizer.json").read_text())
    assert (trained["lang_scheme"], trained["lang_tokens"]) == ("target_tag", ["<2de>", "<2en>"])
    cfg = resolve_tokenizer_config(load_config(recipe))
    tok = Tokenizer.load(w / "prep", cfg.tokenizer, cfg.data)
    de, en = tok.src.piece_to_id("<2de>"), tok.src.piece_to_id("<2en>")
    assert tok.src.id_to_piece(de) == "<2de>" and tok.src.id_to_piece(en) == "<2en>"  # one piece each
    src_text = (w / "prep" / "train.src.txt").read_text().splitlines()
    n = len((corpus / "train.en").read_text().splitlines())
    tags = [line.split(" ", 1)[0] for line in src_text]
    k = tags.count("<2de>")  # the en-de pairs, then the de-en ones
    assert tags == ["<2de>"] * k + ["<2en>"] * (len(tags) - k) and min(k, len(tags) - k) > 0.9 * n
    data = BinDataset(w / "prep", "train")
    firsts = {int(data.pair(i)[0][0]) for i in range(len(data))}
    assert firsts == {de, en}  # every source starts with its target's tag, one id
    first_en = src_text[0].removeprefix("<2de> ")
    assert list(data.pair(0)[0]) == [de] + tok.encode_src([first_en])[0]
    assert tok.encode_src([f"<2de> {first_en}"]) == [[de] + tok.encode_src([first_en])[0]]  # typed: the same


def test_a_multilingual_model_translates_into_the_language_asked(multi, corpus, capsys, monkeypatch):
    from s2s.translate import Translator

    recipe, w = multi
    model = w / "model"
    meta = json.loads((model / "model.json").read_text())
    assert meta["languages"] == {"pairs": ["en-de", "de-en"], "scheme": "target_tag",
                                 "tokens": ["<2de>", "<2en>"], "src_token": ""}
    out, _ = _run(capsys, monkeypatch, "info", model)
    assert "en-de, de-en" in out and "de (<2de>), en (<2en>)" in out
    src = corpus / "dev.en"
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--workers", "1"),
                 "line 1: which target language?", "de (<2de>), en (<2en>)", "--tgt-lang")
    assert_error(cli(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "xx"),
                 "--tgt-lang", "'xx'", "de (<2de>), en (<2en>)")
    out, _ = _run(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--tgt-lang", "de", "--workers", "1")
    assert len(out.splitlines()) == len(src.read_text().splitlines())
    out_set, _ = _run(capsys, monkeypatch, "translate", "-m", model, "-i", src, "--set", "decode.tgt_lang=de",
                      "--workers", "1")
    assert out_set == out
    # --tgt-lang de puts <2de> first, exactly as typing it does
    lines = src.read_text().splitlines()[:5]
    chosen = Translator.from_dir(model, tgt_lang="de")
    typed = Translator.from_dir(model)
    de = chosen.tok.src.piece_to_id("<2de>")
    ids = chosen.encode_lines(lines, 1)
    assert all(x[0] == de for x in ids)
    assert ids == typed.encode_lines([f"<2de> {line}" for line in lines], 1)
    assert chosen.translate(lines) == typed.translate([f"<2de> {line}" for line in lines])
    en = chosen.tok.src.piece_to_id("<2en>")
    assert chosen.encode_lines([f"<2en> {lines[0]}"], 1)[0][:2] == [en, ids[0][1]]  # a typed tag wins
    with pytest.raises(S2SError, match="--tgt-lang"):
        Translator.from_dir(model, tgt_lang="fr")


def test_serve_requests_choose_their_target_language(multi, capsys, monkeypatch):
    from s2s.modeldir import load_spec
    from s2s.serve import RequestError, ServeLimits, parse_request

    recipe, w = multi
    cfg, tok = load_spec(w / "model")
    limits, langs = ServeLimits(), tok.languages

    def parse(body: dict):
        return parse_request(json.dumps(body).encode(), cfg.decode, limits, True, langs)

    assert parse({"texts": ["Hello"], "tgt_lang": "en"}).search.tgt_lang == "en"
    assert parse({"texts": ["<2de> Hello"]}).search.tgt_lang == ""  # the tag typed: no need to say
    for body, status, needle in (({"texts": ["Hello"]}, 422, "texts[0]: which target language?"),
                                 ({"texts": ["a"], "tgt_lang": "xx"}, 422, "tgt_lang: 'xx' is not a target"),
                                 ({"texts": ["a"], "tgt_lang": 3}, 422, "tgt_lang: expected a string")):
        with pytest.raises(RequestError, match=needle.replace("[", r"\[").replace("]", r"\]")) as e:
            parse(body)
        assert e.value.status == status


def test_tgt_lang_is_a_short_flag_of_translate_and_summarize():
    from s2s.cli import DECODE_FLAGS
    from s2s.serve import REQUEST_KEYS

    assert "tgt_lang" in DECODE_FLAGS and "tgt_lang" in REQUEST_KEYS


def test_a_model_without_languages_refuses_tgt_lang(prepared, tmp_path, capsys, monkeypatch):
    from s2s.translate import Translator

    cfg = load_config(prepared)
    model = tmp_path / "m"
    _run(capsys, monkeypatch, "train", prepared, "-o", model, "--set", "train.max_steps=1",
         "--set", "train.validate_every=1")
    assert "languages" not in json.loads((model / "model.json").read_text())
    with pytest.raises(S2SError, match="has no language tokens"):
        Translator.from_dir(model, tgt_lang="de")
    assert cfg.tokenizer.lang_scheme == "none"


def test_the_workers_tasks_count_the_language_token(multi):
    """The parent cuts a chunk into the batches a worker decodes, each source with the
    language token --tgt-lang puts before it (<2de>: one more piece)."""
    from s2s.modeldir import load_spec
    from s2s.workers import TranslatorSpec, sorted_batches, task_planner

    _, w = multi
    model = w / "model"
    lines = ["the package provides a tool"] * 64
    n = len(load_spec(model)[1].encode_src(lines[:1])[0])
    plan = task_planner(TranslatorSpec((str(model),), {"tgt_lang": "de", "batch_tokens": 4 * n}))
    assert plan(lines) == sorted_batches([n + 1] * 64, 8, 4 * n) and len(plan(lines)) == 22  # 3 a batch
    untold = task_planner(TranslatorSpec((str(model),), {"batch_tokens": 4 * n}))
    assert untold(lines) == sorted_batches([n] * 64, 8, 4 * n) and len(untold(lines)) == 16  # 4 a batch
