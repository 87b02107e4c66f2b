"""The model's forward passes on the meta device: the branches a GPU takes, run on every CPU.

CI has no GPU, and code paths gated on ``device.type == "cpu"`` (the fused CPU loss, the
oneDNN and C kernels) leave the others, CUDA's, unexercised there.  On the meta device
those others run (shapes only, no arithmetic), and a tensor made on the CPU and mixed into
the model's fails as it would on CUDA: by meta's own checks ("Tensor on device cpu is not
on the expected device meta!"), or, for the operators meta lets mix devices (an embedding's
or index_select's CPU index, a matmul), by :class:`OneDevice`, CUDA's rule.  Data-dependent
steps (``.item()``, a search's stop tests) cannot run on meta: the search's own device test
is tests/test_search.py's, with S2S_TEST_DEVICE=cuda on a GPU (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from s2s.config import ModelConfig
from s2s.model import make_model
from s2s.trainer import batch_objective

V, PAD = 40, 0
META = torch.device("meta")

VARIANTS = {
    "base": {},
    "post-norm, dropouts": dict(norm="post", attention_dropout=0.1, activation_dropout=0.1),
    "t5": dict(positions="t5_bias", norm_type="rmsnorm", gated_ffn=True, activation="gelu", bias=False,
               attention_scale=False, scale_embeddings=False, scale_output=True),
    "bart": dict(positions="learned", position_offset=2, embed_norm=True, output_bias=True),
    "untied": dict(share_embeddings=False, tie_output=False),
    "copy": dict(copy=True),
    "copy, coverage": dict(copy=True, coverage=True),
    "prefix_lm": dict(arch="prefix_lm"),
    "decoder_only": dict(arch="decoder_only"),
}


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


class OneDevice(TorchFunctionMode):
    """CUDA's rule, checked at every torch function called: its tensors on one device, but for
    0-dim CPU tensors, which elementwise operators take as scalars (not the indexing ones), for
    copies and moves between devices, and for indexing a tensor with CPU indices (``x[idx]``,
    ``x[idx] = v``; a CPU tensor indexed by a device's is an error, as is a CPU value)."""

    MOVES = {torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu}
    INDEXING = {torch.index_select, torch.Tensor.index_select, torch.gather, torch.Tensor.gather,
                torch.take_along_dim, torch.Tensor.take_along_dim, torch.embedding, F.embedding,
                torch.Tensor.scatter, torch.Tensor.scatter_, torch.Tensor.scatter_add_, torch.Tensor.index_add_,
                torch.Tensor.index_copy_, torch.Tensor.index_fill_, torch.Tensor.index_put_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            x, index = args[0], args[1]
            if x.device.type == "cpu" and any(i.device.type != "cpu" for i in _tensors(index)):
                raise RuntimeError(f"{name}: a CPU tensor indexed by tensors on another device")
            value = args[2] if len(args) > 2 else None
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != x.device:
                raise RuntimeError(f"{name}: a value on {value.device} set into a tensor on {x.device}")
        elif func not in self.MOVES:
            scalars_too = func in self.INDEXING
            devices = {x.device for x in _tensors((args, kwargs)) if scalars_too or x.dim() > 0}
            if len(devices) > 1:
                raise RuntimeError(f"{name}: tensors on devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _one_device():
    with OneDevice():
        yield


@pytest.fixture(autouse=True)
def _masked_positions_on_meta():
    """Training keeps the real target positions (``tgt_out[keep]``): a nonzero, which meta
    computes only when told to take every element as kept."""
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


def meta_model(**overrides):
    cfg = ModelConfig(d_model=16, heads=2, enc_layers=1, dec_layers=2, d_ff=32, **overrides)
    with META:
        return make_model(cfg, V, V, PAD)


def batch(B: int = 3, S: int = 7, T: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(1, V, (B, S), device=META), torch.randint(1, V, (B, T + 1), device=META))


def test_a_cpu_tensor_mixed_into_meta_fails():
    """The premise: what would fail on CUDA fails here, by meta's checks or by OneDevice's."""
    z = meta_model()(*batch())  # (3, 6, V)
    with pytest.raises(RuntimeError, match="device"):
        z + torch.ones(6, V)
    for meta_allows_it in (lambda: z.index_select(0, torch.tensor([0, 2])),
                           lambda: z.index_select(0, torch.tensor(1)),  # not a scalar to indexing
                           lambda: torch.ones(V, 4)[z.argmax(-1)]):  # a CPU table, device indices
        with pytest.raises(RuntimeError, match="device"):
            meta_allows_it()
    z * torch.tensor(2.0) + z[torch.tensor([0, 2, 1])]  # a 0-dim CPU tensor as a scalar; CPU indices


@pytest.mark.parametrize("coverage_weight", [0.0, 0.5])
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_step_on_meta(variant, coverage_weight):
    """Forward, label-smoothed loss (the head and the loss in one pass, or the scores then the
    loss) and backward: every gradient on the model's device."""
    if coverage_weight and variant in ("prefix_lm", "decoder_only"):
        pytest.skip("the coverage loss reads an encoder-decoder's cross-attention")
    model = meta_model(**VARIANTS[variant]).train()
    src, tgt = batch()
    loss, objective = batch_objective(model, src, tgt[:, :-1], tgt[:, 1:], PAD, 0.1, coverage_weight=coverage_weight)
    objective.backward()
    assert loss.device == META and loss.dim() == 0
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META for g in grads)


def test_distillation_step_on_meta():
    model = meta_model().train()
    src, tgt = batch()
    teacher = torch.randn(3 * 5, V, device=META)  # every position kept (the fixture)
    loss, _ = batch_objective(model, src, tgt[:, :-1], tgt[:, 1:], PAD, 0.1, teacher_scores=teacher,
                              kd_lambda=0.5, kd_temperature=2.0)
    loss.backward()
    assert loss.device == META


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", ["none", "every layer's", "the last layer's"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decoding_steps_on_meta(variant, weights, dtype):
    """encode, start_decoding and three steps of incremental decoding, as a search calls them;
    with the cross-attention weights (alignments, the coverage penalty) or without; in fp32 and
    with the weights in bf16 (--precision bf16 on a GPU)."""
    if weights != "none" and variant in ("prefix_lm", "decoder_only"):
        pytest.skip("one stack over [x; y] has no cross-attention")
    model = meta_model(**VARIANTS[variant]).to(dtype).eval()
    src, _ = batch()
    with torch.inference_mode():
        cache = model.start_decoding(model.encode(src))
        y = torch.ones(3, 1, dtype=torch.long, device=META)
        for _ in range(3):
            scores, A = model.decode_step(y, cache, need_weights=weights != "none",
                                          need_last=weights == "the last layer's")
    assert scores.shape == (3, V) and scores.device == META and scores.dtype in (dtype, torch.float32)
    if weights != "none":
        assert [a.shape for a in A if a is not None][-1] == (3, 2, 1, 7)
        assert all(a.device == META for a in A if a is not None)
