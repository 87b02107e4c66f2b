"""The ``s2s`` command line: parse, build a config, call the library, print.

Results go to stdout, progress and logs to stderr, so every command works in
a pipe.  A bad input is one line ``s2s: error: ...`` and a non-zero exit
(``--debug`` shows the traceback).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from s2s import __version__
from s2s.config import decode_overrides, load_config, load_training_config
from s2s.errors import Interrupted, S2SError
from s2s.launch import DEFAULT_PRECISION

# --------------------------------------------------------------------------- #
# Help as people read it: CONFIG, not {config}; no <bool> on flags; <path> for a
# repeatable path, not <list[Path]>.
# --------------------------------------------------------------------------- #

def _readable(params: list, ctx) -> list:
    """Set the metavars typer leaves as internals (idempotent); ``params`` are click Parameters."""
    for p in params:
        if p.param_type_name == "argument" and p.metavar is None:
            p.metavar = p.name.upper()
        elif p.param_type_name == "option" and p.metavar is None and p.is_flag:
            p.metavar = ""  # a flag takes no value
        shown = p.display_type(ctx) if hasattr(p, "display_type") else ""
        one = re.fullmatch(r"<list\[(\w+)\]>", shown or "")
        if one:  # a repeatable option or argument: the type of one value
            p.display_type_rich = lambda ctx, t=f"<{one.group(1).lower()}>": t
    return params


def _usage_pieces(params: list) -> list[str]:
    """click's usage convention: CONFIG (required), [CONFIG] (optional), REFS... (repeated)."""
    pieces = []
    for p in params:
        if p.param_type_name == "argument":
            name = p.metavar + ("..." if p.nargs != 1 else "")
            pieces.append(name if p.required else f"[{name}]")
    return pieces


class _Command(TyperCommand):
    def get_params(self, ctx) -> list:
        return _readable(super().get_params(ctx), ctx)

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar, *_usage_pieces(self.get_params(ctx))]


class _PipeClosed(Exception):
    """stdout's reader went away (``| head``): a BrokenPipeError carried past typer, which would
    turn it into exit status 1, to ``run`` (status 141, as a tool killed by SIGPIPE)."""


def print_table(table) -> None:
    """A rich table on stdout; its reader gone is exit 141, as for any output (rich exits 1)."""
    from rich.console import Console

    class Stdout(Console):
        def on_broken_pipe(self) -> None:  # rich's documented hook
            self.quiet = True
            raise _PipeClosed

    Stdout().print(table)


class _Group(TyperGroup):
    def get_params(self, ctx) -> list:
        return _readable(super().get_params(ctx), ctx)

    def invoke(self, ctx):  # every command runs inside the top group's invoke
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            raise _PipeClosed from None


class _Typer(typer.Typer):
    """typer.Typer whose commands and groups print readable help (see _readable)."""

    def __init__(self, **kwargs):
        super().__init__(cls=_Group, **kwargs)

    def command(self, *args, **kwargs):
        return super().command(*args, cls=kwargs.pop("cls", _Command), **kwargs)


app = _Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
             help="Train and run encoder-decoder transformers for translation and summarization.")
tokenizer_app = _Typer(no_args_is_help=True, help="SentencePiece tokenizers.")
app.add_typer(tokenizer_app, name="tokenizer")
export_app = _Typer(no_args_is_help=True, help="Write a model for another engine.")
app.add_typer(export_app, name="export")
import_app = _Typer(no_args_is_help=True, help="Read a model of another toolkit.")
app.add_typer(import_app, name="import")

log = logging.getLogger("s2s")
_DEBUG = {"on": False}

class _StderrHandler(logging.StreamHandler):
    """Logs to whatever sys.stderr is at the time, so lines logged while rich's
    progress bar redirects stderr are printed above the bar, not through it."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def launched_rank() -> int:
    """This process's rank as torchrun describes it (RANK; 0 without torchrun), read before
    any process group exists (s2s.distributed.init_world makes the group).  Rank 0 alone
    speaks for a run: its stdout and progress logs; other ranks log only their own
    warnings and errors, prefixed with their rank."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


ForceOption = typer.Option(False, "--force", help="Replace an earlier output of this same command in -o "
                                                  "(never anything else: see s2s-output.json).")


# Options several commands share, in typer's Annotated style (the default sits in the signature)
ConfigArgument = Annotated[Path, typer.Argument(help="Experiment YAML.")]
RunDirOption = Annotated[Optional[Path], typer.Option(
    "-o", "--output", help="Run directory (default: output_dir of the config).")]
ResumeOption = Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint.")]
SetListOption = Annotated[Optional[List[str]], typer.Option(
    "--set", metavar="KEY=VALUE", help="Override a config key, e.g. --set model.d_model=512 (repeatable).")]
