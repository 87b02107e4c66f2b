"""The translate/summarize settings: short flags checked against DecodeConfig, decode
settings resolved in one library function, every bad setting refused by the Python API
as by the CLI, and summarize keeping the decode keys a model's training chose."""

import dataclasses
import json
import typing

import pytest
import typer

from s2s.cli import DECODE_FLAGS, SUMMARIZE_DEFAULTS, app
from s2s.config import DecodeConfig, chosen_decode_keys, decode_overrides, load_training_config
from s2s.errors import S2SError
from s2s.modeldir import decode_settings, explicit_decode_keys
from s2s.translate import Translator

FIELDS = {f.name for f in dataclasses.fields(DecodeConfig)}


@pytest.mark.parametrize("command", ["translate", "summarize"])
def test_each_decode_flag_names_a_decode_config_field_of_its_type(command):
    cmd = typer.main.get_command(app).commands[command]
    hints = typing.get_type_hints(cmd.callback, include_extras=True)
    types = typing.get_type_hints(DecodeConfig)
    params = {p.name: p for p in cmd.params}
    assert set(DECODE_FLAGS) <= FIELDS
    for key in DECODE_FLAGS:
        base = typing.get_args(hints[key])[0]  # Annotated[Optional[T], ...] -> Optional[T]
        assert typing.get_args(base) == (types[key], type(None)), key
        assert f"(default: the model's decode.{key})" in params[key].help
    # every other option that shares a DecodeConfig name is an on-switch (--sampling, --compile, --shortlist,
    # --split-sentences, --markup) or --glossary FILE
    switches = {"sampling", "compile", "shortlist", "split_sentences", "markup"}
    assert {name for name in params if name in FIELDS} - set(DECODE_FLAGS) == switches | {"glossary"}
    for name in switches:
        assert types[name] is bool and f"decode.{name}" in params[name].help
    assert types["glossary"] is str and "decode.glossary" in params["glossary"].help


def test_set_takes_decode_keys_only():
    assert decode_overrides(["decode.no_repeat_ngram=3", "decode.stop=early"], "translate") == \
        {"no_repeat_ngram": 3, "stop": "early"}
    with pytest.raises(S2SError, match=r"--set model.heads=2: s2s translate takes decode\.\* keys only"):
        decode_overrides(["model.heads=2"], "translate")


def test_decode_settings_fill_only_keys_the_model_did_not_choose():
    model = DecodeConfig(alpha=0.6, beam=4)  # alpha is DecodeConfig's default too
    # without a record (old model directories): a key at DecodeConfig's default is untouched
    old = decode_settings(model, {}, SUMMARIZE_DEFAULTS)
    assert (old.alpha, old.min_len, old.no_repeat_ngram, old.beam) == (1.0, 3, 3, 4)
    # with the record: alpha 0.6 was chosen on purpose and stays
    kept = decode_settings(model, {}, SUMMARIZE_DEFAULTS, frozenset({"alpha", "beam"}))
    assert (kept.alpha, kept.min_len, kept.no_repeat_ngram) == (0.6, 3, 3)
    # overrides win over both
    assert decode_settings(model, {"alpha": 0.2}, SUMMARIZE_DEFAULTS, frozenset({"alpha"})).alpha == 0.2


def test_sampling_means_one_beam_unless_told_otherwise():
    s = decode_settings(DecodeConfig(beam=5, nbest=2, coverage_penalty=0.2), {"sampling": True})
    assert (s.sampling, s.beam, s.nbest, s.coverage_penalty) == (True, 1, 1, 0.0)
    assert decode_settings(DecodeConfig(beam=5), {"sampling": True, "nbest": 4}).nbest == 4


