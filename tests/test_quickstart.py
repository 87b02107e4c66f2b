"""The quickstart recipe on the shipped corpus learns (slow: minutes of training)."""

import json

import pytest

from s2s.config import load_config
from s2s.data import prepare
from s2s.tokenizer import train_tokenizer
from s2s.trainer import train
from tests.conftest import REPO


@pytest.mark.slow
def test_quickstart_recipe_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe's data paths are relative to the repository
    cfg = load_config(REPO / "recipes" / "quickstart.yaml",
                      [f"data.dir={tmp_path}/prep", "train.max_time=4m", "train.validate_every=100",
                       "train.dev_bleu_sentences=100"])
    train_tokenizer(cfg.tokenizer, cfg.data, seed=cfg.seed)
    prepare(cfg)
    run = train(cfg, tmp_path / "run", show_progress=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in rows if "dev_loss" in r]
    assert len(dev) >= 2
    assert dev[-1]["dev_loss"] < dev[0]["dev_loss"] < 8.3  # 8.3 = ln(4000): a uniform guess
    assert max(r["dev_bleu"] for r in dev) > 1.0
