"""Training: the formulas, checkpoints, and exact resume."""

import json
import math
import os
import signal
import subprocess
import sys
import weakref

import pytest
import torch
from safetensors.torch import load_file

from s2s.allocator import malloc_in_use, training_environ
from s2s.checkpoint import list_checkpoints
from s2s.config import load_config
from s2s.errors import S2SError
from s2s.modeldir import load_model_dir
from s2s.trainer import Trainer, inverse_sqrt_lr, is_new_best, label_smoothed_nll, train
from tests.conftest import default_stop_signals, logged_lines, wait_until


def test_inverse_sqrt_schedule():
    peak, warmup = 1e-3, 100
    assert inverse_sqrt_lr(1, peak, warmup) == pytest.approx(peak / 100)
    assert inverse_sqrt_lr(50, peak, warmup) == pytest.approx(peak * 0.5)
    assert inverse_sqrt_lr(100, peak, warmup) == pytest.approx(peak)
    assert inverse_sqrt_lr(400, peak, warmup) == pytest.approx(peak * math.sqrt(100 / 400))
    assert inverse_sqrt_lr(7, peak, 0) == peak


def test_label_smoothed_nll_matches_hand_formula():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    target = torch.tensor([[1, 2, 0], [4, 3, 2]])  # 0 = pad, ignored
    eps = 0.1
    logp = torch.log_softmax(logits, -1)
    expected = 0.0
    for b in range(2):
        for t in range(3):
            y = int(target[b, t])
            if y == 0:
                continue
            expected += (1 - eps) * -logp[b, t, y] + eps * (-logp[b, t].mean())
    assert float(label_smoothed_nll(logits, target, eps)) == pytest.approx(float(expected), rel=1e-5)
    # eps = 0 is the plain negative log-likelihood
    nll = -sum(float(logp[b, t, target[b, t]]) for b in range(2) for t in range(3) if target[b, t])
    assert float(label_smoothed_nll(logits, target, 0.0)) == pytest.approx(nll, rel=1e-5)


def _weights(run_dir):
    return load_file(str(list_checkpoints(run_dir)[-1] / "model.safetensors"))


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_train_writes_a_model_directory(prepared, tmp_path):
    cfg = load_config(prepared)
    run = train(cfg, tmp_path / "run", show_progress=False)
    for name in ("config.yaml", "spm.model", "model.safetensors", "model.json", "env.json",
                 "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert [p.name for p in list_checkpoints(run)] == ["step-00000003", "step-00000006"]
    loaded = load_model_dir(run)
    assert loaded.meta["sha256"] and loaded.meta["step"] in (3, 6)
    # the run directory is not silently overwritten
    with pytest.raises(S2SError, match="already holds a training run"):
        train(cfg, run, show_progress=False)


def test_resume_is_bit_identical(prepared, tmp_path):
    straight = train(load_config(prepared), tmp_path / "a", show_progress=False)
    cut = train(load_config(prepared, ["train.max_steps=3"]), tmp_path / "b", show_progress=False)
    resumed = train(load_config(prepared), cut, resume=True, show_progress=False)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(straight) == _losses(resumed)


def test_same_seed_same_model(prepared, tmp_path):
    cfg = load_config(prepared, ["train.max_steps=2", "train.validate_every=2"])
    one = _weights(train(cfg, tmp_path / "one", show_progress=False))
    two = _weights(train(cfg, tmp_path / "two", show_progress=False))
    assert all(torch.equal(one[k], two[k]) for k in one)


def _run_cli(args, **kw):
    """``s2s ARGS`` as a user's command: SIGINT, SIGTERM and SIGHUP at their defaults even when
    the tests run as a background job or under nohup (which s2s would honour)."""
    return subprocess.Popen([sys.executable, "-m", "s2s", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_stop_signals, **kw)


def test_the_allocator_training_starts_with_changes_no_number(prepared, tmp_path):
    """``s2s train`` starts itself again with mimalloc (or glibc's malloc in huge pages,
    s2s.allocator.training_environ): the same weights and losses, bit for bit, as a run kept on
    glibc's malloc as the process started (S2S_MALLOC=glibc)."""
    sets = [a for s in ("train.max_steps=4", "train.validate_every=2", "train.dev_bleu_sentences=0",
                        "train.best_metric=loss") for a in ("--set", s)]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "S2S_MALLOC")}
    logs = {}
    for name, extra in (("default", {}), ("glibc", {"S2S_MALLOC": "glibc"})):
        proc = _run_cli(["train", str(prepared), "-o", str(tmp_path / name), *sets], env={**env, **extra})
        _, logs[name] = proc.communicate(timeout=300)
        assert proc.returncode == 0, logs[name][-3000:]
    assert f"host memory: {malloc_in_use(training_environ(env) or env)}\n" in logs["default"], logs["default"]
    assert "host memory: glibc malloc\n" in logs["glibc"], logs["glibc"]
    a, b = _weights(tmp_path / "default"), _weights(tmp_path / "glibc")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(tmp_path / "default") == _losses(tmp_path / "glibc")