ModelOption = Annotated[Path, typer.Option("-m", "--model", help="Model directory.")]
DeviceOption = Annotated[str, typer.Option(help="auto (the GPU when torch sees one), cpu, cuda, cuda:N or mps.")]


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"s2s {__version__}")
        raise typer.Exit()


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors, and debug log lines."),
         quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on stderr."),
         version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print the version and exit.")):
    _DEBUG["on"] = debug
    configure_logging(launched_rank(), logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)


def configure_logging(rank: int, level: int) -> None:
    """s2s's log lines on stderr at ``level``.  Under torchrun (and in the ranks train.procs
    starts) rank 0 speaks; the others only warn, naming their rank."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"s2s: rank {rank}: %(message)s" if rank else "s2s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])  # other libraries: warnings only
    log.setLevel(max(level, logging.WARNING) if rank else level)


def _load(config: Path, overrides: Optional[List[str]]):
    return load_config(config, overrides or [])


# --------------------------------------------------------------------------- #
@tokenizer_app.command("train")
def tokenizer_train(
    config: Path = typer.Argument(..., help="Experiment YAML."),
    vocab_size: Optional[int] = typer.Option(None, help="Vocabulary size (tokenizer.vocab_size)."),
    type: Optional[str] = typer.Option(None, "--type", help="unigram or bpe (tokenizer.type)."),
    joint: Optional[bool] = typer.Option(None, "--joint/--separate",
                                         help="One vocabulary for both sides, or one each."),
    character_coverage: Optional[float] = typer.Option(None, help="tokenizer.character_coverage"),
    sentinels: Optional[int] = typer.Option(None, help="Reserved <extra_id_N> symbols."),
    set_: SetListOption = None,
):
    """Train SentencePiece on the config's training corpus; writes spm*.model into data.dir.

    Example: `s2s tokenizer train recipes/quickstart.yaml --vocab-size 8000 --type bpe`
    """
    from s2s.tokenizer import train_tokenizer

    overrides = list(set_ or [])
    for key, value in (("vocab_size", vocab_size), ("type", type), ("joint", joint),
                       ("character_coverage", character_coverage), ("sentinels", sentinels)):
        if value is not None:
            overrides.append(f"tokenizer.{key}={json.dumps(value)}")
    if joint is False:
        overrides.append("model.share_embeddings=false")  # two vocabularies, two embeddings
    cfg = _load(config, overrides)
    if cfg.train.init_from:
        raise S2SError(f"{config}: train.init_from is set, so the tokenizer is {cfg.train.init_from}'s "
                       "(`s2s prepare` copies it); there is none to train")
    for path in train_tokenizer(cfg.tokenizer, cfg.data, seed=cfg.seed):
        typer.echo(str(path))


@app.command()
def prepare(config: Path = typer.Argument(..., help="Experiment YAML."),
            workers: int = typer.Option(0, "--workers", "-j", min=0,
                                        help="Encoding processes (0: one per core); same output for any."),
            set_: SetListOption = None):
    """Clean, encode and binarize the corpora; prints pairs read, kept and dropped per reason.

    Example: `s2s prepare recipes/quickstart.yaml -j 4`
    """
    from rich.table import Table

    from s2s.data import DROP_REASONS
    from s2s.data import prepare as run_prepare

    cfg = _load(config, set_)
    stats = run_prepare(cfg, workers)
    table = Table(title=f"prepared into {cfg.data.dir}", caption="pairs; the last four columns: dropped")
    for col in ("split", "read", "kept", *DROP_REASONS):
        table.add_column(col, justify="right")
    for split, st in stats.items():
        table.add_row(split, str(st.read), str(st.kept), *(str(st.dropped[r]) for r in DROP_REASONS))
    print_table(table)


@app.command()
def train(config: ConfigArgument, output: RunDirOption = None, resume: ResumeOption = False,
          set_: SetListOption = None):
    """Train with teacher forcing; the run directory becomes a model directory.

    Example: `s2s train recipes/quickstart.yaml -o exp --set train.max_time=10m`
    """
    from s2s.trainer import train as run_train

    cfg = load_training_config(config, set_ or [])
    run_dir = run_train(cfg, output, resume=resume)
    if launched_rank() == 0:  # under torchrun, one line from rank 0
        typer.echo(str(run_dir))


@app.command()
def pretrain(config: Annotated[Path, typer.Argument(help="Experiment YAML (its pretrain section).")],
             output: RunDirOption = None, resume: ResumeOption = False, set_: SetListOption = None):
    """Denoising pretraining (pretrain.objective: span_corruption or bart) on the prepared text.

    Both sides of the training split are the documents; fine-tune from the run with train.init_from.

    Example: `s2s pretrain recipes/quickstart.yaml -o exp/pre --set pretrain.objective=bart`
    """
    from s2s.pretrain import pretrain as run_pretrain

    cfg = _load(config, set_)
    run_dir = run_pretrain(cfg, output, resume=resume)
    if launched_rank() == 0:  # under torchrun, one line from rank 0
        typer.echo(str(run_dir))


@app.command()
def distill(config: Path = typer.Argument(..., help="Experiment YAML whose data.train the teacher translates."),
            model: Path = typer.Option(..., "-m", "--model", help="The teacher's model directory."),
            output: str = typer.Option(..., "-o", "--output", help="Prefix of the distilled corpus: "
                                                                   "writes OUT.{src_lang} and OUT.{tgt_lang}."),
            beam: Optional[int] = typer.Option(None, "--beam", "-b", help="Beam size (default: the teacher's)."),
            device: DeviceOption = "auto",
            set_: SetListOption = None):
    """Sequence-level knowledge distillation: the teacher translates the training sources.

    Writes OUT.{src_lang} and OUT.{tgt_lang}, a corpus for a student (data.train: OUT).

    Example: `s2s distill recipes/quickstart.yaml -m exp/teacher -o prepared/kd/train`
    """
    from s2s.translate import distill_corpus

    cfg = _load(config, set_)
    overrides = {"beam": beam} if beam is not None else {}
    for path in distill_corpus(model, cfg, output, device, **overrides):
        typer.echo(str(path))


def parse_weights(text: Optional[str], members: int) -> Optional[list[float]]:
    """``--ensemble-weights 0.7,0.3``: one positive number per ``-m``."""
    if text is None:
        return None
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        raise S2SError(f"--ensemble-weights: {text!r} is not a comma-separated list of numbers") from None
    if len(weights) != members:
        raise S2SError(f"--ensemble-weights: {len(weights)} weights for {members} models (-m)")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise S2SError(f"--ensemble-weights: {text!r}: every weight must be a positive number")
    return weights


def _from_model(key: str, text: str) -> str:
    """Help of a translate option whose default is the model's own decode setting."""
    return f"{text} (default: the model's decode.{key})"


