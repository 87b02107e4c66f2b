"""``s2s pretrain``: denoising pretraining on the prepared text (docs/model.md (46)-(48)).

The documents are both sides of the prepared training split (one joint
vocabulary: every line is a document, whatever its language).  Each batch is
noised when it is built, with a generator seeded by (seed, split, epoch,
document), so the noise is a pure function of where training is: a resumed
run sees exactly the noise the uninterrupted run saw.  The loss is the
teacher-forced cross-entropy of the target given x~,
L = -(1/|y|) sum_t log P(y_t | y_<t, x~); fine-tuning starts from the run
directory with ``train.init_from``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from s2s.config import ExperimentConfig, PretrainConfig, replace
from s2s.data import Batch, BinDataset
from s2s.errors import S2SError
from s2s.noise import BartNoise, bart_noise, span_corruption
from s2s.tokenizer import Tokenizer

SENTENCE_ENDS = (".", "!", "?")


class Denoiser:
    """(x~, y) of one document under ``pretrain.objective``."""

    def __init__(self, cfg: PretrainConfig, tok: Tokenizer):
        self.cfg = cfg
        self.sentinels = tok.sentinel_ids()
        need = 2 if cfg.objective == "span_corruption" else 1
        if len(self.sentinels) < need:
            raise S2SError(f"pretrain.objective: {cfg.objective} needs tokenizer.sentinels >= {need} "
                           f"(<extra_id_N> symbols; the tokenizer has {len(self.sentinels)}); "
                           "train the tokenizer with --sentinels 100")
        self.bart = BartNoise(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(BartNoise)})
        self.stops = {i for i in range(tok.src_vocab_size) if tok.piece(i, "src").endswith(SENTENCE_ENDS)}

    def __call__(self, x: Sequence[int], rng: np.random.Generator) -> tuple[list[int], list[int]]:
        if self.cfg.objective == "span_corruption":
            return span_corruption(x, rng, self.sentinels, self.cfg.noise_density, self.cfg.mean_span)
        return bart_noise(x, rng, self.sentinels[0], self.bart, self.stops)


class DenoisingDataset:
    """The lines of both sides of a prepared split as documents, noised batch by batch."""

    def __init__(self, data: BinDataset, denoiser: Denoiser, seed: int, split_key: int, eos_id: int):
        self.data, self.denoiser, self.seed, self.split_key, self.eos_id = data, denoiser, seed, split_key, eos_id
        self.n = len(data)
        lens = np.concatenate([data.src_lens, data.tgt_lens])
        self.src_lens = self.tgt_lens = lens

    def __len__(self) -> int:
        return 2 * self.n

    def document(self, i: int) -> list[int]:
        src, tgt = self.data.pair(i % self.n)
        ids = (src if i < self.n else tgt).tolist()
        return ids[:-1] if ids and ids[-1] == self.eos_id else ids  # without </s>

    def batch(self, indices: Sequence[int], epoch: int = 0) -> Batch:
        """Documents ``indices`` noised with a generator seeded by (seed, split, epoch, document)."""
        src, tgt = [], []
        for i in indices:
            rng = np.random.default_rng([self.seed, self.split_key, epoch, int(i)])
            x_noisy, y = self.denoiser(self.document(int(i)), rng)
            src.append(x_noisy + [self.eos_id])
            tgt.append(y + [self.eos_id])
        return Batch.from_ids(src, tgt, self.data.pad_id, self.data.bos_id)


def pretraining_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The loss of docs/model.md (46) is the plain NLL (no label smoothing), and the best checkpoint is the one
    with the lowest dev loss (BLEU of reconstructing noise means nothing)."""
    if not cfg.tokenizer.joint:
        raise S2SError("tokenizer.joint: pretraining treats both sides as one text; needs a joint vocabulary")
    train = replace(cfg.train, "train.", best_metric="loss", dev_bleu_sentences=0, label_smoothing=0.0)
    return dataclasses.replace(cfg, train=train)


def denoising_datasets(cfg: ExperimentConfig, tok: Tokenizer) -> tuple[DenoisingDataset, Optional[DenoisingDataset]]:
    """Both sides of the prepared train and dev splits as documents, noised as ``cfg.pretrain`` says."""
    from s2s.trainer import prepared_datasets

    train, dev = prepared_datasets(cfg, tok)
    denoiser = Denoiser(cfg.pretrain, tok)
    return (DenoisingDataset(train, denoiser, cfg.seed, 0, tok.eos_id),
            DenoisingDataset(dev, denoiser, cfg.seed, 1, tok.eos_id) if dev is not None else None)


def pretrain(cfg: ExperimentConfig, run_dir: Optional[str | Path] = None, resume: bool = False,
             show_progress: bool = True) -> Path:
    """Denoising pretraining as ``cfg.pretrain`` describes; return the run (= model) directory.
    With train.procs > 1 (or auto) the data-parallel ranks run as processes of their own."""
    from s2s.trainer import run_training

    return run_training("pretrain", cfg, run_dir, resume, show_progress, denoising_datasets,
                        pretraining_config(cfg))
