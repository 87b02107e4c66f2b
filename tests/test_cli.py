"""End to end through the command line on a tiny slice of the real corpus."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from s2s.cli import app

runner = CliRunner()


def s2s(*args, input=None):
    """Run the real entry point in a subprocess: exit codes and stderr as a user sees them."""
    return subprocess.run([sys.executable, "-m", "s2s", *map(str, args)], input=input,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_dir(corpus, tmp_path_factory) -> Path:
    """tokenizer train -> prepare -> train, all through the CLI."""
    from tests.conftest import TINY_YAML

    work = tmp_path_factory.mktemp("cli")
    cfg = work / "tiny.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{work}/prep"))
    r = runner.invoke(app, ["tokenizer", "train", str(cfg), "--vocab-size", "280", "--type", "bpe"])
    assert r.exit_code == 0, r.output
    assert (work / "prep" / "spm.model").is_file()
    r = runner.invoke(app, ["prepare", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "train" in r.stdout and "400" in r.stdout
    r = runner.invoke(app, ["train", str(cfg), "-o", str(work / "run"), "--set", "train.max_steps=4"])
    assert r.exit_code == 0, r.output
    return work / "run"


def test_translate_one_line_per_input_line_in_order(model_dir):
    lines = ["Clipboard management", "", "   ", "port scanner for discovering services", "x" * 3000,
             "émoji 🙂 and עברית", "Clipboard management"]
    r = s2s("translate", "-m", model_dir, "--beam", "2", input="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout.split("\n")
    assert out[-1] == "" and len(out) - 1 == len(lines)
    assert out[1] == "" and out[2] == ""
    assert out[0] == out[6]  # same input, same output, wherever it sits


def test_translate_beam_and_nbest(model_dir, corpus):
    src = (corpus / "dev.en").read_text().splitlines()[:5]
    r = s2s("translate", "-m", model_dir, "--beam", "3", "--nbest", "3", input="\n".join(src) + "\n")
    assert r.returncode == 0, r.stderr
    rows = [line.split(" ||| ") for line in r.stdout.splitlines()]
    for i in range(5):
        scores = [float(row[2]) for row in rows if row[0] == str(i)]
        assert 1 <= len(scores) <= 3 and scores == sorted(scores, reverse=True)


def test_pipeline_translate_then_score(model_dir, corpus, tmp_path):
    hyp = s2s("translate", "-m", model_dir, "--input", corpus / "dev.en", "--beam", "1")
    assert hyp.returncode == 0, hyp.stderr
    assert len(hyp.stdout.splitlines()) == 20
    r = s2s("score", "-", corpus / "dev.de", "--json", input=hyp.stdout)
    assert r.returncode == 0, r.stderr
    scores = json.loads(r.stdout)
    assert set(scores) == {"bleu", "chrf", "ter"}
    assert scores["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    # --output writes a complete file
    r = s2s("translate", "-m", model_dir, "--input", corpus / "dev.en", "-o", tmp_path / "out.txt")
    assert r.returncode == 0 and len((tmp_path / "out.txt").read_text().splitlines()) == 20


def test_score_identical_is_perfect(tmp_path):
    ref = tmp_path / "ref"
    ref.write_text("the cat sat on the mat\nhello world again\n")
    r = runner.invoke(app, ["score", str(ref), str(ref), "--json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["bleu"]["score"] == 100.0


def test_info_reports_budget(model_dir):
    """The parameter count is the model's, and the budget is P = 12 N_enc d^2 + 16 N_dec d^2 + V d
    with this model's N_enc = N_dec = 1, d = 32 and V its vocabulary."""
    import re

    import sentencepiece as spm

    from s2s.modeldir import load_model_dir

    r = runner.invoke(app, ["info", str(model_dir)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    rows = {m.group(1).strip(): m.group(2).strip()
            for m in re.finditer(r"│\s*(.+?)\s*│\s*(.+?)\s*│", r.stdout)}
    V = spm.SentencePieceProcessor(model_file=str(model_dir / "spm.model")).get_piece_size()
    N_enc, N_dec, d = 1, 1, 32
    assert rows["layers"] == f"{N_enc} encoder + {N_dec} decoder"
    assert rows["vocabulary (src / tgt)"].startswith(f"{V} / {V}")
    n = sum(p.numel() for p in load_model_dir(model_dir).model.parameters())
    assert rows["parameters"] == f"{n:,}"
    P = 12 * N_enc * d**2 + 16 * N_dec * d**2 + V * d
    budget = rows["budget 12·N_enc·d² + 16·N_dec·d² + V·d"]
    assert budget == f"{P:,}  (actual/budget = {n / P:.3f})"


@pytest.mark.parametrize("args, needle", [
    (["translate", "-m", "/nonexistent"], "/nonexistent: no such model directory"),
    (["score", "/nonexistent/hyp", "/nonexistent/ref"], "/nonexistent/hyp: no such file"),
    (["train", "/nonexistent.yaml"], "/nonexistent.yaml: no such file"),
])
def test_errors_are_one_line(args, needle):
    r = s2s(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"s2s: error: {needle}" or needle in r.stderr


def test_bad_inputs(model_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe\n")
    r = s2s("translate", "-m", model_dir, "--input", bad)
    assert r.returncode == 1 and f"{bad}:2: invalid UTF-8" in r.stderr
    r = s2s("translate", "-m", model_dir, "--input", bad, "--errors", "replace")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("1\n2\n")
    b.write_text("1\n")
    r = s2s("score", a, b)
    assert r.returncode == 1 and f"{a} has 2 lines but {b} has 1" in r.stderr
    r = s2s("translate", "-m", model_dir, "--beam", "0", input="x\n")
    assert r.returncode == 1 and "decode.beam" in r.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {d_model: 30, heads: 4}\n")
    r = s2s("train", cfg, "-o", tmp_path / "r")
    assert r.returncode == 1 and "model.d_model" in r.stderr and str(cfg) in r.stderr


def test_corrupted_weights_are_detected(model_dir, tmp_path):
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    r = s2s("translate", "-m", copy, input="hello\n")
    assert r.returncode == 1 and "checksum mismatch" in r.stderr


def test_help_has_examples():
    for cmd in (["tokenizer", "train"], ["prepare"], ["train"], ["translate"], ["score"], ["info"]):
        r = runner.invoke(app, [*cmd, "--help"])
        assert r.exit_code == 0 and "Example" in r.stdout, cmd


def test_unbuffered_answers_each_line_before_input_ends(model_dir):
    """--unbuffered: a line in, its translation out, while stdin stays open."""
    import select

    proc = subprocess.Popen([sys.executable, "-m", "s2s", "translate", "-m", str(model_dir),
                             "--unbuffered", "--beam", "1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in ("Clipboard management", "", "port scanner"):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], 120)
            assert ready, "no output while stdin is still open"
            proc.stdout.readline()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_closed_pipe_is_not_an_error(model_dir, corpus):
    """`s2s translate ... | head -1`: the reader leaves early; no traceback."""
    r = subprocess.run(f"{sys.executable} -m s2s translate -m {model_dir} --beam 1 "
                       f"< {corpus / 'train.en'} | head -n 1", shell=True, capture_output=True,
                       text=True, timeout=300)
    assert len(r.stdout.splitlines()) == 1
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("command", ["translate", "translate -o /dev/stdout", "score", "info"])
def test_a_reader_that_left_is_exit_141_without_a_word(model_dir, corpus, command):
    """As a tool killed by SIGPIPE: `set -o pipefail` tells `| head` from a failure (typer, rich: 1)."""
    args = {"translate": f"translate -m {model_dir} --beam 1 < {corpus / 'dev.en'}",
            "translate -o /dev/stdout": f"translate -m {model_dir} --beam 1 -o /dev/stdout < {corpus / 'dev.en'}",
            "score": f"score {corpus / 'dev.de'} {corpus / 'dev.de'}", "info": f"info {model_dir}"}[command]
    r = subprocess.run(f"set -o pipefail; {sys.executable} -m s2s {args} | (exec 0<&-; sleep 0.5)",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300)
    assert r.returncode == 141 and r.stderr == "", r.stderr


def test_stdout_is_utf8_whatever_the_locale_says(model_dir):
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "LC_ALL": "C", "PYTHONUTF8": "0"}
    r = subprocess.run([sys.executable, "-m", "s2s", "translate", "-m", str(model_dir), "--format", "jsonl"],
                       input="Grüße aus München — café\n".encode(), capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout.decode("utf-8"))
    r = subprocess.run([sys.executable, "-m", "s2s", "translate", "--help"], capture_output=True, env=env)
    assert r.returncode == 0 and "…".encode() in r.stdout


def test_an_undecodable_file_name_in_a_message_is_one_line(tmp_path):
    """stderr made UTF-8 keeps its error handler: a file name's stray byte is escaped, no traceback."""
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    r = subprocess.run([sys.executable, "-m", "s2s", "score", os.fsencode(tmp_path) + b"/\xff.txt", "x.txt"],
                       capture_output=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith(b"s2s: error: ") and b"Traceback" not in r.stderr


def test_a_closed_stderr_keeps_errors_out_of_stdout(model_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"Clipboard management\n\xff\n")
    r = subprocess.run(f"{sys.executable} -m s2s translate -m {model_dir} -i {bad} --unbuffered 2>&-",
                       shell=True, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1 and "error" not in r.stdout


def test_a_corrupt_gzip_input_is_one_line(corpus, tmp_path):
    import gzip

    data = bytearray(gzip.compress((corpus / "dev.en").read_bytes()))
    data[60:100] = bytes(b ^ 0x5A for b in data[60:100])
    (tmp_path / "c.en.gz").write_bytes(bytes(data))
    r = s2s("score", tmp_path / "c.en.gz", corpus / "dev.en")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"s2s: error: {tmp_path / 'c.en.gz'}: read error:"), r.stderr


def test_score_reads_past_a_byte_order_mark(corpus, tmp_path):
    bom = tmp_path / "bom.de"
    bom.write_bytes(b"\xef\xbb\xbf" + (corpus / "dev.de").read_bytes())
    r = s2s("score", corpus / "dev.de", bom, "--metrics", "bleu,chrf,bleu", "--json")
    assert r.returncode == 0, r.stderr
    scores = json.loads(r.stdout)
    assert list(scores) == ["bleu", "chrf"] and scores["bleu"]["score"] == scores["chrf"]["score"] == 100.0


@pytest.mark.parametrize("metrics", ["", ",", " , "])
def test_score_without_a_metric_is_an_error(corpus, metrics):
    r = s2s("score", corpus / "dev.de", corpus / "dev.de", "--metrics", metrics)
    assert r.returncode == 1 and r.stderr.startswith("s2s: error: --metrics:") and "names no metric" in r.stderr


@pytest.mark.parametrize("key", ["temperature=0.5", "top_k=5", "top_p=0.9"])
def test_sampling_settings_without_sampling_are_refused(model_dir, key):
    r = s2s("translate", "-m", model_dir, "--set", f"decode.{key}", input="Clipboard\n")
    assert r.returncode == 1 and f"decode.{key.split('=')[0]}: shapes the distribution" in r.stderr
    r = s2s("translate", "-m", model_dir, "--sampling", "--beam", "1", "--set", f"decode.{key}",
            input="Clipboard\n")
    assert r.returncode == 0, r.stderr


def test_separate_flag_is_followed_downstream(corpus, tmp_path):
    """`tokenizer train --separate` on a joint YAML: prepare and train follow what was trained."""
    from s2s.config import load_config
    from s2s.tokenizer import resolve_tokenizer_config
    from tests.conftest import TINY_YAML

    cfg = tmp_path / "c.yaml"
    cfg.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{tmp_path}/prep"))
    r = runner.invoke(app, ["tokenizer", "train", str(cfg), "--separate", "--vocab-size", "200"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["prepare", str(cfg)])
    assert r.exit_code == 0, r.output
    resolved = resolve_tokenizer_config(load_config(cfg))
    assert not resolved.tokenizer.joint and not resolved.model.share_embeddings
    assert resolved.tokenizer.vocab_size == 200


def test_sampling_and_no_repeat_options(model_dir, corpus):
    src = "\n".join((corpus / "dev.en").read_text().splitlines()[:4]) + "\n"
    a = s2s("translate", "-m", model_dir, "--sampling", "--seed", "5", "--set", "decode.top_p=0.9", input=src)
    b = s2s("translate", "-m", model_dir, "--sampling", "--seed", "5", "--set", "decode.top_p=0.9", input=src)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and len(a.stdout.splitlines()) == 4
    r = s2s("translate", "-m", model_dir, "--set", "decode.no_repeat_ngram=2", input=src)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 4
    r = s2s("translate", "-m", model_dir, "--sampling", "--beam", "4", input=src)
    assert r.returncode == 1 and "decode.sampling: needs decode.beam: 1" in r.stderr
    r = s2s("translate", "-m", model_dir, "--set", "decode.top_p=0", input=src)
    assert r.returncode == 1 and "decode.top_p" in r.stderr


def test_alignments_are_pharaoh_pairs(model_dir, corpus):
    from s2s.translate import Translator

    src = (corpus / "dev.en").read_text().splitlines()[:3]
    r = s2s("translate", "-m", model_dir, "--alignments", "--beam", "2", input="\n".join(src + [""]) + "\n")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == 4 and lines[3] == " ||| "
    tr = Translator.from_dir(model_dir, beam=2)
    for line, text in zip(lines, src):
        hyp, _, pairs = line.partition(" ||| ")
        n_src = len(tr.tok.encode_src([text])[0]) - 1  # pieces without </s>
        n_out = len(tr.tok.encode_tgt([hyp])[0]) - 1 if hyp else 0
        got = [tuple(map(int, p.split("-"))) for p in pairs.split()]
        assert [t for _, t in got] == list(range(len(got)))  # one pair per output subword
        assert all(0 <= j < n_src for j, _ in got)
        assert abs(len(got) - n_out) <= 2  # re-encoding the detokenized text may split differently


def test_hard_alignment_and_cross_attention_rows(model_dir):
    import torch

    from s2s.modeldir import load_model_dir
    from s2s.translate import cross_attention, hard_alignment

    A = torch.tensor([[0.1, 0.8, 0.1, 0.0], [0.6, 0.3, 0.1, 0.0], [0.2, 0.2, 0.2, 0.4]])
    assert hard_alignment(A, src_len=3, tgt_len=2) == [(1, 0), (0, 1)]  # </s> column and row excluded
    model = load_model_dir(model_dir).model
    src, tgt = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]]), torch.tensor([[10, 11, 3], [12, 3, 0]])
    for layer in (None, -1, 0):
        a = cross_attention(model, src, tgt, layer)
        assert a.shape == (2, 3, 4)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 3))
        assert (a[1, :, 3] == 0).all()  # padding gets no attention


def test_align_draws_a_heatmap(model_dir, tmp_path):
    import matplotlib.image
    import numpy as np

    from s2s.translate import Translator

    out = tmp_path / "attn.png"
    r = s2s("align", "-m", model_dir, "--src", "Clipboard management tool", "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = s2s("align", "-m", model_dir, "--src", "port scanner", "--tgt", "Portscanner", "--layer", "-1",
            "-o", tmp_path / "b.png")
    assert r.returncode == 0 and (tmp_path / "b.png").is_file(), r.stderr
    # the figure is sized by the pieces on its axes: 0.45 in per source and 0.4 in per target piece
    tr = Translator.from_dir(model_dir)
    S, T = len(tr.encode_lines(["port scanner"], 1)[0]), len(tr.tok.encode_tgt(["Portscanner"])[0])
    image = matplotlib.image.imread(tmp_path / "b.png")
    assert image.shape[:2] == (round(100 * max(3.0, 0.4 * T + 1.5)), round(100 * max(4.0, 0.45 * S + 2)))
    # the heatmap is drawn: the axes, left of the colour bar, are filled with blue cells (an
    # untrained model attends almost uniformly, A = 1/S: one light shade), not a blank frame
    rgb = image[:, : int(image.shape[1] * 0.75), :3]
    blue = (rgb[..., 2] > rgb[..., 0] + 0.08) & (rgb.std(-1) > 0.02)
    rows, cols = np.nonzero(blue)
    assert blue.sum() > 0.6 * (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1) > 2000
    r = s2s("align", "-m", model_dir, "--src", "x", "--layer", "7", "-o", tmp_path / "c.png")
    assert r.returncode == 1 and "--layer: 7 is not a layer" in r.stderr


def test_int8_and_bf16_decoding(model_dir, corpus, monkeypatch):
    import torch

    from s2s.model import int8 as int8_module
    from s2s.translate import Translator

    fp32 = Translator.from_dir(model_dir, beam=1)
    int8 = Translator.from_dir(model_dir, beam=1)
    int8.quantize_int8()
    assert int8.model.output_int8 is not None
    assert any(isinstance(m, int8_module.Int8Linear) for m in int8.model.modules())  # packed int8 copies
    x = torch.tensor([[5, 6, 7, 3]])
    y = torch.tensor([[2, 8, 9]])
    ref = fp32.model(x, y)
    # this tiny model's products are all below int8_pays's threshold: fp32 exactly
    assert torch.equal(int8.model(x, y), ref)
    for m in int8.model.modules():  # every product in int8: each layer's int8_pays threshold at 0 rows
        if isinstance(m, int8_module.Int8Linear):
            monkeypatch.setattr(m, "int8_numel", 0)
    got = int8.model(x, y)
    assert not torch.equal(got, ref) and (got - ref).abs().max() < 0.1 * ref.abs().max()  # close, not equal
    monkeypatch.undo()

    src = (corpus / "dev.en").read_text().splitlines()[:8]
    ref = s2s("translate", "-m", model_dir, "--device", "cpu", "--beam", "2", input="\n".join(src) + "\n")
    assert ref.returncode == 0, ref.stderr
    # through the CLI on torch's route, the same rule: below the threshold every line is fp32's
    with monkeypatch.context() as env:
        env.setenv("S2S_NATIVE_SEARCH", "0")
        r = s2s("translate", "-m", model_dir, "--device", "cpu", "--beam", "2", "--quantize", "int8",
                input="\n".join(src) + "\n")
    assert r.returncode == 0 and r.stdout == ref.stdout, r.stderr
    # where the torch-free search runs int8 products (a CPU with AVX2), every matrix in int8:
    # close translations of this degenerate model (4 of the 8 identical when written;
    # tests/test_native_search.py checks that search against torch's with the same arithmetic)
    from s2s import native_search

    if (os.environ.get(native_search.DISABLE, "1") != "0" and native_search.library() is not None
            and native_search.has_products(native_search.library(), "int8")):
        r = s2s("--debug", "translate", "-m", model_dir, "--device", "cpu", "--beam", "2", "--quantize", "int8",
                input="\n".join(src) + "\n")
        assert r.returncode == 0 and "search without torch: int8 products" in r.stderr, r.stderr
        assert len(r.stdout.splitlines()) == len(src)
        identical = sum(a == b for a, b in zip(r.stdout.splitlines(), ref.stdout.splitlines()))
        assert identical >= 3, (identical, r.stdout, ref.stdout)
    # bf16: the same translations as fp32 but where bf16's 8-bit mantissa makes two candidates'
    # scores equal, and the search's tie order (torch's topk, or s2s.search.largest_k's groups)
    # picks one; that rewrites the rest of the (degenerate, repeating) line, so count lines, not
    # BLEU: 7 of the 8 measured identical, the 8th rewritten after an exact tie; 5 once training's
    # decoder ran on the real target positions (fewer dropout draws: another tiny model)
    r = s2s("translate", "-m", model_dir, "--device", "cpu", "--beam", "2", "--precision", "bf16",
            input="\n".join(src) + "\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == len(src), r.stderr
    identical = sum(a == b for a, b in zip(r.stdout.splitlines(), ref.stdout.splitlines()))
    assert identical >= 5, (identical, r.stdout, ref.stdout)
    r = s2s("translate", "-m", model_dir, "--device", "cpu", "--quantize", "int4", input="x\n")
    assert r.returncode == 1 and "--quantize: 'int4' is not int8" in r.stderr


def test_ensemble_prefix_and_coverage_penalty_options(model_dir, corpus, tmp_path):
    src = (corpus / "dev.en").read_text().splitlines()[:3]
    text = "\n".join(src) + "\n"
    single = s2s("translate", "-m", model_dir, "--beam", "2", input=text)
    twice = s2s("translate", "-m", model_dir, "-m", model_dir, "--beam", "2", input=text)
    assert twice.returncode == 0, twice.stderr
    assert twice.stdout == single.stdout  # an ensemble of one model twice is that model
    prefixes = tmp_path / "prefix.txt"
    prefixes.write_text("Die\n\nEin Paket\n")
    r = s2s("translate", "-m", model_dir, "--prefix-file", prefixes, "--beam", "2", input=text)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith("Die") and out[2].startswith("Ein Paket")
    prefixes.write_text("Die\n")
    r = s2s("translate", "-m", model_dir, "--prefix-file", prefixes, input=text)
    assert r.returncode == 1 and "--prefix-file: the prefix file ends at line 1" in r.stderr
    r = s2s("translate", "-m", model_dir, "--coverage-penalty", "0.2", "--beam", "3", input=text)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r.stderr


def test_ctranslate2_export_gives_the_same_greedy_output(model_dir, corpus, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed")
    import sentencepiece as spm

    from s2s.translate import Translator

    out = tmp_path / "ct2"
    r = s2s("export", "ct2", "-m", model_dir, "-o", out)
    assert r.returncode == 0, r.stderr
    lines = (corpus / "dev.en").read_text().splitlines()[:6]
    ours = Translator.from_dir(model_dir, beam=1, max_len_a=0.0, max_len_b=20).translate_chunk(lines)
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    theirs = ctranslate2.Translator(str(out), device="cpu").translate_batch(
        [sp.encode(x, out_type=str) for x in lines], beam_size=1, max_decoding_length=19,
        suppress_sequences=[["<s>"], ["<pad>"]])  # s2s never generates these (a barely trained model would)
    for o, t in zip(ours, theirs):
        assert [sp.id_to_piece(i) for i in o.hypotheses[0].tokens] == t.hypotheses[0]
    r = s2s("export", "ct2", "-m", model_dir, "-o", tmp_path / "q", "--quantization", "int3")
    assert r.returncode == 1 and "--quantization: 'int3'" in r.stderr


def test_translate_progress_on_a_terminal_only(model_dir, corpus):
    import io

    from rich.console import Console

    from s2s.translate import TranslateProgress, Translator, write_translations

    tr = Translator.from_dir(model_dir, beam=1)
    src = (corpus / "dev.en").read_text().splitlines()[:5]
    tty = io.StringIO()
    progress = TranslateProgress(Console(file=tty, force_terminal=True))
    out = io.StringIO()
    write_translations(tr, src, out, progress=progress)
    progress.close()
    assert progress.lines == 5 and progress.tokens > 0
    assert "5 lines |" in tty.getvalue() and "lines/s" in tty.getvalue()
    pipe = io.StringIO()
    quiet = TranslateProgress(Console(file=pipe, force_terminal=False))
    write_translations(tr, src, io.StringIO(), progress=quiet)
    quiet.close()
    assert pipe.getvalue() == ""  # nothing in a pipe or a log
    assert out.getvalue().count("\n") == 5


def test_sampling_nbest_prints_n_samples_per_line(model_dir, corpus):
    src = (corpus / "dev.en").read_text().splitlines()[:4]
    r = s2s("translate", "-m", model_dir, "--sampling", "--nbest", "3", "--seed", "1",
            input="\n".join(src) + "\n")
    assert r.returncode == 0, r.stderr
    rows = [line.split(" ||| ") for line in r.stdout.splitlines()]
    assert [row[0] for row in rows] == [str(i) for i in range(4) for _ in range(3)]
    for i in range(4):
        scores = [float(row[2]) for row in rows if row[0] == str(i)]
        assert scores == sorted(scores, reverse=True)
    r = s2s("translate", "-m", model_dir, "--sampling", "--coverage-penalty", "0.2", input="x\n")
    assert r.returncode == 1 and "decode.coverage_penalty: rescores searched hypotheses" in r.stderr


def test_ensemble_of_a_run_and_its_checkpoint_with_weights(model_dir, corpus):
    from s2s.checkpoint import list_checkpoints

    ckpt = list_checkpoints(model_dir)[0]
    src = (corpus / "dev.en").read_text().splitlines()[:3]
    text = "\n".join(src) + "\n"
    r = s2s("translate", "-m", model_dir, "-m", ckpt, "--ensemble-weights", "0.7,0.3", "--beam", "2",
            "--alignments", input=text)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3 and all(" ||| " in line for line in r.stdout.splitlines())
    equal = s2s("translate", "-m", model_dir, "-m", ckpt, "--beam", "2", input=text)
    same = s2s("translate", "-m", model_dir, "-m", ckpt, "--ensemble-weights", "2,2", "--beam", "2", input=text)
    assert equal.returncode == 0 and same.stdout == equal.stdout  # weights are normalized
    r = s2s("translate", "-m", model_dir, "-m", ckpt, "--ensemble-weights", "0.7", input=text)
    assert r.returncode == 1 and "--ensemble-weights: 1 weights for 2 models" in r.stderr
    r = s2s("translate", "-m", model_dir, "-m", ckpt, "--ensemble-weights", "1,-1", input=text)
    assert r.returncode == 1 and "must be a positive number" in r.stderr


def test_ensemble_alignments_average_the_members_attention(model_dir):
    """An ensemble aligns with sum_i w_i A_i, not with its first member's attention."""
    import copy

    import torch

    from s2s.translate import Translator, cross_attention, hard_alignment

    t = Translator.from_dirs([model_dir, model_dir], weights=[0.4, 0.6])
    torch.manual_seed(0)
    other = copy.deepcopy(t.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    t.extra_models = [other]
    t.alignments = True
    lines = ["Clipboard management tool", "port scanner for discovering services on a network",
             "a small utility to watch files and run commands"]
    got = t.translate_chunk(lines)
    ids = t.encode_lines(lines, 1)
    first_only = 0
    for tr, x in zip(got, ids):
        for h in tr.hypotheses:
            src, tgt = torch.tensor([x]), torch.tensor([h.tokens + [t.tok.eos_id]])
            A0, A1 = (cross_attention(m, src, tgt, bos_id=t.tok.bos_id)[0] for m in (t.model, other))
            assert h.alignment == hard_alignment(0.4 * A0 + 0.6 * A1, len(x) - 1, len(h.tokens))
            first_only += h.alignment != hard_alignment(A0, len(x) - 1, len(h.tokens))
    assert first_only  # the first member alone aligns differently: the check can tell


def test_help_reads_like_a_usage_line():
    """Metavars as people read them: CONFIG, CHECKPOINTS..., no <bool> on a flag, no list[Path]."""
    for cmd, usage in ((["train"], "[OPTIONS] CONFIG"), (["average"], "[OPTIONS] CHECKPOINTS..."),
                       (["score"], "[OPTIONS] HYP REFS..."), (["tokenizer", "train"], "[OPTIONS] CONFIG"),
                       (["translate"], "[OPTIONS]"), ([], "[OPTIONS] COMMAND")):
        r = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert usage in r.stdout, (cmd, r.stdout)
        for internal in ("<bool>", "list[", "{", "}"):
            assert internal not in r.stdout, (cmd, internal)
    r = runner.invoke(app, ["translate", "--help"], env={"COLUMNS": "200"})
    for key in ("beam", "alpha", "max_len_b", "min_len", "coverage_penalty", "batch_tokens"):
        assert f"(default: the model's decode.{key})" in r.stdout, key
    assert "decode.KEY=VALUE" in r.stdout  # every other decode key: --set decode.KEY=VALUE
    assert "<path>" in r.stdout  # -m, repeatable: the type of one value


def test_version():
    from s2s import __version__

    r = s2s("--version")
    assert r.returncode == 0 and r.stdout == f"s2s {__version__}\n", r.stderr


@pytest.mark.parametrize("args, message", [
    (["train"], "Missing argument 'CONFIG'. (see `s2s train --help`)"),
    (["train", "c.yaml", "--bogus"], "No such option: --bogus (see `s2s train --help`)"),
    (["translate", "-m", "x", "--beam", "many"], "Invalid value for '--beam' / '-b'"),
    (["no-such-command"], "No such command 'no-such-command'. (see `s2s --help`)"),
])
def test_usage_errors_are_one_line_exit_2(args, message):
    """Usage errors look like every other error (not click's usage box) and exit 2."""
    r = s2s(*args)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("s2s: error: ") and message in r.stderr, r.stderr


def test_tokenizer_training_shows_a_spinner_with_elapsed_time_on_a_terminal(corpus, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import s2s.tokenizer
    from s2s.config import load_config
    from tests.conftest import TINY_YAML

    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(TINY_YAML.format(d=corpus).replace(f"{corpus}/prep", f"{tmp_path}/prep"))
    cfg = load_config(cfg_path)
    real = s2s.tokenizer.status
    for terminal in (True, False):
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=terminal, width=200)
        monkeypatch.setattr(s2s.tokenizer, "status", lambda text, console=console: real(text, console))
        s2s.tokenizer.train_tokenizer(cfg.tokenizer, cfg.data, seed=1)
        if terminal:
            shown = buf.getvalue()
            assert "training SentencePiece unigram (300 pieces) on 800 sentences for spm.model" in shown
            assert "0:00:0" in shown  # the elapsed time
        else:
            assert buf.getvalue() == ""  # in a pipe or a log: nothing
