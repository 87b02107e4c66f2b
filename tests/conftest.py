"""Shared fixtures: a tiny real corpus slice and a tiny experiment config."""

import gzip
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"


def _head(path: Path, n: int) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return "".join(line for _, line in zip(range(n), f))


TINY_YAML = """\
seed: 1
tokenizer: {{vocab_size: 300}}
data: {{src_lang: en, tgt_lang: de, train: {d}/train, dev: {d}/dev, dir: {d}/prep}}
model: {{d_model: 32, heads: 2, enc_layers: 1, dec_layers: 1, d_ff: 64}}
train: {{max_steps: 6, validate_every: 3, log_every: 1, dev_bleu_sentences: 8, warmup_steps: 4,
        max_tokens: 600, threads: 1, keep_checkpoints: 5}}
decode: {{beam: 2, max_len_a: 1.2, max_len_b: 5}}
"""


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """400 training and 20 dev pairs of the shipped English-German corpus."""
    d = tmp_path_factory.mktemp("corpus")
    for split, n in (("train", 400), ("dev", 20)):
        for lang in ("en", "de"):
            (d / f"{split}.{lang}").write_text(_head(DATA / f"{split}.{lang}.gz", n), encoding="utf-8")
    return d


@pytest.fixture(scope="session")
def prepared(corpus) -> Path:
    """The tiny config with its tokenizer trained and data prepared; returns the YAML path."""
    from s2s.config import load_config
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer

    cfg_path = corpus / "tiny.yaml"
    cfg_path.write_text(TINY_YAML.format(d=corpus))
    cfg = load_config(cfg_path)
    train_tokenizer(cfg.tokenizer, cfg.data, seed=cfg.seed)
    prepare(cfg)
    return cfg_path


@pytest.fixture(autouse=True)
def _one_thread():
    """Tests run tiny models: one thread avoids oversubscribing the 2 CI cores."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device of the device-relevant tests (model forward/decode equality, search on a model,
    translate --device): S2S_TEST_DEVICE (cpu, cuda, cuda:N, mps; default cpu), which
    benchmarks/gpu_check.sh sets to cuda.  A device torch cannot use fails those tests, never skips them."""
    from s2s.device import resolve_device

    return resolve_device(os.environ.get("S2S_TEST_DEVICE", "cpu"), key="S2S_TEST_DEVICE")
