"""Typed config: unknown keys, wrong types and impossible values name the key and the file."""

import dataclasses

import pytest

from s2s.config import ExperimentConfig, load_config, parse_duration, to_yaml
from s2s.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_defaults_load_and_round_trip(tmp_path):
    cfg = load_config(write(tmp_path, "model: {d_model: 64, heads: 4}\n"))
    assert cfg.model.d_model == 64 and cfg.model.d_head == 16
    again = load_config(write(tmp_path, to_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("text, needle", [
    ("model: {d_modl: 64}\n", "model.d_modl: unknown key"),
    ("modle: {}\n", "modle: unknown key"),
    ("model: {d_model: big}\n", "model.d_model: expected an integer"),
    ("model: {d_model: 100, heads: 3}\n", "model.d_model: d_model=100 is not divisible by heads=3"),
    ("model: {norm: sandwich}\n", "model.norm: 'sandwich' is not one of pre, post"),
    ("train: {precision: fp16}\n", "train.precision"),
    ("train: {lr: -1}\n", "train.lr: must be > 0"),
    ("train: {max_time: soon}\n", "train.max_time"),
    ("model: {share_embeddings: true}\ntokenizer: {joint: false}\n", "model.share_embeddings"),
    ("decode: {beam: 2, nbest: 3}\n", "decode.nbest"),
    ("model: [1, 2]\n", "model: expected a mapping"),
    ("tokenizer: {joint: 1}\n", "tokenizer.joint: expected true or false"),
    ("train: {procs: 0}\n", "train.procs: must be >= 1 or auto"),
    ("train: {procs: many}\n", "train.procs: expected an integer or auto, got 'many'"),
    ("train: {procs: true}\n", "train.procs: expected an integer or auto, got True"),
    ("train: {procs: 1.5}\n", "train.procs: expected an integer or auto"),
])
def test_errors_name_file_and_key(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(str(p))
    assert needle in str(e.value)


def test_train_procs_is_a_count_or_auto(tmp_path):
    assert load_config(write(tmp_path, "{}\n")).train.procs == 1
    cfg = load_config(write(tmp_path, "train: {procs: auto}\n"))
    assert cfg.train.procs == "auto" and load_config(write(tmp_path, to_yaml(cfg))) == cfg
    assert load_config(write(tmp_path, "{}\n"), ["train.procs=4"]).train.procs == 4
    assert load_config(write(tmp_path, "{}\n"), ["train.procs=auto"]).train.procs == "auto"


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match="valid keys in model: arch, d_model, heads"):
        load_config(write(tmp_path, "model: {dmodel: 1}\n"))


def test_yaml_syntax_error_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"exp.yaml: line \d+: YAML does not parse"):
        load_config(write(tmp_path, "model:\n  d_model: 1\n bad: [\n"))


def test_missing_and_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_set_overrides_any_key(tmp_path):
    p = write(tmp_path, "model: {d_model: 64, heads: 4}\n")
    cfg = load_config(p, ["model.d_model=512", "train.max_time=15m", "decode.alpha=1", "seed=7"])
    assert cfg.model.d_model == 512
    assert cfg.train.max_seconds == 900
    assert cfg.decode.alpha == 1.0 and isinstance(cfg.decode.alpha, float)
    assert cfg.seed == 7
    with pytest.raises(ConfigError, match="model.dmodel: unknown key"):
        load_config(p, ["model.dmodel=3"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(p, ["model.d_model"])


def test_durations():
    assert parse_duration("") == float("inf")
    assert parse_duration("90") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("1.5h") == 5400


def test_frozen():
    cfg = ExperimentConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.d_model = 3


def test_exponent_without_dot_is_a_number(tmp_path):
    # PyYAML reads `1e-3` as a string (YAML 1.1); a float key must still take it
    cfg = load_config(write(tmp_path, "train: {lr: 1e-3, adam_eps: 1e-9}\n"))
    assert cfg.train.lr == 1e-3 and cfg.train.adam_eps == 1e-9


def test_quickstart_recipe_lists_every_key():
    """The README points to recipes/quickstart.yaml as the commented list of every key."""
    import dataclasses
    from pathlib import Path

    import yaml

    from s2s.config import ExperimentConfig

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml").read_text())
    cfg = ExperimentConfig()
    for section in ("tokenizer", "data", "model", "train", "decode", "pretrain"):
        keys = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        assert keys == set(raw[section]), section


def test_a_set_value_that_is_not_utf8_is_kept_as_text_and_checked(tmp_path):
    """Bytes that are not UTF-8 on the command line arrive as lone surrogates, which libyaml's
    loader cannot encode: the value stays text and the key's check names it."""
    from s2s.config import parse_override

    assert parse_override("decode.beam=\udcff") == ("decode.beam", "\udcff")
    assert parse_override("decode.beam=4") == ("decode.beam", 4)
    (tmp_path / "c.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="decode.beam"):
        load_config(tmp_path / "c.yaml", ["decode.beam=\udcff"])


def test_run_dir_of_a_checkpoint_and_of_a_model_directory(tmp_path):
    from s2s.modeldir import META, run_dir_of

    step = tmp_path / "run" / "checkpoints" / "step-00000010"
    assert run_dir_of(step) == tmp_path / "run"
    model = tmp_path / "checkpoints" / "my-model"  # a model directory in a folder named checkpoints
    model.mkdir(parents=True)
    (model / META).write_text("{}")
    assert run_dir_of(model) == model and run_dir_of(tmp_path / "run") == tmp_path / "run"