# The decode keys with a short flag of their own on translate/summarize (every other one:
# --set decode.KEY=VALUE); each names a DecodeConfig field, with its type (tests/test_cli.py checks).
DECODE_FLAGS = {
    "beam": "Beam size; 1 = greedy.",
    "alpha": "Length penalty exponent of lp(m).",
    "nbest": "Print the K best (with --sampling: K samples) as `LINE ||| TEXT ||| SCORE`.",
    "max_len_a": "Max output length a*|x|+b: a.",
    "max_len_b": "Max output length a*|x|+b: b.",
    "min_len": "Minimum output tokens before </s>.",
    "coverage_penalty": "beta of the coverage penalty (beam search; at --beam 1 a 1-beam search).",
    "seed": "Sampling: the same seed draws the same outputs.",
    "batch_tokens": "Source tokens per batch.",
    "tgt_lang": "Target language of a multilingual model: de for <2de>, >>de<<, __de__ or de_DE, "
                "or the model's exact token (`s2s info MODEL` lists them).",
}


def _decode_flag(key: str, *names: str):
    return typer.Option(*names, help=_from_model(key, DECODE_FLAGS[key]))


ModelsOption = Annotated[List[Path], typer.Option(
    "-m", "--model", help="Model directory (a training run) or training checkpoint; repeat for an ensemble.")]
DecodeSetOption = Annotated[Optional[List[str]], typer.Option(
    "--set", metavar="decode.KEY=VALUE",
    help="A decode setting, e.g. --set decode.no_repeat_ngram=3 (repeatable; keys as in the YAML's decode section).")]


