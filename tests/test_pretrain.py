"""s2s pretrain: denoising on the fly, exact resume, fine-tuning from the pretrained run."""

import pytest
import torch
from safetensors.torch import load_file

from s2s.config import load_config
from s2s.data import BinDataset
from s2s.errors import S2SError
from s2s.modeldir import load_spec
from s2s.noise import fill_spans
from s2s.pretrain import Denoiser, DenoisingDataset, pretrain
from s2s.trainer import train
from tests.conftest import TINY_YAML


@pytest.fixture(scope="module")
def with_sentinels(corpus, tmp_path_factory):
    """The tiny config with 20 sentinels in its tokenizer, tokenizer trained and data prepared."""
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("pre")
    path = d / "pre.yaml"
    path.write_text(TINY_YAML.format(d=corpus).replace("{vocab_size: 300}", "{vocab_size: 300, sentinels: 20}")
                    .replace(f"dir: {corpus}/prep", f"dir: {d}/prep"))
    cfg = load_config(path)
    train_tokenizer(cfg.tokenizer, cfg.data, seed=cfg.seed)
    prepare(cfg)
    return path


def _weights(run):
    return load_file(run / "checkpoints" / sorted(p.name for p in (run / "checkpoints").iterdir())[-1]
                     / "model.safetensors")


def test_span_corruption_batches_reconstruct_the_documents(with_sentinels):
    cfg = load_config(with_sentinels)
    _, tok = load_spec_from_data(cfg)
    data = BinDataset(cfg.data.dir, "train")
    ds = DenoisingDataset(data, Denoiser(cfg.pretrain, tok), cfg.seed, 0, tok.eos_id)
    sentinels = tok.sentinel_ids()
    assert len(sentinels) == 20
    b = ds.batch([0, 1, len(data) + 5])
    for row, i in enumerate([0, 1, len(data) + 5]):
        src = [t for t in b.src[row].tolist() if t != tok.pad_id][:-1]
        tgt = [t for t in b.tgt_out[row].tolist() if t != tok.pad_id][:-1]
        assert fill_spans(src, tgt, sentinels) == ds.document(i)
    again = ds.batch([0, 1, len(data) + 5])
    assert torch.equal(b.src, again.src)  # same (seed, epoch, document): same noise
    assert torch.equal(ds.batch([0, 1, len(data) + 5], epoch=0).src, b.src)
    assert not torch.equal(ds.batch([0, 1, len(data) + 5], epoch=1).src, b.src)


def load_spec_from_data(cfg):
    from s2s.tokenizer import Tokenizer

    return cfg, Tokenizer.load(cfg.data.dir, cfg.tokenizer, cfg.data)


@pytest.mark.parametrize("objective", ["span_corruption", "bart"])
def test_pretrain_resume_is_exact_and_finetuning_starts_from_it(with_sentinels, tmp_path, objective):
    over = [f"pretrain.objective={objective}"]
    straight = pretrain(load_config(with_sentinels, over), tmp_path / "a", show_progress=False)
    cut = pretrain(load_config(with_sentinels, over + ["train.max_steps=3"]), tmp_path / "b",
                   show_progress=False)
    resumed = pretrain(load_config(with_sentinels, over), cut, resume=True, show_progress=False)
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg, _ = load_spec(straight)
    assert cfg.train.best_metric == "loss" and cfg.pretrain.objective == objective
    assert cfg.train.label_smoothing == 0.0  # docs/model.md (46): -(1/|y|) sum_t log P(y_t | y_<t, x~)
    tuned = train(load_config(with_sentinels, [f"train.init_from={straight}", "train.max_steps=2",
                                                "train.validate_every=2"]), tmp_path / "ft", show_progress=False)
    assert (tuned / "model.safetensors").is_file()


def test_pretraining_needs_sentinels(prepared, tmp_path):
    with pytest.raises(S2SError, match="needs tokenizer.sentinels >= 2"):
        pretrain(load_config(prepared), tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_pretrain_takes_the_run_directory_lock_and_refuses_a_users_folder(with_sentinels, tmp_path):
    """Like `s2s train`: another run holding RUN/train.lock, or a folder of one's own files, is refused."""
    import os

    from s2s.outdir import lock_run_dir

    run = tmp_path / "run"
    with lock_run_dir(run):
        with pytest.raises(S2SError, match=rf"in use by another training run \(PID {os.getpid()}\)"):
            pretrain(load_config(with_sentinels), run, show_progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("# my own\n")
    with pytest.raises(S2SError, match="not empty and not a training run directory"):
        pretrain(load_config(with_sentinels), mine, show_progress=False)
    assert [p.name for p in mine.iterdir()] == ["config.yaml"]


def test_pretrain_with_train_procs_2_runs_two_ranks(with_sentinels, tmp_path):
    """s2s pretrain starts its data-parallel ranks itself too (here through the library API)."""
    import json

    from s2s.checkpoint import list_checkpoints

    cfg = load_config(with_sentinels, ["train.procs=2", "train.max_steps=2", "train.validate_every=2",
                                       "train.dev_bleu_sentences=0", "train.best_metric=loss"])
    run = pretrain(cfg, tmp_path / "pre", show_progress=False)
    state = json.loads((list_checkpoints(run)[-1] / "state.json").read_text())["train_state"]
    assert state["step"] == 2 and state["batching"]["world_size"] == 2
    assert load_config(run / "config.yaml").train.procs == 2