def test_sigkill_then_resume_matches_uninterrupted(prepared, tmp_path):
    """kill -9 mid-run, --resume, and the run ends with the same weights and losses."""
    overrides = ["--set", "train.max_steps=12", "--set", "train.validate_every=2",
                 "--set", "train.dev_bleu_sentences=0", "--set", "train.best_metric=loss"]
    full = _run_cli(["train", str(prepared), "-o", str(tmp_path / "full"), *overrides])
    assert full.wait(timeout=300) == 0, full.stderr.read()
    run = tmp_path / "killed"
    proc = _run_cli(["train", str(prepared), "-o", str(run), *overrides])
    wait_until((run / "checkpoints" / "step-00000004").exists, 120)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list_checkpoints(run), "no checkpoint before the kill"
    again = _run_cli(["train", str(prepared), "-o", str(run), "--resume", *overrides])
    assert again.wait(timeout=300) == 0, again.stderr.read()
    a, b = _weights(tmp_path / "full"), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # steps logged after the resume equal the uninterrupted run's
    assert _losses(tmp_path / "full").items() >= _losses(run).items()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_sigint_writes_checkpoint_and_exits_nonzero(prepared, tmp_path, signum):
    run = tmp_path / "int"
    proc = _run_cli(["train", str(prepared), "-o", str(run), "--set", "train.max_steps=100000",
                     "--set", "train.validate_every=100000"])
    wait_until(lambda: logged_lines(run) >= 3, 120)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum
    assert f"stopped by {signum.name}" in err and "checkpoint written" in err and "Traceback" not in err
    assert list_checkpoints(run)
    assert err.strip().splitlines()[-1].startswith("s2s: interrupted: ")  # not an error


def test_separate_vocabularies_end_to_end(corpus, tmp_path):
    """tokenizer.joint: false gives one SentencePiece model per language and separate embeddings."""
    from s2s.data import prepare
    from s2s.tokenizer import train_tokenizer
    from s2s.translate import Translator
    from tests.conftest import TINY_YAML

    cfg_path = tmp_path / "sep.yaml"
    cfg_path.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{tmp_path}/prep"))
    cfg = load_config(cfg_path, ["tokenizer.joint=false", "model.share_embeddings=false",
                                 "tokenizer.vocab_size=200", "train.max_steps=2"])
    files = train_tokenizer(cfg.tokenizer, cfg.data)
    assert [f.name for f in files] == ["spm.en.model", "spm.de.model"]
    prepare(cfg)
    run = train(cfg, tmp_path / "run", show_progress=False)
    assert (run / "spm.en.model").is_file() and (run / "spm.de.model").is_file()
    tr = Translator.from_dir(run, beam=2)
    assert tr.model.src_embed is not tr.model.tgt_embed
    assert len(tr.translate(["Clipboard management", ""])) == 2


def test_average_checkpoints(prepared, tmp_path):
    from s2s.modeldir import average_checkpoints
    from s2s.translate import Translator

    run = train(load_config(prepared), tmp_path / "run", show_progress=False)
    ckpts = list_checkpoints(run)
    out = average_checkpoints(ckpts, tmp_path / "avg")
    a, b = (load_file(str(c / "model.safetensors")) for c in ckpts)
    avg = load_file(str(out / "model.safetensors"))
    for k in avg:
        assert torch.allclose(avg[k], (a[k].double() + b[k].double()).div(2).float()), k
    assert len(Translator.from_dir(out, beam=2).translate(["Clipboard management"])) == 1