def _decode_command(name: str, defaults: dict):
    """The translate command, or summarize (``defaults``: its decode keys for each one the
    model's training did not set): one signature, one library call."""

    def command(
        model: ModelsOption,
        ensemble_weights: Annotated[Optional[str], typer.Option(
            help="Ensemble: w_1,...,w_n, one per -m; p = sum_i w_i p_i with w normalized to sum 1.")] = None,
        input: Annotated[str, typer.Option("--input", "-i", help="Input file; - reads stdin.")] = "-",
        output: Annotated[Optional[str], typer.Option(
            "--output", "-o", help="Write here (complete files only) instead of stdout (-: stdout; ./- a file).")
        ] = None,
        resume: Annotated[bool, typer.Option(
            "--resume", help="Save the progress beside -o OUT chunk by chunk; the same command after a kill "
                             "continues where it stopped (needs -i FILE).")] = False,
        chunk_lines: Annotated[Optional[int], typer.Option(
            min=1, help="--resume: lines per saved chunk (default 1000).")] = None,
        set_: DecodeSetOption = None,
        beam: Annotated[Optional[int], _decode_flag("beam", "--beam", "-b")] = None,
        alpha: Annotated[Optional[float], _decode_flag("alpha")] = None,
        nbest: Annotated[Optional[int], _decode_flag("nbest")] = None,
        max_len_a: Annotated[Optional[float], _decode_flag("max_len_a")] = None,
        max_len_b: Annotated[Optional[int], _decode_flag("max_len_b")] = None,
        min_len: Annotated[Optional[int], _decode_flag("min_len")] = None,
        coverage_penalty: Annotated[Optional[float], _decode_flag("coverage_penalty")] = None,
        sampling: Annotated[bool, typer.Option(
            "--sampling", help="Sample each token instead of searching (beam 1; decode.sampling).")] = False,
        seed: Annotated[Optional[int], _decode_flag("seed")] = None,
        batch_tokens: Annotated[Optional[int], _decode_flag("batch_tokens")] = None,
        tgt_lang: Annotated[Optional[str], _decode_flag("tgt_lang", "--tgt-lang")] = None,
        prefix_file: Annotated[Optional[Path], typer.Option(
            help="Force each output to start with the same line of this file.")] = None,
        glossary: Annotated[Optional[Path], typer.Option(
            help="Lines `source term<TAB>target term`: an output whose source holds the term (whole words) "
                 "holds the target term (constrained beam search; decode.glossary).")] = None,
        threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 0,
        precision: Annotated[str, typer.Option(
            help="fp32; bf16 (weights converted; fast only with native bf16 matmuls); "
                 "auto: what was measured fastest on this kind of CPU: bf16 with amx_bf16, else fp32 "
                 "with int8 matrices with avx2 (and avx512_vnni with AVX-512), else bf16 where native, "
                 "else fp32; with fp32 where bf16 is native, a beam search's self-attention K/V in bf16. "
                 "A plain search runs without torch (s2s.native_search): in auto, in bf16 with "
                 "amx_bf16 and in int8 on the other CPUs with avx2; in bf16, with amx_bf16 or "
                 "avx512_bf16.")] = DEFAULT_PRECISION,
        compile: Annotated[bool, typer.Option(
            "--compile", help="torch.compile the decoder step (cached on disk; decode.compile).")] = False,
        shortlist: Annotated[bool, typer.Option(
            "--shortlist", help="Score only each batch's vocabulary shortlist (the model's shortlist.safetensors, "
                                "from `s2s shortlist`; decode.shortlist).")] = False,
        quantize: Annotated[Optional[str], typer.Option(
            help="int8: int8 copies of the linear layers and the output projection, used where "
                 "they are faster (CPU); a plain search with fp32 on a CPU with avx2 runs without "
                 "torch, every product in int8 (s2s.native_search).")] = None,
        unbuffered: Annotated[bool, typer.Option("--unbuffered", help="Translate and flush line by line.")] = False,
        split_sentences: Annotated[bool, typer.Option(
            "--split-sentences",
            help="Each line is a paragraph: split it into sentences (sentencex, the model's source "
                 "language), translate them, rejoin them on one line (decode.split_sentences).")] = False,
        markup: Annotated[bool, typer.Option(
            "--markup",
            help="Take inline tags (<b>…</b>, <a href=…>, <br/>) out before translating and put them "
                 "back where the alignment puts their words (decode.markup).")] = False,
        alignments: Annotated[bool, typer.Option(
            "--alignments", help="Append ` ||| j-t ...`: source subword j aligned to target subword t.")] = False,
        scores: Annotated[bool, typer.Option(
            "--scores", help="End each row in a TAB and its hypothesis's mean log-probability per token, "
                             "(1/m) sum_t log p(y_t), </s> counted (docs/model.md (51)); `cut -f1` drops it.")] = False,
        output_format: Annotated[str, typer.Option(
            "--format", help="text, or jsonl: one JSON object per input line with text, score, "
                             "alignment (--alignments) and nbest (--nbest), as `s2s serve` answers.")] = "text",
        errors: Annotated[str, typer.Option(help="Invalid UTF-8 input: strict (error) or replace.")] = "strict",
        workers: Annotated[int, typer.Option(help="Decoding processes, each with cores/N threads (0: one per core "
                                                  "on the CPU for inputs over 200 lines, one on a GPU; "
                                                  "--unbuffered: always one).")] = 0,
        device: DeviceOption = "auto",
    ):
        from s2s.workers import TranslatorSpec

        flags = dict(beam=beam, alpha=alpha, nbest=nbest, max_len_a=max_len_a, max_len_b=max_len_b,
                     min_len=min_len, coverage_penalty=coverage_penalty, seed=seed, batch_tokens=batch_tokens,
                     tgt_lang=tgt_lang)
        overrides = {**decode_overrides(set_, name), **{k: v for k, v in flags.items() if v is not None}}
        for key, on in (("sampling", sampling), ("compile", compile), ("shortlist", shortlist),
                        ("split_sentences", split_sentences), ("markup", markup)):
            if on:
                overrides[key] = True
        if glossary is not None:
            overrides["glossary"] = str(glossary)
        weights = parse_weights(ensemble_weights, len(model))
        spec = TranslatorSpec(tuple(str(m) for m in model), overrides, defaults, device, precision, quantize,
                              alignments, nbest_rows="nbest" in overrides, threads=threads,
                              weights=None if weights is None else tuple(weights),
                              scores=scores, output_format=output_format, lean_torch=True)
        out = None if output in (None, "-") else Path(output)  # -o - is stdout, as -i - is stdin
        translate_file(spec, input, out, prefix_file, errors, unbuffered, workers, resume, chunk_lines, name)

    command.__name__ = name
    return command


