"""SentencePiece tokenizers: train, load, encode, decode.

Every vocabulary reserves the same ids: pad=0, unk=1, bos=2, eos=3, then the
sentinels <extra_id_0>.. (for span-corruption pretraining), then the pieces.
A joint vocabulary is one model ``spm.model``; separate ones are
``spm.{src_lang}.model`` and ``spm.{tgt_lang}.model``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import sentencepiece as spm

from s2s.config import DataConfig, ExperimentConfig, TokenizerConfig, config_from_dict, to_dict
from s2s.errors import S2SError
from s2s.langs import LanguageIds, Languages, target_tag
from s2s.outdir import check_data_dir
from s2s.textio import StagedFiles, atomic_write, read_lines, resolve_corpus, staged_files

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SETTINGS = "tokenizer.json"
log = logging.getLogger("s2s")


def truncate(ids: list[int], n: int) -> list[int]:
    """The first n-1 tokens and the final </s>: an over-long input cut to n tokens."""
    return ids if len(ids) <= n else ids[:n - 1] + ids[-1:]


def encode_source_lines(tok: "Tokenizer", lang: LanguageIds, lines: Sequence[str], line_nos: Sequence[int],
                        trained_src_tokens: int, max_input: int) -> list[Optional[list[int]]]:
    """Source ids per line (None for an empty line) as a translator feeds them to its model: cut
    to ``trained_src_tokens`` (data.max_src_tokens; 0: not) silently and to ``max_input`` with a
    warning naming the line (``line_nos``: each line's number), wrapped in the language tokens
    of ``lang`` (s2s.langs), whose rules each line is checked against first."""
    stripped = [line.strip() for line in lines]
    nonempty = [i for i, s in enumerate(stripped) if s]
    for i in nonempty:  # a multilingual model must be told its target language
        lang.check_line(stripped[i], f"line {line_nos[i]}")
    encoded = tok.encode_src([stripped[i] for i in nonempty])
    out: list[Optional[list[int]]] = [None] * len(lines)
    for i, ids in zip(nonempty, encoded):
        if trained_src_tokens:
            ids = truncate(ids, trained_src_tokens)
        limit = max_input - lang.extra  # room for the language tokens (s2s.langs)
        if len(ids) > limit:
            log.warning("line %d: %d tokens, truncated to the model's limit of %d",
                        line_nos[i], len(ids) + lang.extra, max_input)
            ids = truncate(ids, limit)
        out[i] = lang.wrap(ids, stripped[i])
    return out


def encode_forced_starts(tok: "Tokenizer", lang: LanguageIds, prefixes: Optional[Sequence[str]],
                        line_nos: Sequence[int], cap: int) -> Optional[list[list[int]]]:
    """Each output's forced start as a translator's search takes it (s2s.search.forced_tokens), or
    None (nothing forced): the target language's token where the model has one to force
    (``lang.tgt_first``), then the line's --prefix-file line as target pieces without </s> (an
    empty one forces nothing); ``prefixes`` and ``line_nos`` one per input line searched.  A
    start that leaves no room for </s> within ``cap`` output tokens (s2s.modeldir.output_cap)
    is an error naming its line."""
    from s2s.langs import with_forced

    starts = None
    if prefixes is not None:
        wanted = [p.strip() for p in prefixes]
        starts = [x[:-1] if p else [] for x, p in zip(tok.encode_tgt(wanted), wanted)]
    starts = with_forced(lang.tgt_first, starts, len(line_nos))
    for n, start in zip(line_nos, starts or []):
        if len(start) >= cap:
            what = (f"--prefix-file: line {n}: its prefix is {len(start)} target tokens, and" if prefixes is not None
                    else f"line {n}: the target language's token leaves no room for </s>:")
            raise S2SError(f"{what} the model's outputs stop at {cap} "
                           "(decode.max_output_tokens, or its position table)")
    return starts


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


@dataclass
class Tokenizer:
    """A source and a target SentencePiece model (the same object when joint).

    Model ids are the SentencePiece ids, or with ``vocab`` (piece -> id, an
    imported Marian vocabulary) the ids that map gives each piece.
    """

    src: spm.SentencePieceProcessor
    tgt: spm.SentencePieceProcessor
    joint: bool
    pad_id: int = PAD_ID
    unk_id: int = UNK_ID
    bos_id: int = BOS_ID  # the decoder's start symbol
    eos_id: int = EOS_ID
    vocab: Optional[dict[str, int]] = None
    prefix_id: int = -1  # put before every sequence (BART's <s>); -1: none
    extra_ids: int = 0  # sentinel ids past the SentencePiece pieces (an imported T5: 100)
    languages: Languages = field(default_factory=Languages)  # the model's language tokens (s2s.langs)

    def __post_init__(self) -> None:
        self._pieces = {i: p for p, i in self.vocab.items()} if self.vocab is not None else None
        self._prefix = [self.prefix_id] if self.prefix_id >= 0 else []
        self.whole = self.whole_tokens()
        self._lang_ids = {self.whole[t] for t in (*self.languages.tokens, self.languages.src_token) if t}
        alternatives = "|".join(map(re.escape, sorted(self.whole, key=len, reverse=True)))
        self._whole_re = re.compile(f"({alternatives})") if self.whole else None

    def token_id(self, token: str) -> int:
        """The model id of a token of the vocabulary (a language token, a sentinel), or -1."""
        if self.vocab is not None:
            return self.vocab.get(token, -1)
        i = self.src.piece_to_id(token)
        return -1 if i == self.src.unk_id() and token != self.src.id_to_piece(i) else i

    def whole_tokens(self) -> dict[str, int]:
        """Tokens kept whole wherever they are typed, each one id (transformers' added tokens):
        the language tokens, <mask> of a vocabulary that has one, an imported T5's sentinels
        (SentencePiece itself keeps the symbols `s2s tokenizer train` reserves whole)."""
        whole = {}
        for t in (*self.languages.tokens, self.languages.src_token):
            if t:
                whole[t] = self.token_id(t)
                if whole[t] < 0:
                    raise S2SError(f"tokenizer.lang_tokens: {t} is not a token of this tokenizer")
        if self.vocab is not None and "<mask>" in self.vocab:
            whole["<mask>"] = self.vocab["<mask>"]
        if self.extra_ids and self.vocab is None:
            n = self.src.get_piece_size()
            whole.update({sentinel(k): n + self.extra_ids - 1 - k for k in range(self.extra_ids)})
        return whole

    @property
    def specials(self) -> set[int]:
        """Ids that are no text: dropped when decoding (language tokens too)."""
        return {self.pad_id, self.bos_id, self.eos_id, *self._prefix, *self._lang_ids}

    @property
    def src_vocab_size(self) -> int:
        return max(self.vocab.values()) + 1 if self.vocab is not None else self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return max(self.vocab.values()) + 1 if self.vocab is not None else self.tgt.get_piece_size()

    def _pieces_ids(self, proc: spm.SentencePieceProcessor, lines: list[str]) -> list[list[int]]:
        if self.vocab is None:
            return proc.encode(lines)
        get, unk = self.vocab.get, self.unk_id
        return [[get(p, unk) for p in pieces] for pieces in proc.encode(lines, out_type=str)]

    def _encode(self, proc: spm.SentencePieceProcessor, lines: Sequence[str]) -> list[list[int]]:
        """Ids of each line: the tokens of :meth:`whole_tokens` where they are typed, the text
        between them (stripped) in pieces; a line without such tokens is encoded as it is."""
        lines = list(lines)
        if self._whole_re is None or not any(self._whole_re.search(line) for line in lines):
            return [self._prefix + ids + [self.eos_id] for ids in self._pieces_ids(proc, lines)]
        plans: list[list[tuple[bool, int]]] = []  # per line: (True, a whole token's id), (False, text index)
        texts: list[str] = []
        for line in lines:
            parts = self._whole_re.split(line)  # odd items: the captured tokens
            plan = []
            for k, part in enumerate(parts):
                if k % 2:
                    plan.append((True, self.whole[part]))
                elif part.strip() or len(parts) == 1:
                    plan.append((False, len(texts)))
                    texts.append(part if len(parts) == 1 else part.strip())
            plans.append(plan)
        encoded = self._pieces_ids(proc, texts)
        return [self._prefix + [i for is_id, v in plan for i in ([v] if is_id else encoded[v])] + [self.eos_id]
                for plan in plans]

    def encode_src(self, lines: Sequence[str]) -> list[list[int]]:
        """Source ids end with </s> (the encoder sees where the input stops)."""
        return self._encode(self.src, lines)

    def encode_tgt(self, lines: Sequence[str]) -> list[list[int]]:
        """Target ids y_1..y_m, with y_m = </s>; <s> is added when a Batch shifts them."""
        return self._encode(self.tgt, lines)

    def decode_tgt(self, ids: Iterable[int]) -> str:
        """Text of target ids; the specials are dropped, and so is any id that names no piece.
        SentencePiece ids n..n+extra_ids-1 past its n pieces are the sentinels, <extra_id_0>
        the last (transformers' T5Tokenizer), written out as their text."""
        specials = self.specials
        ids = [int(i) for i in ids if i not in specials]
        if self._pieces is not None:
            return self.tgt.decode_pieces([self._pieces[i] for i in ids if i in self._pieces])
        n = self.tgt.get_piece_size()
        if all(0 <= i < n for i in ids):
            return self.tgt.decode(ids)
        text, run = "", []  # runs of pieces decoded by SentencePiece, sentinels written between them
        for i in [*ids, None]:
            if i is not None and 0 <= i < n:
                run.append(i)
                continue
            if run:  # a run after a sentinel keeps the space its first piece starts with
                space = " " if text and self.tgt.id_to_piece(run[0]).startswith("\u2581") else ""
                text += space + self.tgt.decode(run)
                run = []
            if i is not None and n <= i < n + self.extra_ids:
                text += sentinel(n + self.extra_ids - 1 - i)
        return text

    def sentinel_ids(self) -> list[int]:
        """Ids of <extra_id_0>, <extra_id_1>, ... as far as the vocabulary has them."""
        ids = []
        for n in range(10_000):
            i = self.vocab.get(sentinel(n), -1) if self.vocab is not None else self.src.piece_to_id(sentinel(n))
            if i < 0 or i == self.unk_id:
                break
            ids.append(i)
        return ids

    def piece(self, i: int, side: str = "tgt") -> str:
        """The subword a model id stands for (for plots and alignments)."""
        if self._pieces is not None:
            return self._pieces.get(int(i), "<unk>")
        proc = self.src if side == "src" else self.tgt
        n = proc.get_piece_size()
        if n <= int(i) < n + self.extra_ids:
            return sentinel(n + self.extra_ids - 1 - int(i))
        return proc.id_to_piece(int(i)) if 0 <= int(i) < n else f"<id {int(i)}>"

    # ------------------------------------------------------------------ #
    @staticmethod
    def files(directory: Path, data: DataConfig, joint: bool, kind: str = "unigram") -> tuple[Path, Path]:
        if kind == "byte_bpe":
            return directory / "merges.txt", directory / "merges.txt"
        if joint:
            return directory / "spm.model", directory / "spm.model"
        return directory / f"spm.{data.src_lang}.model", directory / f"spm.{data.tgt_lang}.model"

    @classmethod
    def all_files(cls, directory: Path, tok: TokenizerConfig, data: DataConfig) -> list[Path]:
        """Every file of the tokenizer: the SentencePiece model(s) and the vocabulary map."""
        files = set(cls.files(directory, data, tok.joint, tok.type))
        if tok.vocab_file:
            files.add(directory / tok.vocab_file)
        return sorted(files)

    @classmethod
    def load(cls, directory: str | Path, tok: TokenizerConfig, data: DataConfig) -> "Tokenizer":
        directory = Path(directory)
        src_path, tgt_path = cls.files(directory, data, tok.joint, tok.type)
        for p in {src_path, tgt_path}:
            if not p.is_file():
                raise S2SError(f"{p}: tokenizer model not found (run `s2s tokenizer train CONFIG`)")
        vocab = _load_vocab(directory / tok.vocab_file, tok) if tok.vocab_file else None
        if tok.type == "byte_bpe":
            src = tgt = ByteLevelBPE(directory / tok.vocab_file, src_path)
        else:
            src = _load_model(src_path, tok, check_ids=vocab is None)
            tgt = src if tok.joint else _load_model(tgt_path, tok, check_ids=vocab is None)
        return cls(src=src, tgt=tgt, joint=tok.joint, pad_id=tok.pad_id, unk_id=tok.unk_id,
                   bos_id=tok.bos_id, eos_id=tok.eos_id, vocab=vocab, prefix_id=tok.prefix_id,
                   extra_ids=tok.extra_ids,
                   languages=Languages(tok.lang_scheme, tok.lang_tokens, tok.src_lang_token))


class ByteLevelBPE:
    """GPT-2's byte-level BPE (BART's tokenizer) through the tokenizers package: the
    calls of a SentencePieceProcessor that a Tokenizer with a vocabulary map makes."""

    def __init__(self, vocab: Path, merges: Path):
        try:
            from tokenizers import ByteLevelBPETokenizer, decoders
        except ImportError:
            raise S2SError(f"{merges}: a byte-level BPE tokenizer needs the tokenizers package "
                           "(pip install tokenizers)") from None
        try:
            self._tok = ByteLevelBPETokenizer(str(vocab), str(merges), add_prefix_space=False)
        except Exception as e:  # the Rust side raises its own exception type
            raise S2SError(f"{merges}: not a byte-level BPE merges file ({str(e).splitlines()[0]})") from None
        self._decoder = decoders.ByteLevel()

    def encode(self, lines: list[str], out_type=str) -> list[list[str]]:
        return [e.tokens for e in self._tok.encode_batch(lines, add_special_tokens=False)]

    def decode_pieces(self, pieces: list[str]) -> str:
        return self._decoder.decode(pieces)


def _load_model(path: Path, tok: TokenizerConfig, check_ids: bool = True) -> spm.SentencePieceProcessor:
    proc = spm.SentencePieceProcessor()
    try:
        proc.load(str(path))
    except (OSError, RuntimeError) as e:
        raise S2SError(f"{path}: not a valid SentencePiece model ({str(e).splitlines()[0]})") from None
    if not check_ids:
        return proc
    wrong = [f"{name}={want} (the model has {got})" for name, want, got in (
        ("pad_id", tok.pad_id, proc.pad_id()), ("unk_id", tok.unk_id, proc.unk_id()),
        ("eos_id", tok.eos_id, proc.eos_id())) if got != want and not (name == "pad_id" and got < 0)]
    if wrong:
        raise S2SError(f"{path}: SentencePiece ids disagree with tokenizer.{', '.join(wrong)}")
    return proc


def _load_vocab(path: Path, tok: TokenizerConfig) -> dict[str, int]:
    """A piece -> id JSON map; every special id must be in it."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise S2SError(f"{path}: vocabulary file not found (tokenizer.vocab_file)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise S2SError(f"{path}: not a JSON vocabulary ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
        raise S2SError(f"{path}: expected a JSON object mapping pieces to ids >= 0")
    ids = set(vocab.values())
    missing = [k for k in ("pad_id", "unk_id", "bos_id", "eos_id") if getattr(tok, k) not in ids]
    if missing:
        raise S2SError(f"{path}: no piece has tokenizer.{missing[0]}={getattr(tok, missing[0])}")
    return vocab


def _sample(lines: Iterable[str], limit: int, seed: int) -> tuple[list[str], int]:
    """Reservoir sample of at most ``limit`` non-empty lines, and the number of lines read."""
    rng = random.Random(seed)
    sample: list[str] = []
    n_lines = n = 0
    for line in lines:
        n_lines += 1
        if not line.strip():
            continue
        if len(sample) < limit:
            sample.append(line)
        else:
            j = rng.randint(0, n)
            if j < limit:
                sample[j] = line
        n += 1
    return sample, n_lines


@contextlib.contextmanager
def status(text: str, console=None) -> Iterator[None]:
    """A spinner with ``text`` and the elapsed time on stderr while the block runs, when stderr
    is a terminal (SentencePiece releases the GIL, so it turns during training); else nothing."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        bar.add_task(text, total=None)
        yield


def _train_one(sentences: list[str], out: Path, cfg: TokenizerConfig, staged: StagedFiles) -> int:
    """Train one SentencePiece model into ``out`` (a staged file); return its number of pieces."""
    model = io.BytesIO()
    try:
        with status(f"training SentencePiece {cfg.type} ({cfg.vocab_size:,} pieces) on "
                    f"{len(sentences):,} sentences for {out.name}"):
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=model,
                model_type=cfg.type, vocab_size=cfg.vocab_size,
                character_coverage=cfg.character_coverage, byte_fallback=cfg.byte_fallback,
                normalization_rule_name=cfg.normalization,
                remove_extra_whitespaces=cfg.normalization != "identity",
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
                user_defined_symbols=[sentinel(i) for i in range(cfg.sentinels)] + list(cfg.lang_tokens),
                hard_vocab_limit=False, num_threads=2, minloglevel=2,
                max_sentence_length=1 << 16, shuffle_input_sentence=True,
            )
    except RuntimeError as e:
        raise S2SError(f"{out}: SentencePiece training failed: {str(e).splitlines()[0]}") from None
    with staged.open(out, "wb") as f:
        f.write(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size()


def train_tokenizer(tok: TokenizerConfig, data: DataConfig, out_dir: Optional[str | Path] = None,
                    seed: int = 1) -> list[Path]:
    """Train SentencePiece on the training corpus; return the model files written."""
    out = Path(out_dir or data.dir)
    check_data_dir(out)  # before reading the corpora: a refusal costs nothing
    corpora = data.split_corpora("train")
    if not corpora:
        raise S2SError("data.train: no training corpus configured")
    src_lines, tgt_lines = [], []
    for prefix, src_lang, tgt_lang in corpora:  # several pairs: an equal share of sentences each
        src_file, tgt_file = resolve_corpus(prefix, src_lang), resolve_corpus(prefix, tgt_lang)
        limit = max(1, tok.max_sentences // len(corpora))
        src_sample, n_src = _sample(read_lines(src_file), limit, seed)
        tgt_sample, n_tgt = _sample(read_lines(tgt_file), limit, seed + 1)
        if n_src != n_tgt:
            raise S2SError(f"{src_file} has {n_src} lines but {tgt_file} has {n_tgt}: "
                           "a parallel corpus needs one line per sentence on both sides")
        for path, lines in ((src_file, src_sample), (tgt_file, tgt_sample)):
            if not lines:
                raise S2SError(f"{path}: no text to train the tokenizer on (the file is empty)")
        src_lines += src_sample
        tgt_lines += tgt_sample
    if tok.lang_scheme != "none" or tok.lang_tokens or tok.src_lang_token:
        raise S2SError("tokenizer.lang_scheme: s2s tokenizer train reserves language tags from data.pairs "
                       "itself; leave tokenizer.lang_scheme, lang_tokens and src_lang_token at their defaults")
    if data.pairs:  # the target-language tags <2xx>, one id each (Johnson et al. 2017)
        tok = dataclasses.replace(tok, lang_scheme="target_tag",
                                  lang_tokens=tuple(target_tag(t) for t in data.target_langs))
    src_path, tgt_path = Tokenizer.files(out, data, tok.joint)
    reserved = (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id, tok.vocab_file, tok.prefix_id)
    if reserved != (PAD_ID, UNK_ID, BOS_ID, EOS_ID, "", -1) or tok.type == "byte_bpe":
        raise S2SError("tokenizer: s2s trains SentencePiece (unigram or bpe) with pad_id 0, unk_id 1, "
                       "bos_id 2, eos_id 3, no vocab_file and no prefix_id; leave those keys at their defaults")
    with staged_files() as staged:  # the models and tokenizer.json appear together, or none does
        if tok.joint:
            sizes = {src_path: _train_one(src_lines + tgt_lines, src_path, tok, staged)}
        else:
            sizes = {src_path: _train_one(src_lines, src_path, tok, staged),
                     tgt_path: _train_one(tgt_lines, tgt_path, tok, staged)}
        trained = actual_vocab_size(tok, sizes)
        with staged.open(out / SETTINGS) as f:  # what was trained, flags included
            json.dump(dataclasses.asdict(trained), f, indent=2)
    return list(sizes)


def actual_vocab_size(tok: TokenizerConfig, sizes: dict[Path, int]) -> TokenizerConfig:
    """SentencePiece's soft limit (hard_vocab_limit=False) gives fewer pieces than asked when the
    corpus is small: warn, and record the size trained (the largest side's) instead of the one asked."""
    largest = max(sizes.values())
    for path, n in sizes.items():
        if n < tok.vocab_size:
            log.warning("tokenizer.vocab_size: %d asked, but the corpus gives %s only %d pieces "
                        "(SentencePiece's soft limit); recording vocab_size %d", tok.vocab_size, path, n, largest)
    return dataclasses.replace(tok, vocab_size=largest) if largest < tok.vocab_size else tok


def resolve_tokenizer_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The config with the tokenizer settings actually trained into ``data.dir``.

    ``s2s tokenizer train`` flags may override the YAML (``--separate``,
    ``--vocab-size``); what was trained is recorded in ``data.dir/tokenizer.json``
    and wins downstream, so prepare, train and the saved run config agree with it.
    With ``train.init_from`` the tokenizer and the model are the starting model's.
    """
    if cfg.train.init_from:
        return config_from_init(cfg)
    path = Path(cfg.data.dir) / SETTINGS
    if not path.is_file():
        return cfg
    try:
        trained = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise S2SError(f"{path}: corrupted ({e}); run `s2s tokenizer train CONFIG` again") from None
    raw = to_dict(cfg)
    if raw["tokenizer"] == trained:
        return cfg
    changed = [k for k in trained if raw["tokenizer"].get(k) != trained[k]]
    log.info("%s: using the trained tokenizer's %s", path,
             ", ".join(f"tokenizer.{k}={trained[k]!r}" for k in changed))
    raw["tokenizer"] = trained
    if not trained.get("joint", True):
        raw["model"]["share_embeddings"] = False  # two vocabularies cannot share one table
    return config_from_dict(raw, str(path))


def config_from_init(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fine-tuning: the config with the ``tokenizer`` and ``model`` sections of the model
    directory ``train.init_from``, whose tokenizer files are copied into ``data.dir``."""
    from s2s.config import load_config

    init = Path(cfg.train.init_from)
    if not (init / "config.yaml").is_file():
        raise S2SError(f"train.init_from: {init} is not a model directory (no config.yaml)")
    start = load_config(init / "config.yaml")
    out = Path(cfg.data.dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = list(zip(Tokenizer.files(init, start.data, start.tokenizer.joint, start.tokenizer.type),
                     Tokenizer.files(out, cfg.data, start.tokenizer.joint, start.tokenizer.type)))
    if start.tokenizer.vocab_file:
        pairs.append((init / start.tokenizer.vocab_file, out / start.tokenizer.vocab_file))
    for src, dst in dict(pairs).items():
        if not src.is_file():
            raise S2SError(f"{src}: not found (train.init_from's tokenizer)")
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            with atomic_write(dst, "wb") as f:
                f.write(src.read_bytes())
    raw = to_dict(cfg)
    if raw["tokenizer"] != to_dict(start)["tokenizer"] or raw["model"] != to_dict(start)["model"]:
        log.info("train.init_from: tokenizer and model settings of %s", init)
    raw["tokenizer"], raw["model"] = to_dict(start)["tokenizer"], to_dict(start)["model"]
    return config_from_dict(raw, f"{init}/config.yaml")