def test_early_stopping_after_patience(prepared, tmp_path):
    """With a learning rate too small to move a float32 weight, dev loss never improves."""
    cfg = load_config(prepared, ["train.lr=1e-20", "train.best_metric=loss", "train.early_stopping=2",
                                 "train.max_steps=30", "train.dev_bleu_sentences=0"])
    run = train(cfg, tmp_path / "run", show_progress=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    dev = [r for r in rows if "dev_loss" in r]
    assert [r["step"] for r in dev] == [3, 6, 9]  # best at 3, then two without a new best
    assert [r["best"] for r in dev] == [True, False, False]


def test_new_best_breaks_ties_by_dev_loss():
    """Higher BLEU (lower loss) wins; an equal score with a lower dev loss wins; None never does."""
    assert is_new_best(1.0, 6.0, None, None, higher_is_better=True)
    assert is_new_best(2.0, 9.0, 1.0, 5.0, higher_is_better=True)
    assert not is_new_best(0.5, 1.0, 1.0, 5.0, higher_is_better=True)
    assert is_new_best(0.0, 5.25, 0.0, 6.76, higher_is_better=True)  # the young model
    assert not is_new_best(0.0, 6.76, 0.0, 6.76, higher_is_better=True)
    assert not is_new_best(0.0, None, 0.0, 6.76, higher_is_better=True)
    assert is_new_best(4.0, 4.0, 5.0, 5.0, higher_is_better=False)
    assert not is_new_best(5.0, 5.0, 5.0, 5.0, higher_is_better=False)
    assert not is_new_best(None, 1.0, 0.0, 6.76, higher_is_better=True)


def test_a_tied_dev_bleu_keeps_the_model_with_the_lower_dev_loss(prepared, tmp_path, monkeypatch):
    """A young model's dev BLEU is 0.0 at every validation: the best model is the one whose
    dev loss is lowest, not the first."""
    monkeypatch.setattr(Trainer, "dev_bleu", lambda self: 0.0)
    run = train(load_config(prepared), tmp_path / "run", show_progress=False)
    dev = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "dev_loss" in r}
    assert [r["dev_bleu"] for r in dev.values()] == [0.0, 0.0] and dev[6]["dev_loss"] < dev[3]["dev_loss"]
    assert [r["best"] for r in dev.values()] == [True, True]
    assert load_model_dir(run).meta["step"] == 6


def colour_pixels(image, hex_colour: str, tol: float = 0.12):
    """How many pixels of an RGB(A) float image are within ``tol`` of a colour."""
    import numpy as np

    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(-1) < tol).sum())


def test_plot_draws_curves_lr_schedule_and_kept_step(prepared, tmp_path):
    import matplotlib.image

    from s2s.plot import plot_run, read_curves

    cfg = load_config(prepared, ["train.log_every=2"])
    run = train(cfg, tmp_path / "run", show_progress=False)
    png = plot_run(run)
    assert png == run / "curves.png"
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (400, 1500)  # figsize 15x4 inches at 100 dpi
    thirds = [image[40:360, x:x + 500, :3] for x in (0, 500, 1000)]
    assert all(t.std() > 0.05 for t in thirds)  # each panel has something drawn, not a blank frame
    assert colour_pixels(thirds[2], "#d62728") > 100  # the learning-rate curve (tab:red)
    assert colour_pixels(image, "#9467bd") > 100  # the kept step (tab:purple)
    c = read_curves(run)
    # the schedule at every update, not only at the log steps (2, 4, 6)
    assert c.lr_steps == list(range(1, 7))
    assert c.lr == [inverse_sqrt_lr(s, cfg.train.lr, cfg.train.warmup_steps) for s in range(1, 7)]
    logged = {r["step"]: r["lr"] for r in c.train}
    assert set(logged) == {2, 4, 6} and all(math.isclose(logged[s], c.lr[s - 1]) for s in logged)
    assert c.best_step == json.loads((run / "model.json").read_text())["step"]
    assert c.best_step in [r["step"] for r in c.dev if r["best"]]
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(S2SError, match=r"metrics.jsonl:2: not a JSON line"):
        plot_run(run)