def translate_file(spec, input: str, output: Optional[Path], prefix_file: Optional[Path], errors: str,
                   unbuffered: bool, workers: int, resume: bool = False, chunk_lines: Optional[int] = None,
                   command: str = "translate") -> None:
    """Translate the lines of ``input`` (- for stdin) into ``output`` (None: stdout) as ``spec`` says;
    ``resume``: saving the progress beside ``output`` (s2s.bulk)."""
    from s2s.bulk import check_resumable, translate_resumable
    from s2s.textio import atomic_write, read_lines
    from s2s.workers import TranslateProgress, translate_stream

    if errors not in ("strict", "replace"):
        raise S2SError(f"--errors: {errors!r} is not strict or replace")
    check_streams(input, output, {"--prefix-file": prefix_file, "--glossary": spec.overrides.get("glossary")})
    if chunk_lines is not None and not resume:
        raise S2SError("--chunk-lines: only with --resume")
    spec.check()
    if input != "-" and not Path(input).exists():
        raise S2SError(f"{input}: no such file")
    if resume:
        check_resumable(input, output, unbuffered)
    interactive = unbuffered or (input == "-" and sys.stdin.isatty())
    lines = read_lines(input, errors)
    prefixes = None if prefix_file is None else read_lines(prefix_file, errors)
    progress = None if interactive else TranslateProgress()  # shows only when stderr is a terminal
    if progress is not None and input != "-":
        progress.count_lines_of(input)  # for the ETA
    try:
        if resume:
            translate_resumable(spec, Path(input), output, prefix_file, errors, workers, progress, chunk_lines,
                                command)
        elif output is not None:
            with atomic_write(output, follow_links=True) as f:
                translate_stream(spec, lines, f, workers, interactive, prefixes, progress)
        else:
            translate_stream(spec, lines, sys.stdout, workers, interactive, prefixes, progress)
    finally:
        if progress is not None:
            progress.close()


def check_streams(input: str, output: Optional[Path], others: dict[str, Optional[str | Path]]) -> None:
    """The files a translation reads besides its input (``others``: option -> path) read stdin only
    when the input does not, and ``output`` is none of them."""
    reads = {"-i": input, **{option: str(path) for option, path in others.items() if path is not None}}
    if input == "-":
        for option, path in reads.items():
            if option != "-i" and path == "-":
                raise S2SError(f"{option}: - is stdin, which the input (-i -) reads; give it as a file")
    if output is None or not output.is_file():
        return
    for option, path in reads.items():  # files only: -i /dev/stdin -o /dev/stdout is one terminal
        if path != "-" and Path(path).is_file() and os.path.samefile(path, output):
            raise S2SError(f"{output}: is the {'input' if option == '-i' else option} file; writing it would "
                           "destroy what is read; choose another -o")


# `s2s summarize`: translate with these for each decode key the model's training did not set
SUMMARIZE_DEFAULTS = {"no_repeat_ngram": 3, "min_len": 3, "alpha": 1.0}

app.command("translate", help=(
    "Translate stdin (or --input) line by line to stdout: exactly one output line per input line.\n\n"
    "Any decode key: --set decode.KEY=VALUE.\n\n"
    "Example: `s2s translate -m exp --beam 5 < test.en | s2s score - test.de`"))(
    _decode_command("translate", {}))
