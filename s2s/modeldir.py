"""A model directory: everything ``s2s translate -m DIR`` needs, nothing executable.

    DIR/config.yaml         the resolved experiment config
    DIR/spm*.model          the SentencePiece model(s)
    DIR/model.safetensors   the weights of the uncompiled model
    DIR/model.json          format version, s2s version, sha256 of the weights, step, metrics

A training run directory is itself a model directory (holding its best
weights); the run's training checkpoints live in DIR/checkpoints/ (s2s.checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from s2s import __version__
from s2s.config import DecodeConfig, ExperimentConfig, ModelConfig, load_config, replace, to_dict, to_yaml
from s2s.errors import ConfigError, S2SError
from s2s.outdir import check_output_dir, output_dir
from s2s.textio import atomic_write, file_sha256, os_reason
from s2s.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported where weights are touched: `s2s info` reads configs only
    import torch

    from s2s.model import S2SModel

FORMAT_VERSION = 1
log = logging.getLogger("s2s")

WEIGHTS = "model.safetensors"
SHORTLIST = "shortlist.safetensors"  # s2s.shortlist's table (s2s shortlist), beside the weights
META = "model.json"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"  # a run directory's checkpoints/step-N (s2s.checkpoint)


def vocab_sizes(cfg: ExperimentConfig, tok: Tokenizer) -> tuple[int, int]:
    """Rows of the source and target tables: model.vocab_size, else the tokenizer's sizes."""
    if cfg.model.vocab_size:
        if max(tok.src_vocab_size, tok.tgt_vocab_size) > cfg.model.vocab_size:
            raise S2SError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                           f"{max(tok.src_vocab_size, tok.tgt_vocab_size)} ids")
        return cfg.model.vocab_size, cfg.model.vocab_size
    return tok.src_vocab_size, tok.tgt_vocab_size