def nan_on(calls):
    """batch_objective whose loss (and objective) is NaN on the given (0-based) training calls."""
    import s2s.trainer

    real = s2s.trainer.batch_objective
    count = {"n": 0}

    def objective(*args, **kwargs):
        loss, total = real(*args, **kwargs)
        count["n"] += 1
        if calls(count["n"] - 1):
            return loss * float("nan"), total * float("nan")
        return loss, total
    return objective


def test_non_finite_loss_skips_the_update(prepared, tmp_path, monkeypatch, caplog):
    import s2s.trainer

    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i in (1, 2)))
    run = train(load_config(prepared), tmp_path / "run", show_progress=False)
    assert "non-finite loss or gradient" in caplog.text and "update skipped" in caplog.text
    w = _weights(run)
    assert all(torch.isfinite(t).all() for t in w.values())
    assert int(json.loads((list_checkpoints(run)[-1] / "state.json").read_text())
               ["train_state"]["step"]) == 6  # the skipped batches are not counted as updates


def test_a_run_of_non_finite_losses_aborts(prepared, tmp_path, monkeypatch):
    import s2s.trainer

    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i >= 2))
    monkeypatch.setattr(s2s.trainer, "MAX_BAD_UPDATES", 3)
    with pytest.raises(S2SError, match="3 non-finite updates in a row after step 2"):
        train(load_config(prepared), tmp_path / "run", show_progress=False)


@pytest.mark.parametrize("first_nan_call", [2, 4])
def test_non_finite_abort_advises_resume_only_from_a_checkpoint(prepared, tmp_path, monkeypatch, first_nan_call):
    """Before the first checkpoint (validate_every 3) there is nothing to --resume from."""
    import s2s.trainer

    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i >= first_nan_call))
    monkeypatch.setattr(s2s.trainer, "MAX_BAD_UPDATES", 3)
    run = tmp_path / "run"
    with pytest.raises(S2SError) as e:
        train(load_config(prepared), run, show_progress=False)
    if first_nan_call == 2:
        assert "--resume" not in str(e.value) and "start again (no checkpoint was written" in str(e.value)
    else:
        assert str(e.value).endswith(f"--resume from the last checkpoint ({run / 'checkpoints' / 'step-00000003'})")


def test_non_finite_weights_are_never_written(prepared, tmp_path):
    from s2s.checkpoint import TrainState, save_checkpoint

    cfg = load_config(prepared)
    model = load_model_dir(train(cfg, tmp_path / "run", show_progress=False)).model
    before = list_checkpoints(tmp_path / "run")
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(S2SError, match="holds NaN or Inf"):
        save_checkpoint(tmp_path / "run", model, opt, TrainState(step=99), keep=5)
    assert list_checkpoints(tmp_path / "run") == before
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]