app.command("summarize", help=(
    "Summarize stdin (or --input) line by line: `translate` with summarization defaults "
    f"({', '.join(f'decode.{k}={v}' for k, v in SUMMARIZE_DEFAULTS.items())}) "
    "for each decode key the model's training config did not set.\n\n"
    "Example: `s2s summarize -m exp/summ < test.doc | s2s score - test.sum --metric rouge`"))(
    _decode_command("summarize", SUMMARIZE_DEFAULTS))


@app.command("shortlist", help=(
    "Build MODEL/shortlist.safetensors: for each source piece the k target pieces that co-occur with it "
    "best in the training pairs, plus the most frequent target pieces (`translate --shortlist`).\n\n"
    "Example: `s2s shortlist recipes/quickstart.yaml -m exp/quickstart --k 50 --frequent 200`"))
def shortlist_cmd(config: Path = typer.Argument(..., help="Experiment YAML: its prepared training data (data.dir)."),
                  model: Path = typer.Option(..., "-m", "--model", help="Model directory (same tokenizer)."),
                  k: int = typer.Option(50, "--k", help="Target pieces per source piece."),
                  frequent: int = typer.Option(200, "--frequent", help="The most frequent target pieces, always in."),
                  score: str = typer.Option("dice", "--score", help="dice: 2c(s,t)/(c(s)+c(t)); prob: c(s,t)/c(s)."),
                  set_: SetListOption = None):
    from s2s.shortlist import shortlist_from_data

    typer.echo(str(shortlist_from_data(_load(config, set_), model, k, frequent, score)))


@app.command()
def align(model: ModelOption,
          src: str = typer.Option(..., "--src", help="The source sentence."),
          tgt: Optional[str] = typer.Option(None, "--tgt", help="Its target (default: the model's translation)."),
          layer: Optional[int] = typer.Option(None, help="Decoder layer, 0-based or -1 for the last "
                                                        "(default: the mean over layers); heads are averaged."),
          output: Path = typer.Option(Path("attention.png"), "-o", "--output", help="PNG to write."),
          device: DeviceOption = "auto"):
    """Draw the cross-attention of a target over its source as a heatmap with the subword pieces on the axes.

    Example: `s2s align -m exp --src "Clipboard management" -o attn.png`
    """
    from s2s.plot import plot_attention
    from s2s.translate import Translator, attention_map

    translator = Translator.from_dir(model, device)
    m = attention_map(translator, src, tgt, layer)
    which = "mean over layers" if layer is None else f"layer {layer}"
    path = plot_attention(m.A.numpy(), m.src_pieces, m.tgt_pieces, output,
                          f"cross-attention ({which}, mean over heads)")
    typer.echo(str(path))


@app.command()
def score(hyp: str = typer.Argument(..., help="Hypotheses file; - reads stdin."),
          refs: List[str] = typer.Argument(..., help="One or more reference files."),
          metrics: str = typer.Option("bleu,chrf,ter", "--metrics", "--metric",
                                      help="Comma-separated: bleu, chrf, ter, rouge (ROUGE-1/2/L F1)."),
          as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout.")):
    """Score hypotheses against references: BLEU, chrF, TER (sacrebleu), ROUGE (rouge-score).

    Example: `s2s translate -m exp < test.en | s2s score - test.de --json`;
    `s2s score summaries.txt test.sum --metric rouge`
    """
    from s2s.metrics import METRICS, corpus_scores
    from s2s.textio import read_lines

    names = list(dict.fromkeys(m.strip().lower() for m in metrics.split(",") if m.strip()))  # each once
    if not names:
        raise S2SError(f"--metrics: {metrics!r} names no metric; give some of {', '.join(METRICS)}")
    for name in names:
        if name not in METRICS:
            raise S2SError(f"--metrics: {name!r} is not one of {', '.join(METRICS)}")
    if sum(1 for f in [hyp, *refs] if f == "-") > 1:
        raise S2SError("only one of HYP and REF can be - (stdin)")
    hyps = list(read_lines(hyp))
    ref_lists = [list(read_lines(r)) for r in refs]
    for r, lines in zip(refs, ref_lists):
        if len(lines) != len(hyps):
            raise S2SError(f"{hyp} has {len(hyps)} lines but {r} has {len(lines)}")
    if not hyps:
        raise S2SError(f"{'<stdin>' if hyp == '-' else hyp}: no lines to score")
    results = corpus_scores(hyps, ref_lists, names)
    if as_json:
        typer.echo(json.dumps({s.name: s.to_dict() for s in results}))
    else:
        for s in results:
            label = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}.get(s.name, s.name.upper())
            typer.echo(f"{label:7s} {s.score:6.2f}   {s.details}   [{s.signature}]")