def test_training_records_the_decode_keys_it_chose(tmp_path):
    (tmp_path / "x.yaml").write_text("decode: {alpha: 0.6, beam: 4}\n")
    assert chosen_decode_keys(tmp_path / "x.yaml", ["decode.min_len=2", "train.lr=0.1"]) == \
        {"alpha", "beam", "min_len"}
    cfg = load_training_config(tmp_path / "x.yaml", ["decode.min_len=2"])
    assert cfg.decode_keys == {"alpha", "beam", "min_len"} and cfg.decode.min_len == 2
    (tmp_path / "model.json").write_text(json.dumps({"decode_keys": ["alpha"]}))
    assert explicit_decode_keys(tmp_path) == {"alpha"}
    (tmp_path / "model.json").write_text(json.dumps({"step": 3}))
    assert explicit_decode_keys(tmp_path) is None  # older model directories: no record


@pytest.mark.parametrize("kwargs, message", [
    (dict(threads=-1), "--threads: -1 is negative"),
    (dict(device="gpu"), "--device: 'gpu' is not one of"),
    (dict(precision="fp16"), "--precision: 'fp16' is not fp32, bf16 or auto"),
    (dict(quantize="int4"), "--quantize: 'int4' is not int8"),
    (dict(weights=[1.0, 2.0]), "ensemble weights: 2 weights for 1 models"),
    (dict(weights=[0.0]), "ensemble weights must be positive numbers"),
])
def test_the_api_refuses_before_loading_anything(tmp_path, kwargs, message):
    with pytest.raises(S2SError, match=message):
        Translator.from_dirs([tmp_path / "no-model"], **kwargs)


def test_a_model_directory_loads_without_drawing_parameters_it_then_overwrites(prepared, tmp_path, monkeypatch):
    """load_model_dir builds the model with torch.nn.init's initialisers skipped (every parameter
    is loaded right after): the loaded weights are the file's, bit for bit; the initialisers are
    torch's own again after it, an error inside included; and a file missing a parameter is
    refused, so no undrawn one is ever used."""
    import torch
    from safetensors.torch import load_file, save_file

    from s2s.modeldir import WEIGHTS, load_model_dir, skipped_init
    from s2s.textio import file_sha256
    from tests.conftest import untrained_model_dir

    model_dir = untrained_model_dir(prepared, tmp_path / "m")
    drawn = []

    def recorded(real):
        def recording(t, *a, **k):
            drawn.append(t.shape)
            return real(t, *a, **k)
        return recording

    for name in ("xavier_uniform_", "normal_", "kaiming_uniform_"):  # the matrices', embeddings', nn.Linear's
        monkeypatch.setattr(torch.nn.init, name, recorded(getattr(torch.nn.init, name)))
    recording = torch.nn.init.xavier_uniform_
    loaded = load_model_dir(model_dir).model
    assert drawn == []  # nothing drawn while building
    assert torch.nn.init.xavier_uniform_ is recording  # and put back
    saved = load_file(str(model_dir / WEIGHTS))
    state = loaded.state_dict()
    assert saved and all(torch.equal(state[name], t) for name, t in saved.items())
    with pytest.raises(RuntimeError, match="inside"):
        with skipped_init():
            raise RuntimeError("inside")
    assert torch.nn.init.xavier_uniform_ is recording
    import threading

    with skipped_init():  # another thread building meanwhile draws as always
        other = []
        thread = threading.Thread(target=lambda: other.append(torch.nn.Linear(4, 4).weight.detach().clone()))
        thread.start()
        thread.join()
        here = torch.nn.Linear(4, 4)
        torch.nn.init.normal_(here.weight)  # skipped here: whatever torch.empty held
    assert drawn == [torch.Size([4, 4])]  # the other thread's nn.Linear, drawn through kaiming_uniform_
    assert other[0].abs().max() <= 0.5 and other[0].std() > 0  # U(-1/2, 1/2)
    assert torch.nn.init.xavier_uniform_ is recording
    del saved[next(iter(saved))]
    save_file(saved, str(model_dir / WEIGHTS))
    meta = json.loads((model_dir / "model.json").read_text())
    meta["sha256"] = file_sha256(model_dir / WEIGHTS)  # a consistent directory, one tensor short
    (model_dir / "model.json").write_text(json.dumps(meta))
    with pytest.raises(S2SError, match="missing"):
        load_model_dir(model_dir)
