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


@pytest.mark.parametrize("lam, T", [(0.7, 2.0), (1.0, 1.0)])
def test_word_level_kd_loss_of_a_training_batch_is_the_formula(prepared, teacher, tmp_path, lam, T):
    """The loss the trainer backpropagates on a fixed batch of the training data, with the
    teacher it loaded from train.distill.teacher, is
    L_KD = (1 - lam) CE(y, p^s) + lam T^2 KL(p^t_T || p^s_T), summed over the real target tokens,
    computed here token by token from the two models' scores."""
    from safetensors.torch import load_file

    from s2s.trainer import make_trainer

    cfg = load_config(prepared, [f"train.distill.teacher={teacher}", f"train.distill.lambda={lam}",
                                 f"train.distill.temperature={T}", "train.label_smoothing=0",
                                 "model.dropout=0"])
    trainer = make_trainer(cfg, tmp_path / "student", show_progress=False)
    weights = load_file(teacher / "model.safetensors")
    shared = [k for k in trainer.teacher.state_dict() if k in weights]  # tied tensors are stored once
    assert len(shared) > 5 and all(torch.equal(trainer.teacher.state_dict()[k], weights[k]) for k in shared)
    b = trainer.train_data.batch(trainer.epoch_batches(0)[0])
    got = float(trainer.forward_backward(b, b.n_tgt_tokens))
    with torch.no_grad():
        z_s = trainer.model(b.src, b.tgt_in).double()  # (B, T, V)
        z_t = trainer.teacher(b.src, b.tgt_in).double()
    expected, n = 0.0, 0
    for i in range(b.tgt_out.size(0)):
        for t in range(b.tgt_out.size(1)):
            y = int(b.tgt_out[i, t])
            if y == trainer.tok.pad_id:
                continue
            n += 1
            ce = -torch.log_softmax(z_s[i, t], -1)[y]
            p_t, p_s = torch.softmax(z_t[i, t] / T, -1), torch.softmax(z_s[i, t] / T, -1)
            kl = (p_t * (p_t.log() - p_s.log())).sum()
            expected += float((1 - lam) * ce + lam * T * T * kl)
    assert n == b.n_tgt_tokens > 10
    assert got == pytest.approx(expected, rel=1e-4)
    if lam == 1.0:  # then the reference data does not enter: only the teacher's distribution
        assert got != pytest.approx(float(label_smoothed_nll(z_s, b.tgt_out, 0.0, trainer.tok.pad_id)), rel=1e-3)


def test_teacher_with_another_tokenizer_is_refused(prepared, teacher, tmp_path):
    (tmp_path / "t").mkdir()
    for f in teacher.iterdir():
        if f.is_file():
            (tmp_path / "t" / f.name).write_bytes(f.read_bytes())
    from s2s.tokenizer import train_tokenizer

    cfg = load_config(prepared)
    other = load_config(prepared, ["tokenizer.vocab_size=250"]).tokenizer
    for f in train_tokenizer(other, cfg.data, out_dir=tmp_path / "tok"):  # another SentencePiece model
        (tmp_path / "t" / f.name).write_bytes(f.read_bytes())
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