class OutOfMemoryInBackward(torch.autograd.Function):
    """Identity; its backward runs out of memory (simulated), after the decoder's parameters
    have had their gradients added to .grad."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def splits_to_fit(n: int, fits: int) -> tuple[int, int]:
    """(splits, pieces) of n sentences halved until each piece has at most ``fits``."""
    if n <= fits:
        return 0, 1
    (s1, p1), (s2, p2) = splits_to_fit(n // 2, fits), splits_to_fit(n - n // 2, fits)
    return 1 + s1 + s2, p1 + p2


@pytest.mark.parametrize("precision,where", [("fp32", "forward"), ("fp32", "backward"), ("bf16", "forward"),
                                             ("bf16", "backward"), ("bf16", "adding the bf16 gradients")])
def test_a_batch_out_of_memory_is_split(prepared, tmp_path, monkeypatch, caplog, precision, where):
    """A batch that does not fit is split in halves with a warning; the update's gradient is the
    same, also when the failed pass was the update's second batch and ran out of memory after
    part of its gradient was added to .grad (an fp32 backward; in bf16, adding the bf16 copy's
    gradients to the fp32 ones): then the update's batches run again from the first.  The
    halves run after the failed pass's memory is freed."""
    from s2s.model import Seq2SeqTransformer
    from s2s.precision import Bf16Copy
    from s2s.trainer import make_trainer

    cfg = load_config(prepared, ["model.dropout=0", f"train.precision={precision}"])
    trainer = make_trainer(cfg, tmp_path / "run", show_progress=False)
    idx = trainer.epoch_batches(0)[0]
    assert len(idx) > 5
    batches = [trainer.train_data.batch(idx[:3]), trainer.train_data.batch(idx[3:])]  # the second too big
    n_tokens = sum(b.n_tgt_tokens for b in batches)
    trainer.model.train()
    if trainer.bf16 is not None:
        trainer.bf16.refresh()
    whole = trainer.accumulate_gradients(batches, n_tokens)
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.optimizer.zero_grad(set_to_none=True)
    real_forward, real_encode, real_adding = Seq2SeqTransformer.forward, Seq2SeqTransformer.encode, \
        Bf16Copy.accumulate_grads
    rows, failed_passes, alive_at_a_retry = [0], [], []

    def encode(self, src):
        rows[0] = src.size(0)
        enc = real_encode(self, src)
        if src.size(0) > 3:
            failed_passes.append(weakref.ref(enc.h_enc))  # what the failed pass's frames and graph hold
            if where == "backward":
                enc.h_enc = OutOfMemoryInBackward.apply(enc.h_enc)
        else:
            alive_at_a_retry.append(any(r() is not None for r in failed_passes))
        return enc

    def forward_of_small_batches(self, src, tgt_in, return_attention=False, keep=None, head=True):
        out = real_forward(self, src, tgt_in, return_attention, keep, head)
        if src.size(0) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return out

    def adding_half_then_failing(self):
        if rows[0] <= 3:
            return real_adding(self)
        every = self.slots
        self.slots = every[:len(every) // 2]
        try:
            real_adding(self)  # half of the gradients in the fp32 ones
        finally:
            self.slots = every
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(Seq2SeqTransformer, "encode", encode)
    if where == "forward":
        monkeypatch.setattr(Seq2SeqTransformer, "forward", forward_of_small_batches)
    if where == "adding the bf16 gradients":
        monkeypatch.setattr(Bf16Copy, "accumulate_grads", adding_half_then_failing)
    split = trainer.accumulate_gradients(batches, n_tokens)
    splits, pieces = splits_to_fit(len(idx) - 3, 3)
    assert caplog.text.count("ran out of memory; splitting it in two") == splits
    if where == "forward" or (precision, where) == ("bf16", "backward"):  # nothing added: no batch runs again
        assert len(alive_at_a_retry) == 1 + pieces
    else:
        assert len(alive_at_a_retry) > 1 + pieces  # the first batch again
    assert failed_passes and not any(alive_at_a_retry)
    assert float(split) == pytest.approx(float(whole), rel=1e-5)
    for (name, p), g in zip(trainer.model.named_parameters(), grads):
        if precision == "fp32":
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        else:  # bf16 passes of other sizes round otherwise; a gradient counted twice is off by ~1
            assert float((p.grad - g).norm() / g.norm()) < 0.02, name
    one = trainer.train_data.batch(idx[:1])
    monkeypatch.setattr(Seq2SeqTransformer, "forward", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("simulated")))
    with pytest.raises(S2SError, match="out of memory on one sentence"):
        trainer.accumulate_gradients([one], one.n_tgt_tokens)


def test_metrics_go_to_tensorboard_when_installed(prepared, tmp_path, monkeypatch):
    """With a SummaryWriter available, every logged number is a scalar (a stand-in writer here:
    tensorboard is an optional package)."""
    import s2s.runlog

    scalars = []

    class Writer:
        def __init__(self, log_dir):
            assert log_dir == str(tmp_path / "run" / "tensorboard")

        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def flush(self):
            pass

        def close(self):
            scalars.append("closed")

    monkeypatch.setattr(s2s.runlog, "open_tensorboard", lambda run_dir: Writer(str(run_dir / "tensorboard")))
    train(load_config(prepared), tmp_path / "run", show_progress=False)
    assert ("train/loss", 1) in scalars and ("dev/dev_loss", 3) in scalars and ("train/lr", 6) in scalars
    assert scalars[-1] == "closed"


