"""Training precision (issue 16, levers 1 and 6): bf16 weight copies with fp32 master weights,
fused matmuls against the unfused formulas, what ``auto`` picks, and the GPU path's
device-side skipping of non-finite updates (run here on the CPU)."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import s2s.precision
from s2s.config import ModelConfig, load_config
from s2s.errors import S2SError
from s2s.model import make_model
from s2s.model.attention import MultiHeadAttention
from s2s.model.layers import FeedForward
from s2s.precision import Bf16Copy, auto_precision
from s2s.runlog import LogWindow
from s2s.trainer import make_trainer, train
from tests.test_train import nan_on

NO_DROPOUT = ["model.dropout=0", "model.attention_dropout=0"]


def test_auto_precision_reads_the_cpu_flags():
    cpu = torch.device("cpu")
    assert auto_precision(cpu, {"avx512f", "avx512_bf16"}) == ("bf16", "CPU flags avx512_bf16")
    assert auto_precision(cpu, {"avx2", "amx_bf16", "amx_tile"}) == ("bf16", "CPU flags amx_bf16")
    assert auto_precision(cpu, {"avx512f", "avx512bw"}) == ("fp32", "no avx512_bf16/amx_bf16 among the CPU flags")
    # on this machine: bf16 exactly where /proc/cpuinfo or torch's probe finds native bf16
    native = (set(s2s.precision.cpu_flags()) & {"avx512_bf16", "amx_bf16"} or torch.cpu._is_avx512_bf16_supported()
              or torch.cpu._is_amx_tile_supported())
    assert auto_precision(cpu)[0] == ("bf16" if native else "fp32")


def _no_native_bf16(monkeypatch):
    monkeypatch.setattr(s2s.precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def test_train_precision_auto_picks_fp32_without_native_bf16_and_says_why(prepared, tmp_path, monkeypatch, caplog):
    _no_native_bf16(monkeypatch)
    with caplog.at_level(logging.INFO, logger="s2s"):
        trainer = make_trainer(load_config(prepared, ["train.precision=auto"]), tmp_path / "run", show_progress=False)
    assert trainer.precision == "fp32" and trainer.bf16 is None and trainer.work is trainer.model
    assert "train.precision auto: fp32 (no avx512_bf16/amx_bf16 among the CPU flags)" in caplog.text
    caplog.clear()
    make_trainer(load_config(prepared, ["train.precision=bf16"]), tmp_path / "run2", show_progress=False)
    assert "train.precision bf16: this CPU has no native bf16 matmul" in caplog.text


def test_train_precision_auto_picks_bf16_with_native_bf16(prepared, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(s2s.precision, "native_bf16_cpu", lambda flags=None: ["amx_bf16"])
    with caplog.at_level(logging.INFO, logger="s2s"):
        trainer = make_trainer(load_config(prepared, ["train.precision=auto"]), tmp_path / "run", show_progress=False)
    assert trainer.precision == "bf16" and trainer.bf16 is not None
    assert "train.precision auto: bf16 (CPU flags amx_bf16)" in caplog.text


def test_fused_qkv_equals_separate_projections():
    """Self-attention's one (d, 3d) matmul = X W_Q, X W_K, X W_V as three matmuls."""
    torch.manual_seed(0)
    d, heads = 16, 4
    mha = MultiHeadAttention(d, heads)
    x = torch.randn(2, 5, d)
    q, k, v = mha.project_qkv(x)  # (B, heads, L, d_head)
    W, b = mha.qkv_proj.weight, mha.qkv_proj.bias  # (3d, d), (3d,)
    for i, got in enumerate((q, k, v)):
        alone = F.linear(x, W[i * d:(i + 1) * d], b[i * d:(i + 1) * d])  # (B, L, d)
        torch.testing.assert_close(got, alone.view(2, 5, heads, d // heads).transpose(1, 2), rtol=1e-6, atol=1e-6)
    # cross-attention's K, V: one (d, 2d) matmul over H_enc
    cross = MultiHeadAttention(d, heads, cross=True)
    k, v = cross.project_kv(x)
    W, b = cross.kv_proj.weight, cross.kv_proj.bias
    torch.testing.assert_close(k, cross.split_heads(F.linear(x, W[:d], b[:d])), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, cross.split_heads(F.linear(x, W[d:], b[d:])), rtol=1e-6, atol=1e-6)


def test_fused_gated_ffn_equals_unfused():
    """[W_1; W_3] x as one matmul: FFN(x) = W_2 (act(W_1 x) * W_3 x) unchanged, gradients too."""
    torch.manual_seed(0)
    ffn = FeedForward(16, 24, "gelu", 0.0, gated=True)
    keys = set(ffn.state_dict())
    fused = copy.deepcopy(ffn)
    fused.fuse_matmuls()
    assert fused.w_13.weight.shape == (48, 16) and fused.w_1 is None and fused.w_3 is None
    assert set(ffn.state_dict()) == keys  # the model's own module keeps its keys
    x = torch.randn(3, 7, 16)
    expected = ffn.w_2(F.gelu(ffn.w_1(x)) * ffn.w_3(x))  # the formula, written out
    torch.testing.assert_close(ffn(x), expected)
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-6)
    plain = FeedForward(16, 24, "relu", 0.0)  # nothing to fuse: W_1 and W_2 run one after the other
    plain.fuse_matmuls()
    assert plain.w_13 is None and plain.w_1 is not None


def _gated_model():
    cfg = ModelConfig(d_model=16, heads=2, enc_layers=1, dec_layers=1, d_ff=24, gated_ffn=True, dropout=0.0,
                      attention_dropout=0.0)
    torch.manual_seed(0)
    return make_model(cfg, 40, 40, 0)


def test_working_copy_gradients_flow_back_into_the_masters():
    """A working copy in fp32 (fused gated FFN) gives the masters exactly the gradients of the
    model itself; in bf16 they are close, and the masters and their gradients stay fp32."""
    model = _gated_model()
    src = torch.randint(4, 40, (3, 6))
    tgt_in, tgt_out = torch.randint(4, 40, (3, 5)), torch.randint(4, 40, (3, 5))

    def loss_of(m):
        return F.cross_entropy(m(src, tgt_in).reshape(-1, 40).float(), tgt_out.reshape(-1))

    loss_of(model).backward()
    direct = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for dtype in (torch.float32, torch.bfloat16):
        work = Bf16Copy(model, dtype)
        assert any(n.endswith("ffn.w_13.weight") for n, _ in work.module.named_parameters())
        work.refresh()
        loss_of(work.module).backward()
        work.accumulate_grads()
        assert all(p.grad is None for p in work.module.parameters())
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, n
            if dtype == torch.float32:
                torch.testing.assert_close(p.grad, direct[n], rtol=1e-5, atol=1e-6)
            else:  # bf16 rounds every activation (~3 significant digits): the same direction
                assert float(F.cosine_similarity(p.grad.flatten(), direct[n].flatten(), dim=0)) > 0.98, n
        model.zero_grad(set_to_none=True)


def test_bf16_master_weights_train_like_fp32(prepared, tmp_path):
    """30 updates on the same batches: the bf16 path's losses stay close to fp32's, its masters and
    AdamW moments stay fp32, and the working copy is bf16 (refreshed from the masters each update)."""
    losses, trainers = {}, {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(prepared, [*NO_DROPOUT, f"train.precision={precision}", "train.warmup_steps=10",
                                     "train.max_tokens=300"])
        t = make_trainer(cfg, tmp_path / precision, show_progress=False)
        batches = [t.train_data.batch(idx) for idx in t.epoch_batches(0)[:10]]
        per_token = []
        for step in range(30):
            b = batches[step % len(batches)]
            loss, ok, (n_tgt, *_) = t.train_step([b])
            assert ok
            t.state.step += 1
            per_token.append(float(loss) / n_tgt)
        losses[precision], trainers[precision] = per_token, t
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert fp32[-1] < fp32[0] - 0.5 and bf16[-1] < bf16[0] - 0.5  # both learn
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.02, (fp32, bf16)  # measured: 0.003
    t = trainers["bf16"]
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(v.dtype == torch.float32 for s in t.optimizer.state.values() for k, v in s.items() if k != "step")
    assert all(p.dtype == torch.bfloat16 for p in t.work.parameters())
    master = t.model.tgt_embed.weight
    torch.testing.assert_close(t.work.tgt_embed.weight.float(), master, rtol=1e-2, atol=1e-2)  # one update behind
    t.bf16.refresh()
    assert torch.equal(t.work.tgt_embed.weight, master.to(torch.bfloat16))


def test_bf16_run_writes_fp32_weights_with_the_usual_keys(prepared, tmp_path):
    from safetensors.torch import load_file

    fp32 = train(load_config(prepared, ["train.max_steps=2", "train.validate_every=2"]), tmp_path / "a",
                 show_progress=False)
    bf16 = train(load_config(prepared, ["train.max_steps=2", "train.validate_every=2", "train.precision=bf16"]),
                 tmp_path / "b", show_progress=False)
    a, b = load_file(str(fp32 / "model.safetensors")), load_file(str(bf16 / "model.safetensors"))
    assert a.keys() == b.keys() and all(t.dtype == torch.float32 for t in b.values())


# --------------------------------------------------------------------------- #
# The GPU path, run on the CPU: non-finite updates skipped by fused AdamW on the device
# --------------------------------------------------------------------------- #

def test_device_side_skip_leaves_weights_and_moments(prepared, tmp_path, monkeypatch):
    import s2s.trainer

    monkeypatch.setattr(s2s.trainer, "skips_on_device", lambda device: True)
    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i == 1))
    t = make_trainer(load_config(prepared, NO_DROPOUT), tmp_path / "run", show_progress=False)
    assert t.optimizer.defaults["fused"]
    b = t.train_data.batch(t.epoch_batches(0)[0])
    window = LogWindow()
    loss, _, counts = t.train_step([b])  # finite: applied
    window.add(loss, *counts[1:])
    before = [p.detach().clone() for p in t.model.parameters()]
    moments = {k: v.clone() for k, v in t.optimizer.state[next(t.model.parameters())].items()}
    loss, ok, counts = t.train_step([b])  # NaN: skipped on the device, nothing read back
    assert ok and float(loss) == 0.0 and int(t.skipped) == 1 and int(t.skipped_in_a_row) == 1
    assert counts[:2] == (b.n_tgt_tokens, b.n_tgt_tokens + b.n_src_tokens) and int(counts[2]) == 0
    applied = window.mean_loss()
    window.add(loss, *counts[1:])
    assert window.mean_loss() == pytest.approx(applied)  # the skipped update's tokens are not in the mean
    assert all(torch.equal(p, q) for p, q in zip(t.model.parameters(), before))
    for k, v in t.optimizer.state[next(t.model.parameters())].items():
        assert torch.equal(v, moments[k]), k
    t.train_step([b])  # finite again: applied, the run of bad ones ends
    assert int(t.skipped) == 1 and int(t.skipped_in_a_row) == 0
    assert not all(torch.equal(p, q) for p, q in zip(t.model.parameters(), before))


def test_device_side_skips_are_reported_at_log_lines(prepared, tmp_path, monkeypatch, caplog):
    import s2s.trainer

    monkeypatch.setattr(s2s.trainer, "skips_on_device", lambda device: True)
    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i in (1, 2)))
    train(load_config(prepared), tmp_path / "run", show_progress=False)
    assert "step 2: 1 update(s) with a non-finite loss or gradient skipped since the last report (1 in all)" \
        in caplog.text
    monkeypatch.setattr(s2s.trainer, "batch_objective", nan_on(lambda i: i >= 2))
    monkeypatch.setattr(s2s.trainer, "MAX_BAD_UPDATES", 3)
    with pytest.raises(S2SError, match="3 non-finite updates in a row up to step 5"):
        train(load_config(prepared), tmp_path / "run2", show_progress=False)