@export_app.command("ct2")
def export_ct2(model: ModelOption,
               output: Path = typer.Option(..., "-o", "--output", help="The CTranslate2 model directory."),
               quantization: Optional[str] = typer.Option(None, help="int8, int8_float32, int16, float16 "
                                                                     "or bfloat16 weights (default: float32)."),
               force: bool = ForceOption):
    """Write a CTranslate2 model (through CTranslate2's spec API) that serves the same translations.

    Example: `s2s export ct2 -m exp/qs -o exp/qs-ct2 --quantization int8`
    """
    from s2s.export import export_ct2 as run_export

    typer.echo(str(run_export(model, output, quantization, force)))


@export_app.command("hf")
def export_hf(model: ModelOption,
              output: Path = typer.Option(..., "-o", "--output", help="The Hugging Face model directory."),
              force: bool = ForceOption):
    """Write a Hugging Face directory that AutoModelForSeq2SeqLM.from_pretrained loads.

    The family (MarianMT, BART, mBART or T5) is the one the model's architecture matches.

    Example: `s2s export hf -m exp/opus-ft -o exp/opus-ft-hf`
    """
    from s2s.hf import export_hf as run_export

    typer.echo(str(run_export(model, output, force)))


@import_app.command("hf")
def import_hf(path: Path = typer.Argument(..., help="A local Hugging Face model directory."),
              output: Path = typer.Option(..., "-o", "--output", help="The s2s model directory to write."),
              force: bool = ForceOption):
    """Turn a Hugging Face MarianMT, BART, mBART or T5 checkpoint into an s2s model directory.

    Reads config.json, safetensors or .bin weights (no pickled code runs) and the tokenizer
    files; the result serves translate, score and fine-tuning (train.init_from).

    Example: `s2s import hf ~/models/opus-mt-en-de -o exp/opus-en-de`
    """
    from s2s.hf import import_hf as run_import

    typer.echo(str(run_import(path, output, force)))


@app.command()
def average(checkpoints: List[Path] = typer.Argument(..., help="Checkpoint or model directories."),
            output: Path = typer.Option(..., "-o", "--output", help="The averaged model directory."),
            force: bool = ForceOption):
    """Average the weights of checkpoints of one run into a new model directory.

    Example: `s2s average exp/qs/checkpoints/step-* -o exp/qs-avg`
    """
    from s2s.modeldir import average_checkpoints

    typer.echo(str(average_checkpoints(checkpoints, output, force)))


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="A training run directory."),
         output: Optional[Path] = typer.Option(None, "-o", "--output",
                                               help="PNG to write (default: RUN_DIR/curves.png).")):
    """Draw the loss, dev BLEU and learning-rate curves of a run into a PNG.

    Example: `s2s plot exp/qs -o curves.png`
    """
    from s2s.plot import plot_run

    typer.echo(str(plot_run(run_dir, output)))


@app.command()
def info(path: Path = typer.Argument(..., help="A model directory or an experiment YAML.")):
    """The architecture and its parameter count beside the budget 12*N_enc*d^2 + 16*N_dec*d^2 + V*d.

    Example: `s2s info exp` or `s2s info recipes/ddtp-en-de.yaml`
    """
    from rich.table import Table

    from s2s.modeldir import describe

    table = Table(title=f"{path}", show_header=False)
    for key, value in describe(path):
        table.add_row(key, value)
    print_table(table)


@app.command()
def serve(model: ModelOption,
          host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0: every interface)."),
          port: int = typer.Option(8080, help="Port to listen on (0: a free one, printed on stderr)."),
          threads: int = typer.Option(0, help="Threads of the translating worker: torch's, or the torch-free "
                                              "search's (0: one per core)."),
          max_texts: int = typer.Option(1024, help="Texts per request; more are refused (413)."),
          max_chars: int = typer.Option(200_000, help="Characters per request; more are refused (413)."),
          max_beam: int = typer.Option(16, help="The largest beam a request may ask for."),
          max_queue: int = typer.Option(16_384, help="Texts waiting to be translated; more: 503."),
          window_ms: float = typer.Option(5.0, help="How long a request waits for others to batch with."),
          precision: str = typer.Option("fp32", help="fp32, bf16 or auto, as translate's: with auto, bf16 or "
                                                     "--quantize int8 a request without alignments or a glossary "
                                                     "is searched without torch where this CPU has the products."),
          quantize: Optional[str] = typer.Option(None, help="int8: as translate's --quantize."),
          set_: Optional[List[str]] = typer.Option(None, "--set", metavar="decode.KEY=VALUE",
                                                   help="A decode setting for every request, e.g. "
                                                        "--set decode.batch_tokens=2048 (repeatable).")):
    """Serve translations over HTTP: POST /translate, GET /health, GET /info (FastAPI, uvicorn: the serve extra).

    The model is loaded once; requests arriving together are translated in one batch.
    SIGTERM or Ctrl-C finish the requests in flight, then exit.

    Example: `s2s serve -m exp/qs --port 8080` then
    `curl -s localhost:8080/translate -d '{"texts": ["Clipboard management"]}'`
    """
    from s2s.serve import ServeLimits, decode_overrides
    from s2s.serve import serve as run_serve

    limits = ServeLimits(max_texts=max_texts, max_chars=max_chars, max_beam=max_beam,
                         max_queued_texts=max_queue, window_ms=window_ms)
    run_serve(model, host, port, limits, threads, decode_overrides(set_ or []), precision, quantize)