@pytest.mark.slow
def test_compiled_training_matches_eager(prepared, tmp_path):
    """train.compile: the same updates through torch.compile, up to floating-point reordering."""
    sets = ["train.max_steps=3", "train.validate_every=3", "train.log_every=1", "model.dropout=0",
            "model.attention_dropout=0", "train.dev_bleu_sentences=0", "train.best_metric=loss"]
    eager = train(load_config(prepared, sets), tmp_path / "eager", show_progress=False)
    compiled = train(load_config(prepared, [*sets, "train.compile=true"]), tmp_path / "compiled",
                     show_progress=False)
    for step, loss in _losses(eager).items():
        assert _losses(compiled)[step] == pytest.approx(loss, abs=1e-3)


def test_prefetcher_returns_the_batches_asked_for():
    import numpy as np

    from s2s.trainer import Prefetcher

    built = []

    def build(epoch, group):
        assert epoch == 0
        built.append([g.tolist() for g in group])
        return [g.sum() for g in group]

    p = Prefetcher(build)
    a, b = [np.array([1, 2])], [np.array([3, 4])]
    p.ahead((0, 0), a)
    assert p.take((0, 0), a) == [3]  # the one built ahead
    p.ahead((0, 1), a)
    assert p.take((0, 2), b) == [7]  # asked for another position: built now, not the stale ones
    p.close()
    assert built.count([[3, 4]]) == 1


def test_progress_bar_shows_step_time_and_loss_from_the_first_step(prepared, tmp_path, monkeypatch):
    """On a terminal the bar shows, from update 1 (log_every is 50 here), the step, the time used and
    left of train.max_time, and that update's loss; it fills against max_time when max_steps is unset."""
    import io

    from rich.console import Console

    import s2s.trainer

    buf = io.StringIO()
    made = []

    class Recorded(s2s.trainer.Progress):
        def __init__(self, total, max_seconds, enabled):
            super().__init__(total, max_seconds, enabled, Console(file=buf, force_terminal=True, width=200))
            made.append(self)

    monkeypatch.setattr(s2s.trainer, "Progress", Recorded)
    monkeypatch.setattr(s2s.trainer.Progress, "REDRAW_SECONDS", 0.0)  # every update redrawn
    cfg = load_config(prepared, ["train.max_steps=0", "train.max_time=15m", "train.log_every=50",
                                 "train.validate_every=1000", "train.max_epochs=1"])
    train(cfg, tmp_path / "run", show_progress=True)
    text = buf.getvalue()
    assert "step 1 |" in text and "left of 0:15:00" in text, text[-2000:]
    first = text[text.index("step 1 |"):].split("\n")[0]
    loss = float(first.split("loss ")[1].split()[0])
    assert 0 < loss < 20 and math.isfinite(loss)
    assert made[0]._by_time and made[0]._bar.tasks[0].total == 900


def test_progress_line_formula():
    from s2s.runlog import progress_line

    assert progress_line(7, 100, 65.0, 900.0, 4.25) == "step 7/100 | 0:01:05 used, 0:13:55 left of 0:15:00 | loss 4.250"
    assert progress_line(1, None, 3.0, math.inf, None, "lr 1.00e-03") == "step 1 | 0:00:03 | lr 1.00e-03"


def test_gpu_random_states_saved_for_gpu_runs_and_restored_on_fewer_gpus(tmp_path, monkeypatch):
    """A run on the CPU saves no GPU random state (asking would open a CUDA context on a GPU
    machine); a GPU run's states are restored for as many GPUs as the resuming machine has."""
    from s2s import checkpoint
    from s2s.checkpoint import TrainState, load_checkpoint, save_checkpoint

    def no_gpu_state():
        raise AssertionError("a CPU run asked for the GPUs' random states")

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_gpu_state)
    save_checkpoint(tmp_path / "cpu", model, opt, TrainState(step=1), keep=5)

    states = [torch.full((8,), i, dtype=torch.uint8) for i in (1, 2)]  # two GPUs' states
    monkeypatch.setattr(checkpoint, "on_cuda", lambda m: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    path = save_checkpoint(tmp_path / "gpu", model, opt, TrainState(step=2), keep=5)
    restored = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    assert load_checkpoint(path, model, opt).step == 2
    assert len(restored) == 1 and len(restored[0]) == 1 and torch.equal(restored[0][0], states[0])