def available_memory() -> int:
    """Bytes that can be allocated now: MemAvailable + SwapFree (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MAX_TENSOR_ELEMENTS = 2**63 - 1  # torch indexes tensor elements with int64


def count_model_parameters(cfg: ExperimentConfig, src_v: int, tgt_v: int) -> int:
    """Parameters of the model ``cfg`` describes, counted from the config (nothing allocated,
    no torch); a count past what a tensor can index is an error naming the largest size key."""
    from s2s.params import parameter_count

    n = parameter_count(cfg.model, src_v, tgt_v)
    if n > MAX_TENSOR_ELEMENTS:
        raise S2SError(f"{_largest_size_key(cfg, tgt_v)}: the model's tensors are too large to "
                       f"exist ({n:.3g} parameters)")
    return n


def _largest_size_key(cfg: ExperimentConfig, vocab: int) -> str:
    m = cfg.model
    sizes = {"model.d_model": m.d_model, "model.d_ff": m.d_ff, "model.heads": m.heads,
             "model.head_dim": m.head_dim, "model.enc_layers": m.enc_layers, "model.dec_layers": m.dec_layers,
             "model.vocab_size" if m.vocab_size else "tokenizer.vocab_size": vocab}
    if m.positions == "learned":
        sizes["model.max_positions"] = m.max_positions
    key = max(sizes, key=sizes.get)
    return f"{key}={sizes[key]}"


# the initialisers a model's modules draw their parameters with (torch.nn.init; s2s.model's own
# reset_parameters and nn.Linear's, nn.Embedding's and nn.LayerNorm's call them)
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


_init_lock = threading.Lock()
_init_state = {"users": 0, "drawn": {}}  # blocks open in any thread; torch's own initialisers meanwhile
_init_local = threading.local()  # .skipping: blocks open in this thread


@contextlib.contextmanager
def skipped_init():
    """Build modules without drawing their parameters: in this thread every torch.nn.init
    initialiser returns its tensor as it is, for a model whose every parameter is loaded right
    after (the weights of a model directory: :func:`load_weights` refuses a file that misses
    one).  Building the reference model took 0.06-0.09 s with its draws, 0.003 s without
    (benchmarks/README.md, the AMX Xeon again); each translate worker builds it before its first line.
    While a block is open the initialisers are swapped for stand-ins that draw as torch's do
    in every other thread, so a model built elsewhere meanwhile is initialised as always."""
    import torch

    with _init_lock:
        if _init_state["users"] == 0:
            _init_state["drawn"] = {n: getattr(torch.nn.init, n) for n in INITIALISERS if hasattr(torch.nn.init, n)}
            for name, fn in _init_state["drawn"].items():
                setattr(torch.nn.init, name, _stand_in(fn))
        _init_state["users"] += 1
    _init_local.skipping = getattr(_init_local, "skipping", 0) + 1
    try:
        yield
    finally:
        _init_local.skipping -= 1
        with _init_lock:
            _init_state["users"] -= 1
            if _init_state["users"] == 0:
                for name, fn in _init_state["drawn"].items():
                    setattr(torch.nn.init, name, fn)


def _stand_in(draw):
    """``draw`` (a torch.nn.init initialiser), except in a thread inside :func:`skipped_init`,
    where the tensor is left as it is."""

    def initialiser(tensor, *args, **kwargs):
        if getattr(_init_local, "skipping", 0):
            return tensor
        return draw(tensor, *args, **kwargs)

    return initialiser


def build_model(cfg: ExperimentConfig, tok: Tokenizer, init: bool = True) -> S2SModel:
    """The model a config describes, sized to the tokenizer's vocabularies; one whose fp32
    weights (4 bytes a parameter) exceed the memory available is refused before allocating.
    ``init`` False: its parameters are left undrawn (:func:`skipped_init`), for weights loaded
    right after."""
    src_v, tgt_v = vocab_sizes(cfg, tok)
    n = count_model_parameters(cfg, src_v, tgt_v)
    if 4 * n > available_memory():
        raise S2SError(f"{_largest_size_key(cfg, tgt_v)}: the model has {n:,} parameters, "
                       f"{4 * n / 2**30:,.1f} GiB of fp32 weights, more than the "
                       f"{available_memory() / 2**30:,.1f} GiB of memory available")
    from s2s.model import make_model

    if init:
        return make_model(cfg.model, src_v, tgt_v, tok.pad_id)
    with skipped_init():
        return make_model(cfg.model, src_v, tgt_v, tok.pad_id)


def write_config(directory: Path, cfg: ExperimentConfig) -> None:
    with atomic_write(directory / CONFIG) as f:
        f.write(to_yaml(cfg))


def copy_tokenizer(cfg: ExperimentConfig, src_dir: Path, directory: Path) -> None:
    for p in Tokenizer.all_files(src_dir, cfg.tokenizer, cfg.data):
        target = directory / p.name
        if p.resolve() != target.resolve():
            with atomic_write(target, "wb") as f:
                f.write(p.read_bytes())


def check_finite(model: torch.nn.Module, path: Path) -> None:
    """A non-finite parameter is never written: it would poison every later resume."""
    import torch

    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise S2SError(f"{path}: not written, parameter {name} holds NaN or Inf "
                           "(resume from the last checkpoint with a lower train.lr)")


def save_weights(model: torch.nn.Module, path: Path) -> str:
    """Write safetensors atomically; return the file's sha256."""
    from safetensors import SafetensorError

    check_finite(model, path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        digest = write_weights(model, tmp)
        tmp.replace(path)
    except (OSError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        raise S2SError(f"{path}: write failed ({write_error(e)})") from None
    return digest


def write_weights(model: torch.nn.Module, path: Path) -> str:
    """Write and fsync safetensors (no checks, not atomic); return the sha256.  A failed
    write raises OSError, also when safetensors reports it (SafetensorError)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model as st_save_model

    try:
        st_save_model(model, str(path))
    except SafetensorError as e:
        raise OSError(errno.EIO, write_error(e), str(path)) from None
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return file_sha256(path)


def write_error(e: Exception) -> str:
    """The reason of a failed write: an OSError's strerror, or the OS error inside a SafetensorError
    (``Error while serializing: I/O error: No space left on device (os error 28)``)."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    m = re.search(r"os error (\d+)", str(e))
    return os.strerror(int(m.group(1))) if m else str(e).splitlines()[0]


def save_model_dir(directory: Path, model: torch.nn.Module, cfg: ExperimentConfig,
                   tokenizer_dir: Path, info: Optional[dict] = None) -> None:
    """Write (or refresh) a complete model directory.

    The new weights and model.json are both written and synced under temporary
    names first, then renamed back to back, so a crash at any point leaves the
    previous model or the new one, never weights that fail their checksum
    (but for the microseconds between the two renames).
    """
    directory.mkdir(parents=True, exist_ok=True)
    write_config(directory, cfg)
    copy_tokenizer(cfg, tokenizer_dir, directory)
    new_weights, new_meta = directory / f".{WEIGHTS}.new", directory / f".{META}.new"
    try:
        digest = save_weights(model, new_weights)
        meta = {"format": FORMAT_VERSION, "s2s_version": __version__, "sha256": digest, **(info or {})}
        if cfg.tokenizer.lang_scheme != "none":  # a multilingual model (s2s.langs) says which languages
            meta["languages"] = language_record(cfg)
        if getattr(cfg, "decode_keys", None) is not None:  # see s2s.config.load_training_config
            meta["decode_keys"] = sorted(cfg.decode_keys)
        with open(new_meta, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(new_weights, directory / WEIGHTS)
        os.replace(new_meta, directory / META)
    except OSError as e:
        raise S2SError(f"{directory}: cannot write the model ({os_reason(e, directory / WEIGHTS)})") from None
    finally:
        new_weights.unlink(missing_ok=True)
        new_meta.unlink(missing_ok=True)


@dataclass
class LoadedModel:
    model: S2SModel
    tokenizer: Tokenizer
    cfg: ExperimentConfig
    meta: dict
    directory: Path


def read_meta(directory: Path) -> dict:
    path = directory / META
    if not directory.exists():
        raise S2SError(f"{directory}: no such model directory")
    if not directory.is_dir():
        raise S2SError(f"{directory}: not a directory (expected a model directory)")
    if not path.is_file():
        raise S2SError(f"{path}: not found; {directory} is not a trained model directory "
                       "(training writes it at the first validation)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise S2SError(f"{path}: corrupted ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise S2SError(f"{path}: model format {meta.get('format') if isinstance(meta, dict) else '?'} "
                       f"is not supported by s2s {__version__} (expects format {FORMAT_VERSION})")
    return meta


def load_weights(model: torch.nn.Module, path: Path, sha256: Optional[str] = None) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_model as st_load_model

    if not path.is_file():
        raise S2SError(f"{path}: weights not found")
    if sha256 is not None and file_sha256(path) != sha256:
        raise S2SError(f"{path}: checksum mismatch (file corrupted or modified)")
    try:
        missing, unexpected = st_load_model(model, str(path), strict=False)
    except RuntimeError as e:  # torch's "Error(s) in loading state_dict": name the tensor and shapes
        wrong = shape_mismatches(model, path)
        if not wrong:
            raise S2SError(f"{path}: cannot load weights ({str(e).splitlines()[0]})") from None
        name, expected, found = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors)" if len(wrong) > 1 else ""
        raise S2SError(f"{path}: tensor {name} has shape {found} but the model's config.yaml expects "
                       f"{expected}{more}; the config does not match these weights") from None
    except (SafetensorError, OSError) as e:
        raise S2SError(f"{path}: cannot load weights ({str(e).splitlines()[0]})") from None
    if missing or unexpected:  # (lists or sets, by safetensors' version)
        raise S2SError(f"{path}: weights do not match the config "
                       f"(missing: {', '.join(sorted(missing)[:3]) or '-'}; "
                       f"unexpected: {', '.join(sorted(unexpected)[:3]) or '-'})")


def shape_mismatches(model: torch.nn.Module, path: Path) -> list[tuple[str, tuple, tuple]]:
    """(name, shape the model expects, shape in the file) for each tensor present in both
    whose shapes differ, in the model's order."""
    from safetensors import safe_open

    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = []
    with safe_open(str(path), framework="pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            wrong.append((name, shape, found[name]))
    return wrong


def run_dir_of(path: Path) -> Path:
    """The directory holding config.yaml and the tokenizer for a checkpoint (RUN/checkpoints/step-N:
    RUN) or a model directory (itself, with its model.json, even in a folder named checkpoints)."""
    return path.parent.parent if path.parent.name == CHECKPOINTS and not (path / META).exists() else path


def explicit_decode_keys(directory: str | Path) -> Optional[frozenset[str]]:
    """The decode keys a model's training config set on purpose (its YAML or --set), as
    recorded in model.json's ``decode_keys``; None for a model directory without the record."""
    try:
        meta = json.loads((Path(directory) / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = meta.get("decode_keys") if isinstance(meta, dict) else None
    return frozenset(keys) if isinstance(keys, list) else None


def decode_settings(model: DecodeConfig, overrides: Mapping[str, Any],
                    defaults: Mapping[str, Any] = {}, explicit: Optional[frozenset[str]] = None) -> DecodeConfig:
    """The decode settings of a run: the model's, then ``defaults`` for each key the model
    did not choose (``explicit``: the keys its training config set; None, for a model
    directory that does not record them: each key still at DecodeConfig's default),
    then ``overrides``.  ``sampling: true`` among the overrides also means beam 1, nbest 1
    and no coverage penalty unless the overrides say otherwise; a sampling setting among them
    without sampling is refused.  Errors name the key."""
    untouched = DecodeConfig()
    chosen = (lambda k: k in explicit) if explicit is not None else \
        (lambda k: getattr(model, k) != getattr(untouched, k))
    changes = {**{k: v for k, v in defaults.items() if not chosen(k)}, **overrides}
    if overrides.get("sampling") is True:
        changes = {"beam": 1, "nbest": 1, "coverage_penalty": 0.0, **changes}
    try:
        decode = replace(model, "decode.", **changes)
    except ConfigError as e:
        raise S2SError(f"translate options: {e}") from None
    for key in ("temperature", "top_k", "top_p"):  # given for a search, they would do nothing
        if key in overrides and not decode.sampling and getattr(decode, key) != getattr(untouched, key):
            raise S2SError(f"translate options: decode.{key}: shapes the distribution sampling draws from; "
                           "a search ignores it (add --sampling, decode.sampling)")
    return decode


def model_decode_settings(directory: str | Path, cfg: ExperimentConfig, overrides: Mapping[str, Any],
                          defaults: Mapping[str, Any] = {}) -> DecodeConfig:
    """The decode settings a model (or run) directory with config ``cfg`` decodes with:
    :func:`decode_settings` with the keys its training chose (:func:`explicit_decode_keys`).
    A translator and the workers' parent, which cuts tasks by them, both read them here."""
    return decode_settings(cfg.decode, overrides, defaults, explicit_decode_keys(directory))


def position_table(model: ModelConfig) -> Optional[int]:
    """The positions a source (or a target) may take in a learned position table: all of it,
    or half for one stack over [x; y] (prefix_lm, decoder_only); None without one."""
    if model.positions != "learned":
        return None
    return model.max_positions // (1 if model.arch == "encoder_decoder" else 2)


def output_cap(model: ModelConfig, decode: DecodeConfig) -> int:
    """The longest output: decode.max_output_tokens, and the learned position table's rows."""
    table = position_table(model)
    return decode.max_output_tokens if table is None else min(decode.max_output_tokens, table - 1)


def warn_past_output_cap(model: ModelConfig, decode: DecodeConfig) -> None:
    """A warning where decode.max_len_b alone goes past :func:`output_cap` (outputs stop there)."""
    cap = output_cap(model, decode)
    if decode.max_len_b > cap:
        table = position_table(model)
        log.warning("decode.max_len_b: %d is more than the %d output tokens %s allows; outputs stop there",
                    decode.max_len_b, cap, "the model's learned position table"
                    if table is not None and table - 1 < decode.max_output_tokens else "decode.max_output_tokens")


def input_cap(model: ModelConfig, decode: DecodeConfig) -> int:
    """The most source tokens a translator takes: decode.max_input_tokens, and no more than
    a learned position table's share (:func:`position_table`)."""
    table = position_table(model)
    return decode.max_input_tokens if table is None else min(decode.max_input_tokens, table)


def load_spec(directory: Path) -> tuple[ExperimentConfig, Tokenizer]:
    """The config and tokenizer a model or run directory holds."""
    cfg = load_config(directory / CONFIG)
    for p in Tokenizer.all_files(directory, cfg.tokenizer, cfg.data):
        if not p.is_file():  # a trained model's tokenizer cannot be trained again: the copy is incomplete
            raise S2SError(f"{p}: missing; the model directory {directory} is incomplete "
                           "(copy it again from where it was trained or exported)")
    return cfg, Tokenizer.load(directory, cfg.tokenizer, cfg.data)


def verified_meta(directory: Path) -> dict:
    """model.json of a model directory, its weights (where the file is there) checked against
    the checksum it records; a mismatch is an error naming the file."""
    meta = read_meta(directory)
    weights = directory / WEIGHTS
    if weights.is_file() and file_sha256(weights) != meta.get("sha256"):
        time.sleep(1.0)  # a training run may be between renaming the weights and model.json
        meta = read_meta(directory)
        if file_sha256(weights) != meta.get("sha256"):
            raise S2SError(f"{weights}: checksum mismatch (file corrupted or modified)")
    return meta


def load_model_dir(directory: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    """Load config, tokenizer and verified weights of a model directory (eval mode), or of a
    training checkpoint RUN/checkpoints/step-N (config and tokenizer from RUN, the checksum
    from its state.json; ``directory`` of the result is then RUN)."""
    from s2s.checkpoint import is_checkpoint, recorded_sha256

    d = Path(directory)
    if is_checkpoint(d):
        run, digest = run_dir_of(d), recorded_sha256(d)
        cfg, tok = load_spec(run)
        model = build_model(cfg, tok, init=False)  # every parameter is loaded next
        load_weights(model, d / WEIGHTS, digest)
        model.to(device).eval()
        return LoadedModel(model=model, tokenizer=tok, cfg=cfg, meta={"checkpoint": str(d)}, directory=run)
    meta = verified_meta(d)
    cfg, tok = load_spec(d)
    model = build_model(cfg, tok, init=False)  # every parameter is loaded below
    load_weights(model, d / WEIGHTS)
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tok, cfg=cfg, meta=meta, directory=d)


def describe(path: str | Path) -> list[tuple[str, str]]:
    """Rows for ``s2s info``: the architecture, its exact parameter count and the
    budget P ~= 12 N_enc d^2 + 16 N_dec d^2 + V d (docs/model.md (20)) beside it."""
    from s2s.params import parameter_budget

    p = Path(path)
    meta = None
    if not p.exists():
        raise S2SError(f"{p}: no such model directory or config file")
    if p.is_dir():
        home = run_dir_of(p)  # a checkpoint RUN/checkpoints/step-N: its run's config and tokenizer
        step = re.fullmatch(r"step-(\d+)", p.name)
        meta = read_meta(p) if home == p else {"step": int(step[1])} if step else {}
        cfg, tok = load_spec(home)
        src_v, tgt_v = vocab_sizes(cfg, tok)
    else:
        cfg = load_config(p)
        src_v = tgt_v = cfg.model.vocab_size or cfg.tokenizer.vocab_size
    m = cfg.model
    n = count_model_parameters(cfg, src_v, tgt_v)  # from the config: no weights, no torch
    budget = parameter_budget(m, tgt_v)
    rows = [
        ("architecture", f"{m.arch}, {m.norm}-norm, {m.activation} FFN, {m.positions} positions"),
        ("layers", f"{m.enc_layers} encoder + {m.dec_layers} decoder" if m.arch == "encoder_decoder"
         else f"{m.enc_layers + m.dec_layers} blocks over [x; y]"),
        ("d_model / heads / d_head / d_ff", f"{m.d_model} / {m.heads} / {m.d_head} / {m.d_ff}"),
        ("vocabulary (src / tgt)", f"{src_v} / {tgt_v}"
                                   f"{', shared embeddings' if m.share_embeddings else ''}"
                                   f"{', tied output' if m.tie_output else ''}"),
        ("parameters", f"{n:,}"),
        ("budget 12·N_enc·d² + 16·N_dec·d² + V·d" if m.arch == "encoder_decoder"
         else "budget 12·(N_enc + N_dec)·d² + V·d", f"{budget:,}  (actual/budget = {n / budget:.3f})"),
    ]
    rows += language_rows(cfg)
    if meta and meta.get("imported_from"):
        rows.append(("imported", f"{meta.get('family')} checkpoint {meta['imported_from']}"))
    if meta and "step" in meta:
        rows.append(("trained", ", ".join(f"{k} {v}" for k, v in meta.items()
                                          if k in ("step", "dev_bleu", "dev_loss"))))
    return rows


def language_record(cfg: ExperimentConfig) -> dict:
    """model.json's "languages" of a multilingual model: pairs, scheme, target tokens, source token."""
    t = cfg.tokenizer
    return {"pairs": [f"{p.src_lang}-{p.tgt_lang}" for p in cfg.data.pairs], "scheme": t.lang_scheme,
            "tokens": list(t.lang_tokens), "src_token": t.src_lang_token}


def language_rows(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """`s2s info` rows of a multilingual model: its pairs (data.pairs) and its language tokens."""
    from s2s.langs import Languages

    rows = []
    if cfg.data.pairs:
        rows.append(("language pairs", ", ".join(f"{p.src_lang}-{p.tgt_lang}" for p in cfg.data.pairs)))
    t = cfg.tokenizer
    if t.lang_scheme != "none":
        langs = Languages(t.lang_scheme, t.lang_tokens, t.src_lang_token)
        rows.append((f"target languages ({t.lang_scheme})", langs.describe()))
        if t.src_lang_token:
            rows.append(("source language token", t.src_lang_token))
    if cfg.decode.tgt_lang:
        rows.append(("default --tgt-lang", cfg.decode.tgt_lang))
    return rows


def average_checkpoints(paths: list[str | Path], out: str | Path, force: bool = False) -> Path:
    """theta_avg = (1/n) sum_i theta_i over n checkpoints of one architecture,
    written as a model directory (config and tokenizer from the first one's run).

    ``out`` is never a run directory nor one holding an input (see s2s.outdir);
    ``force`` replaces an earlier ``average`` output there."""
    import torch

    with torch.no_grad():
        return _average_checkpoints(paths, out, force)


def check_same_architecture(d: Path, model: ModelConfig, first: Path, first_model: ModelConfig) -> None:
    """Weights average only between models of one architecture (dropout, a training setting, aside)."""
    mine, theirs = to_dict(model), to_dict(first_model)
    for key in mine:
        if not key.endswith("dropout") and mine[key] != theirs[key]:
            raise S2SError(f"{d}: model.{key} is {mine[key]!r} there but {theirs[key]!r} in {first}; "
                           "s2s average takes checkpoints of one architecture")


def _average_checkpoints(paths: list[str | Path], out: str | Path, force: bool) -> Path:
    from s2s.checkpoint import recorded_sha256

    if not paths:
        raise S2SError("average: no checkpoints given")
    dirs = [Path(p) for p in paths]
    inputs = list(dict.fromkeys([*dirs, *map(run_dir_of, dirs)]))
    check_output_dir(out, "average", force, inputs)
    digests = [recorded_sha256(d) for d in dirs]  # every input is checked before any work
    run = run_dir_of(dirs[0])
    cfg, tok = load_spec(run)
    model = build_model(cfg, tok)
    total: dict[str, torch.Tensor] = {}
    for d, digest in zip(dirs, digests):
        if run_dir_of(d) != run:
            check_same_architecture(d, load_config(run_dir_of(d) / CONFIG).model, dirs[0], cfg.model)
        load_weights(model, d / WEIGHTS, digest)
        for name, tensor in model.state_dict().items():
            total[name] = total.get(name, 0) + tensor.double()
    model.load_state_dict({name: (t / len(dirs)).float() for name, t in total.items()})
    target = Path(out)
    with output_dir(target, "average", force, inputs) as tmp:
        save_model_dir(tmp, model, cfg, run, {"averaged": [str(d) for d in dirs]})
    return target