# --------------------------------------------------------------------------- #
def _detach_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush of a dead stdout
    (a closed pipe, a full disk) cannot print a second error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class Terminated(BaseException):
    """SIGTERM or SIGHUP ended the command.  Raised in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so every context manager removes its temporary files on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise_terminated():
    """While the command runs, SIGTERM and SIGHUP raise Terminated (a signal ignored when s2s
    started, as SIGHUP under nohup, stays ignored); once one has come, further ones are
    ignored so they cannot cut its cleanup short.  (Training installs its own handlers:
    it finishes the step and writes a checkpoint.)"""
    def handler(signum, frame):
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) == signal.SIG_DFL:
                previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _ClosedStream:
    """Stands in for a standard stream the shell closed (``<&-``, ``>&-``): Python sets
    it to None; using it raises an OSError naming it, which ``run`` prints as one line."""

    def __init__(self, name: str):
        self.name = name

    def _closed(self, *args, **kwargs):
        raise OSError(errno.EBADF, f"{'input' if self.name == '<stdin>' else 'output'} is closed", self.name)

    read = readline = write = writelines = fileno = _closed
    buffer = property(_closed)

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def __iter__(self):
        self._closed()


def run() -> None:
    """Entry point: run the app, turning every expected failure into one line and an exit code."""
    if sys.stdin is None:
        sys.stdin = _ClosedStream("<stdin>")
    if sys.stdout is None:
        sys.stdout = _ClosedStream("<stdout>")
    if sys.stderr is None:  # `2>&-`: messages go nowhere (print would send them to stdout)
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    for stream in (sys.stdout, sys.stderr):  # UTF-8 whatever the locale or PYTHONIOENCODING says
        if isinstance(stream, io.TextIOWrapper) and codecs.lookup(stream.encoding).name != "utf-8":
            stream.reconfigure(encoding="utf-8", errors=stream.errors)
    try:
        with _signals_raise_terminated():
            code = app(standalone_mode=False, prog_name="s2s")  # an exit code for Ctrl-C and typer.Exit
    except Terminated as e:
        print(f"s2s: terminated by {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except Interrupted as e:  # Ctrl-C, SIGTERM or SIGHUP that the command handled (a checkpoint written)
        print(f"s2s: interrupted: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except S2SError as e:
        if _DEBUG["on"]:
            raise
        print(f"s2s: error: {e}", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 1))
    except KeyboardInterrupt:
        print("s2s: interrupted", file=sys.stderr)
        sys.exit(130)
    except (BrokenPipeError, _PipeClosed):
        _detach_stdout()  # the reader went away (e.g. `| head`): not an error of ours
        sys.exit(141)
    except typer.Abort:  # older typer: click turns Ctrl-C into Abort
        print("s2s: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except OSError as e:  # an output that cannot be written: a full disk, a read-only directory
        if _DEBUG["on"]:
            raise
        print(f"s2s: error: {e.filename or '<stdout>'}: {e.strerror or e}", file=sys.stderr)
        if not e.filename:
            _detach_stdout()
        sys.exit(1)
    except MemoryError:  # a size the checks before allocating let through
        if _DEBUG["on"]:
            raise
        print("s2s: error: out of memory", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code")):
            raise  # not click's (typer vendors click): a bug, keep the traceback
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError":  # `s2s` or `s2s tokenizer` alone: the help
            typer.echo(ctx.get_help(), err=True)
            sys.exit(2)
        # usage errors (exit 2) in the one format of every error; the command's --help has the rest
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None and e.exit_code == 2 else ""
        print(f"s2s: error: {e.format_message()}{where}", file=sys.stderr)
        sys.exit(e.exit_code)
    if isinstance(code, int) and code:
        if code == 130:
            print("s2s: interrupted", file=sys.stderr)
        sys.exit(code)
