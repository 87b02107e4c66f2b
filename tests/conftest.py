"""Shared fixtures: a tiny real corpus slice and a tiny experiment config."""

import gzip
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"


def load_benchmark(name: str, monkeypatch):
    """benchmarks/NAME.py as a module (registered in sys.modules while the test runs: its
    dataclasses look their module up)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


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


def wait_until(ready: Callable[[], bool], timeout: float, proc: Optional[subprocess.Popen] = None) -> bool:
    """Look at ``ready()`` every 50 ms until it holds (True), or ``timeout`` seconds pass or ``proc``
    ends first (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        if ready():
            return True
        time.sleep(0.05)
    return ready()


def default_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP back to their default handling: a child's ``preexec_fn`` for a
    test that sends it one.  A shell's background job inherits SIGINT ignored and a run under
    nohup SIGHUP, which s2s keeps ignored as the user asked; a user's Ctrl-C or hangup is not."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def logged_lines(run: Path) -> int:
    """Lines a training run has written to its metrics.jsonl (0 before it exists)."""
    m = run / "metrics.jsonl"
    return m.read_text().count("\n") if m.exists() else 0


def untrained_model_dir(prepared: Path, directory: Path) -> Path:
    """A model directory of the tiny config in ``directory``, its weights drawn with torch's seed 0
    and never trained: enough for what decoding does (its outputs: whatever those weights say)."""
    from s2s.config import load_config
    from s2s.modeldir import build_model, save_model_dir
    from s2s.tokenizer import Tokenizer

    cfg = load_config(prepared)
    tok = Tokenizer.load(cfg.data.dir, cfg.tokenizer, cfg.data)
    torch.manual_seed(0)
    save_model_dir(directory, build_model(cfg, tok), cfg, Path(cfg.data.dir), {"step": 0})
    return directory


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
