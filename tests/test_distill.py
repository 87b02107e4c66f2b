"""Knowledge distillation (docs/model.md (44), (45)): the KD loss, word-level KD in training, s2s distill."""

import math

import pytest
import torch

from s2s.config import load_config
from s2s.errors import S2SError
from s2s.trainer import distillation_loss, label_smoothed_nll, train


def test_kd_loss_is_ce_when_lambda_is_zero():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    y = torch.tensor([[4, 5, 0], [1, 2, 3]])
    for eps in (0.0, 0.1):
        assert torch.equal(distillation_loss(s, t, y, 0.0, 2.0, eps, pad_id=0), label_smoothed_nll(s, y, eps, 0))


def test_kd_loss_matches_the_hand_formula():
    s = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 1.0]]])  # (B=1, T=2, V=3)
    t = torch.tensor([[[2.0, 0.0, 1.0], [1.0, 1.0, -2.0]]])
    y = torch.tensor([[1, 2]])
    lam, T = 0.3, 2.0

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    ce = kl = 0.0
    for pos in range(2):
        ps = softmax(s[0, pos].tolist())
        ce -= math.log(ps[y[0, pos]])
        ps_T, pt_T = softmax((s[0, pos] / T).tolist()), softmax((t[0, pos] / T).tolist())
        kl += sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt_T, ps_T))
    expected = (1 - lam) * ce + lam * T * T * kl
    got = distillation_loss(s, t, y, lam, T, 0.0, pad_id=-100)
    assert abs(float(got) - expected) < 1e-5


def test_kd_loss_ignores_padding():
    s, t = torch.randn(1, 3, 5), torch.randn(1, 3, 5)
    y = torch.tensor([[2, 3, 0]])
    full = distillation_loss(s, t, y, 0.5, 1.0, 0.0, pad_id=0)
    part = distillation_loss(s[:, :2], t[:, :2], y[:, :2], 0.5, 1.0, 0.0, pad_id=0)
    assert torch.allclose(full, part)


@pytest.fixture(scope="module")
def teacher(prepared, tmp_path_factory):
    return train(load_config(prepared, ["train.max_steps=3", "train.validate_every=3"]),
                 tmp_path_factory.mktemp("kd") / "teacher", show_progress=False)


def test_word_level_kd_trains_and_changes_the_updates(prepared, teacher, tmp_path):
    base = ["train.max_steps=2", "train.validate_every=2"]
    plain = train(load_config(prepared, base), tmp_path / "plain", show_progress=False)
    kd = train(load_config(prepared, base + [f"train.distill.teacher={teacher}", "train.distill.lambda=0.7",
                                             "train.distill.temperature=2"]), tmp_path / "kd", show_progress=False)
    from safetensors.torch import load_file

    a, b = load_file(plain / "model.safetensors"), load_file(kd / "model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    saved = load_config(kd / "config.yaml")
    assert saved.train.distill.lambda_ == 0.7 and "lambda: 0.7" in (kd / "config.yaml").read_text()


def test_teacher_with_another_tokenizer_is_refused(prepared, teacher, tmp_path):
    (tmp_path / "t").mkdir()
    for f in teacher.iterdir():
        if f.is_file():
            (tmp_path / "t" / f.name).write_bytes(f.read_bytes())
    from s2s.tokenizer import train_tokenizer

    cfg = load_config(prepared)
    other = load_config(prepared, ["tokenizer.vocab_size=250"]).tokenizer
    train_tokenizer(other, cfg.data, out_dir=tmp_path / "t")  # another SentencePiece model
    with pytest.raises(S2SError, match="another tokenizer"):
        train(load_config(prepared, [f"train.distill.teacher={tmp_path / 't'}"]), tmp_path / "s",
              show_progress=False)


def test_sequence_level_kd_writes_a_corpus_a_student_trains_on(prepared, teacher, tmp_path, corpus):
    from s2s.data import prepare
    from s2s.translate import distill_corpus

    cfg = load_config(prepared)
    src, tgt = distill_corpus(teacher, cfg, tmp_path / "kd", beam=2)
    n = len((corpus / "train.en").read_text().splitlines())
    assert src.name == "kd.en" and tgt.name == "kd.de"
    assert len(src.read_text().splitlines()) == len(tgt.read_text().splitlines()) == n
    student = load_config(prepared, [f"data.train={tmp_path / 'kd'}", f"data.dir={tmp_path / 'prep'}",
                                     "train.max_steps=2", "train.validate_every=2"])
    from s2s.tokenizer import train_tokenizer

    train_tokenizer(student.tokenizer, student.data)
    prepare(student)
    assert (train(student, tmp_path / "student", show_progress=False) / "model.safetensors").is_file()
