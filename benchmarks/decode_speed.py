"""Decoding speed side by side: s2s in each precision and worker split against
CTranslate2 in each precision and thread split (and Hugging Face generate where
an export exists), on the same weights, sentences and cores, in one run.

For each model (``--model``, repeatable) and search (beam 5, greedy) every
configuration runs as its own processes, the configurations interleaved round
by round (``--rounds``, >= 3 for figures; a busy machine slows each alike), and
the median with min and max is kept:

* s2s ``{fp32,int8,bf16,auto,shortlist,int8shortlist,bf16shortlist,autoshortlist}_{W}x{T}``:
  ``s2s translate --workers W --threads T`` for every split W x T of the cores (int8 on
  the CPU only; bf16 where the CPU has native bf16 matmuls, AVX-512 BF16 or AMX, or on a
  GPU; auto, ``--precision auto``, on a CPU with native bf16: the torch-free search's bf16
  products on AMX, its int8 ones on the others, the int8 row's route on a CPU without bf16;
  shortlist is fp32 with ``--shortlist`` where the model directory has one, ``s2s shortlist
  CONFIG -m MODEL``; int8shortlist is ``--quantize int8 --shortlist`` on the CPU,
  bf16shortlist ``--precision bf16 --shortlist`` where bf16 runs, autoshortlist
  ``--precision auto --shortlist`` where auto runs).
* ct2 ``{fp32,int8}_{I}x{J}``: CTranslate2 with ``inter_threads`` I x
  ``intra_threads`` J, every split (on a GPU: float32, float16, bfloat16, 1x1).
* hf: ``s2s export hf`` run by ``generate`` (an architecture no Hugging Face
  family has, the pre-norm sinusoidal reference model among them, has no row).

Each configuration is measured twice:

* whole process: start-up, model loading, reading, decoding, writing, timed
  from outside (``s2s translate``; CTranslate2's script; Hugging Face's script);
* steady state: the model loaded, translation alone, timed inside the process:
  s2s as ``s2s translate --workers W`` runs: W > 1, around ``TranslatorPool.translate``
  once its W workers have loaded and a warm-up pass of 64 W lines has run (its batches
  go to whichever worker is free), W = 1 around ``Translator.translate_lines`` in the process,
  CTranslate2 around ``translate_batch``, Hugging Face around its generate loop.

Peak RSS is the largest single process's (with W workers each has its own
copy, so the total is about W times that).  BLEU (sacrebleu 13a) is of the
whole-process output.  Every engine gets one output-length cap (the largest
a*|x|+b of the model's decode settings over the sentences: CTranslate2 takes one
cap per call), batches of ``--batch`` sentences, the length penalty m^alpha with
alpha = 1 (the form CTranslate2 has) and s2s's ``--set decode.stop=early`` (stop once no
live beam would win by ending at the next step), as CTranslate2 and Hugging
Face generate's default do.

Then a memory check (``--memory-lines``, 0: none): peak RSS of ``s2s
translate`` (fp32, greedy, one worker) on a file of that many lines, made by
repeating the test set, against the same on ``--sentences`` lines; the ratio
is reported (goal <= 1.5: translation streams).

s2s's modules are compiled to bytecode first, as ``pip install`` leaves an installed package
(run from a source tree with PYTHONDONTWRITEBYTECODE set, each s2s process would compile them).

A configuration whose process fails runs no more rounds and its row says why ("failed": how it
ended and its error's last line); the run goes on, and exits non-zero at the end if an s2s configuration failed.
On a GPU, CTranslate2 first translates 8 sentences there and on the CPU (:func:`ct2_cuda_environ`:
with a CUDA 13 cuBLAS standing in for the CUDA 12 one its wheels open, where that is what it lacks).

Not a timed test: the machines are shared and noisy; only ratios within one
run mean something.  Prints one table per model and, last, one JSON line: the
first ``--model``'s best configurations, "s2s_best_beam5_sent_s",
"ct2_best_beam5_sent_s", "s2s_best_greedy_sent_s", "ct2_best_greedy_sent_s",
"s2s_best_beam5_bleu", "ct2_best_beam5_bleu" ... with "..._config" (best by
median whole-process sentences/s; "..._steady_sent_s" is that configuration's
steady state), "memory_ratio", and under "models" every model's every row.

    python benchmarks/decode_speed.py --model exp/ddtp-en-de --model exp/quickstart
    python benchmarks/decode_speed.py --model exp/qs --quick      # 1 round, 200 sentences, small memory check
    python benchmarks/decode_speed.py --model exp/qs --device cuda
    python benchmarks/decode_speed.py --model exp/qs --configs s2s_fp32_2x1,ct2_fp32_2x1   # only these rows
    python benchmarks/decode_speed.py --model exp/qs --isa avx2     # as a CPU with AVX2 alone would
    python benchmarks/decode_speed.py --model exp/qs --isa avx512_vnni   # as Cascade Lake would

``--isa avx2`` measures, on a CPU with AVX-512, what a CPU with AVX2 and FMA alone (AMD's Zen 2
and 3, Intel's Haswell to Comet Lake) runs: every engine capped to those instructions
(:data:`ISA_CAPS`: CTranslate2's, oneDNN's and torch's own switches; s2s's kernels compiled for
x86-64-v3), and no bf16 rows.  ``--isa avx512_vnni`` likewise measures a CPU with AVX-512 and VNNI
but no bf16 products (Intel's Cascade Lake and Ice Lake), ``--isa avx512`` one with AVX-512 alone
(Skylake-SP).  The cores' speed is still this CPU's, and torch's fbgemm (its int8 matrices) and
MKL take no cap.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "ddtp-en-de"
SEARCHES = (("beam5", 5), ("greedy", 1))
ISA_CAPS = {  # --isa's environments: CTranslate2's, oneDNN's and torch's caps, s2s's -march
    "avx2": {"CT2_FORCE_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
             "ATEN_CPU_CAPABILITY": "avx2", "S2S_MARCH": "x86-64-v3"},
    "avx512": {"CT2_FORCE_CPU_ISA": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX512_CORE",
               "ATEN_CPU_CAPABILITY": "avx512", "S2S_MARCH": "skylake-avx512"},
    "avx512_vnni": {"CT2_FORCE_CPU_ISA": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                    "DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ATEN_CPU_CAPABILITY": "avx512",
                    "S2S_MARCH": "cascadelake"}}

CT2_SCRIPT = """
import json, sys, time, ctranslate2, sentencepiece as spm
model, src, out, beam, batch, inter, intra, cap, device, compute = sys.argv[1:11]
sp = spm.SentencePieceProcessor(model_file=model + "/spm.model")
tr = ctranslate2.Translator(model, device=device, compute_type=compute,
                            inter_threads=int(inter), intra_threads=int(intra))
lines = open(src, encoding="utf-8").read().splitlines()
pieces = [sp.encode(x, out_type=str) for x in lines]
t0 = time.perf_counter()
res = tr.translate_batch(pieces, max_batch_size=int(batch), beam_size=int(beam), length_penalty=1.0,
                         max_decoding_length=int(cap), suppress_sequences=[["<s>"], ["<pad>"]])
steady = time.perf_counter() - t0
with open(out, "w", encoding="utf-8") as f:
    for r in res:
        f.write(sp.decode(r.hypotheses[0]) + "\\n")
print(json.dumps({"steady_s": steady}))
"""

# CTranslate2 on the GPU: greedy, float32, the first lines of the test set, and the same on the CPU;
# prints how many outputs agree (a cuBLAS that loads but computes wrongly shows here)
CT2_CUDA_PROBE = """
import json, sys, ctranslate2, sentencepiece as spm
model, src, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sp = spm.SentencePieceProcessor(model_file=model + "/spm.model")
pieces = [sp.encode(x, out_type=str) for x in open(src, encoding="utf-8").read().splitlines()[:n]]
outs = [[r.hypotheses[0] for r in ctranslate2.Translator(model, device=device, compute_type="float32")
         .translate_batch(pieces, beam_size=1, max_decoding_length=64)] for device in ("cuda", "cpu")]
print(json.dumps({"same": sum(a == b for a, b in zip(*outs)), "of": len(pieces)}))
"""
PROBE_LINES, PROBE_SECONDS = 8, 300
CT2_CUBLAS = "libcublas.so.12"  # the cuBLAS CTranslate2 4.x's wheels dlopen by name (built with CUDA 12)


def cublas_libraries(roots: list[Path]) -> list[Path]:
    """The cuBLAS shared libraries (libcublas.so.N) under ``roots``: the nvidia-* wheels' folders
    (``nvidia/cublas/lib``, ``nvidia/cu13/lib``) of each site-packages, or a CUDA toolkit's
    lib64: the one CTranslate2 asks for (:data:`CT2_CUBLAS`) first, then newest major version first."""
    found, name = [], CT2_CUBLAS.rsplit(".", 1)[0] + ".*"  # libcublas.so.*
    for root in roots:
        for pattern in (f"nvidia/*/lib/{name}", name, f"targets/*/lib/{name}"):
            found += [p for p in root.glob(pattern) if p.name.count(".") == 2 and p.name.rsplit(".", 1)[1].isdigit()]
    return sorted(set(found), key=lambda p: (p.name != CT2_CUBLAS, -int(p.name.rsplit(".", 1)[1])))


def cublas_roots() -> list[Path]:
    """Where :func:`cublas_libraries` looks: this interpreter's site-packages, then the CUDA toolkit."""
    import site

    return [Path(p) for p in [*site.getsitepackages(), *sys.path] if p and Path(p).is_dir()] + \
        [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda")]


def cublas_link_environ(library: Path, work: Path) -> dict:
    """An environment in which ``dlopen("libcublas.so.12")`` opens ``library``: its folder in
    LD_LIBRARY_PATH and, where it is another major version, behind a folder under ``work`` holding
    a link by that name to it (the link's $ORIGIN does not reach the library's libcublasLt)."""
    path = [str(library.parent), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    if library.name != CT2_CUBLAS:
        links = work / "cublas-link"
        links.mkdir(exist_ok=True)
        (links / CT2_CUBLAS).unlink(missing_ok=True)
        (links / CT2_CUBLAS).symlink_to(library)
        path.insert(0, str(links))
    return {"LD_LIBRARY_PATH": os.pathsep.join(path)}


def ct2_cuda_environ(ct2_model: Path, src: Path, work: Path) -> tuple[dict | None, str]:
    """(extra environment, note) with which CTranslate2 runs ``ct2_model`` on the GPU, or (None, why not).

    CTranslate2 4.x's wheels are built with CUDA 12 and open libcublas.so.12 by name
    (OpenNMT/CTranslate2#1933 asks for CUDA 13): on a machine with CUDA 13 alone (torch's cu130
    wheels) that fails.  The nine cuBLAS functions CTranslate2 calls (cublasCreate_v2,
    cublasGemmEx, cublasGemmStridedBatchedEx, ...) keep their names and signatures in cuBLAS 13,
    so where the probe fails for want of libcublas.so.12, it runs again with each cuBLAS found
    (:func:`cublas_libraries`) opened under that name, and the note says which ran.  The probe
    (:data:`CT2_CUDA_PROBE`) decodes ``src``'s first lines on the GPU and on the CPU: fewer than
    half the outputs alike is a GPU that computes wrongly, and no CTranslate2 rows."""
    def probe(extra: dict) -> tuple[str, str]:
        """(why it failed, or ""; how many outputs agreed)"""
        cmd = [sys.executable, "-c", CT2_CUDA_PROBE, str(ct2_model), str(src), str(PROBE_LINES)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **extra},
                                  timeout=PROBE_SECONDS)
        except subprocess.TimeoutExpired:
            return f"timed out after {PROBE_SECONDS} s", ""
        if done.returncode:
            return (done.stderr.strip().splitlines() or [exit_text(done.returncode)])[-1], ""
        agree = json.loads(done.stdout.strip().splitlines()[-1])
        if 2 * agree["same"] < agree["of"]:
            return f"its GPU outputs unlike its CPU's ({agree['same']} of {agree['of']} alike)", ""
        return "", f"{agree['same']} of {agree['of']} greedy outputs as on the CPU"

    why, agreed = probe({})
    if not why:
        return {}, f"CTranslate2 on the GPU: {agreed}"
    if CT2_CUBLAS not in why:
        return None, why
    tries = []
    for library in cublas_libraries(cublas_roots()):
        extra = cublas_link_environ(library, work)
        failure, agreed = probe(extra)
        if not failure:
            return extra, (f"CTranslate2 ran on {library}" + (f" as {CT2_CUBLAS}" if library.name != CT2_CUBLAS else "")
                           + f"; {agreed}")
        tries.append(f"{library}: {failure}")
    return None, why + (f"; in its stead {'; '.join(tries)}" if tries else " (and no cuBLAS found here to stand in)")


# the steady state of s2s's W workers as `s2s translate --workers W` runs them: W > 1, a TranslatorPool,
# timed once every worker has loaded its model and a warm-up pass of 64 W lines has run (its batches go
# to whichever worker is free); W = 1, the Translator in this process, as `--workers 1` decodes; a plain
# greedy or beam search the torch-free route takes (s2s.native_search), that search in W threads, as the
# CLI runs it
S2S_STEADY_SCRIPT = """
import io, json, sys, time
sys.path.insert(0, sys.argv[1])
from s2s.workers import TranslatorPool, TranslatorSpec
spec, src, workers = TranslatorSpec(**json.loads(sys.argv[2])), sys.argv[3], int(sys.argv[4])
lines = open(src, encoding="utf-8").read().splitlines()
out = io.StringIO()
from s2s.native_search import engine_for
from s2s.workers import CHUNK_LINES
engine = engine_for(spec)  # a plain search the torch-free route takes: `s2s translate`'s route
if engine is not None:
    def write(text, n_lines, n_tokens):
        out.write(text)
    engine.translate_stream(iter(lines[:64 * workers]), workers, CHUNK_LINES, 1, lambda *a: None)
    t0 = time.perf_counter()
    engine.translate_stream(iter(lines), workers, CHUNK_LINES, 1, write)
    steady = time.perf_counter() - t0
    n = out.getvalue().count(chr(10))
elif workers == 1:
    translator = spec.build()
    list(translator.translate_lines(lines[:2]))  # first-call costs (thread pools, allocator) are start-up
    t0 = time.perf_counter()
    n = sum(1 for _ in translator.translate_lines(lines))
    steady = time.perf_counter() - t0
else:
    with TranslatorPool(spec, workers) as pool:
        pool.wait_ready()
        pool.translate(lines[:64 * workers], io.StringIO())
        t0 = time.perf_counter()
        pool.translate(lines, out)
        steady = time.perf_counter() - t0
    n = out.getvalue().count(chr(10))
if n != len(lines):
    sys.exit(f"steady state: {n} lines out for {len(lines)} in")
print(json.dumps({"steady_s": steady, "lines": n}), flush=True)
"""

HF_SCRIPT = """
import json, sys, time
hf_dir, model_dir, src, out, beam, batch, threads, cap, repo, site, device = sys.argv[1:12]
sys.path.insert(0, repo)
if site:  # transformers installed by train_speed.hf_site: after this environment's packages
    sys.path.append(site)
import torch
from transformers import AutoModelForSeq2SeqLM
from pathlib import Path
from s2s.modeldir import load_spec
batch = int(batch)
torch.set_num_threads(int(threads))
tok = load_spec(Path(model_dir))[1]  # s2s's own ids: its vocabulary, prefix and </s>
model = AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval().to(device)
ids = tok.encode_src(open(src, encoding="utf-8").read().splitlines())
order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
outs = [""] * len(ids)
t0 = time.perf_counter()
with torch.inference_mode():
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        width = max(len(ids[i]) for i in rows)
        x = torch.tensor([ids[i] + [tok.pad_id] * (width - len(ids[i])) for i in rows], device=device)
        y = model.generate(input_ids=x, attention_mask=(x != tok.pad_id).long(), num_beams=int(beam),
                           do_sample=False, length_penalty=1.0, early_stopping=False, max_new_tokens=int(cap))
        for i, hyp in zip(rows, y.tolist()):
            outs[i] = tok.decode_tgt(hyp)
steady = time.perf_counter() - t0
with open(out, "w", encoding="utf-8") as f:
    f.write("".join(o + "\\n" for o in outs))
print(json.dumps({"steady_s": steady}))
"""


# --------------------------------------------------------------------------- #
# Configurations
# --------------------------------------------------------------------------- #

def splits(cores: int) -> list[tuple[int, int]]:
    """Every (processes, threads) with processes x threads = cores, one process first."""
    return [(cores // t, t) for t in range(cores, 0, -1) if cores % t == 0]


def cpu_has_bf16() -> bool:
    """Native bf16 matmuls: the CPU flags avx512_bf16 or amx_bf16 (and no ``--isa`` cap)."""
    if any(os.environ.get("S2S_MARCH") == cap["S2S_MARCH"] for cap in ISA_CAPS.values()):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


@dataclass
class Config:
    engine: str  # s2s, ct2 or hf
    name: str  # e.g. s2s_fp32_2x1
    precision: str  # fp32, int8, bf16, fp16; for s2s also auto and the *shortlist ones (s2s_arithmetic)
    procs: int  # s2s workers, CTranslate2 inter_threads
    threads: int  # s2s threads per worker, CTranslate2 intra_threads
    whole_sent_s: list[float] = field(default_factory=list)
    steady_sent_s: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    bleu: float | None = None
    failed: str = ""  # why its process failed (it runs no more rounds)


def configurations(device: str, cores: int, engines: set[str], has_ct2: bool, has_hf: bool,
                   has_shortlist: bool) -> list[Config]:
    """The configurations this machine has, in the order each round runs them."""
    out = []
    if device == "cpu":
        s2s_precisions = ["fp32", "int8"] + (["bf16", "auto"] if cpu_has_bf16() else [])
        ct2_precisions = ["fp32", "int8"]
        core_splits = splits(cores)
    else:  # one process drives the GPU
        s2s_precisions, ct2_precisions, core_splits = ["fp32", "bf16"], ["fp32", "fp16", "bf16"], [(1, 1)]
    if has_shortlist:
        s2s_precisions += ["shortlist"] + (["int8shortlist"] if device == "cpu" else [])
        s2s_precisions += ["bf16shortlist"] if "bf16" in s2s_precisions else []
        s2s_precisions += ["autoshortlist"] if "auto" in s2s_precisions else []
    for p in s2s_precisions if "s2s" in engines else []:
        out += [Config("s2s", f"s2s_{p}_{w}x{t}", p, w, t) for w, t in core_splits]
    for p in ct2_precisions if "ct2" in engines and has_ct2 else []:
        out += [Config("ct2", f"ct2_{p}_{i}x{j}", p, i, j) for i, j in core_splits]
    if "hf" in engines and has_hf:
        out.append(Config("hf", "hf_fp32_1x" + str(cores if device == "cpu" else 1), "fp32", 1,
                          cores if device == "cpu" else 1))
    return out


CT2_COMPUTE = {"fp32": "float32", "int8": "int8", "fp16": "float16", "bf16": "bfloat16"}


# --------------------------------------------------------------------------- #
# Running one configuration
# --------------------------------------------------------------------------- #

def descendants_peak_rss_mib(root: int) -> float:
    """The largest VmHWM (peak RSS) among the processes below ``root`` now, in MiB (Linux /proc;
    0 elsewhere).  ``s2s translate --workers`` forks its workers from a forkserver that does not
    wait for them, so their peaks never reach the parent's ru_maxrss: they are read here."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(pid)
    peak, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) / 1024)
        except OSError:
            pass
    return peak


class RunFailed(Exception):
    """A configuration's process failed: its row says so (``summary``: how it ended, and its
    stderr's last line), and the other configurations run on; ``detail``: the command and more."""

    def __init__(self, summary: str, detail: str):
        super().__init__(summary)
        self.summary, self.detail = summary, detail


def exit_text(returncode: int) -> str:
    """A process's end as words: "exit status 1", "killed by SIGSEGV"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def run(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> tuple[float, float, str]:
    """Run ``cmd`` (``env``: variables added to this process's; killed after ``timeout`` seconds);
    return (seconds, peak RSS in MiB of its largest process, its stdout).  The peak is the larger
    of ru_maxrss (the process and the children it waited for) and the descendants' VmHWM, read
    every 0.25 s while it runs (see :func:`descendants_peak_rss_mib`).  A process that fails or
    runs out of time is :class:`RunFailed`: how it ended, then its stderr's last lines."""
    import threading

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **env} if env else None)
        ended, sampled, late = threading.Event(), [0.0], threading.Event()

        def sample() -> None:
            while not ended.wait(0.25):
                sampled[0] = max(sampled[0], descendants_peak_rss_mib(proc.pid))
                if timeout is not None and time.perf_counter() - t0 > timeout and not late.is_set():
                    late.set()
                    proc.kill()

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss: the largest of it and its waited-for children
        seconds = time.perf_counter() - t0
        ended.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            err.seek(0)
            shown = " ".join(cmd[:2] + ["SCRIPT"] + cmd[3:] if cmd[1:2] == ["-c"] else cmd)
            end = f"timed out after {timeout:g} s" if late.is_set() else exit_text(proc.returncode)
            tail = err.read().decode(errors="replace").strip().splitlines()[-20:]
            raise RunFailed(": ".join([end, *tail[-1:]]), "\n".join([f"`{shown}`: {end}", *tail]))
        out.seek(0)
        return seconds, max(usage.ru_maxrss / 1024, sampled[0]), out.read().decode()


def decode_flags(beam: int, batch: int, cap: int) -> dict:
    """The decode settings every s2s configuration shares (see the module docstring)."""
    return {"beam": beam, "batch_size": batch, "batch_tokens": 1_000_000, "length_penalty": "power", "alpha": 1.0,
            "stop": "early", "max_len_a": 0.0, "max_len_b": cap}


def s2s_arithmetic(c: Config) -> tuple[str, bool, bool]:
    """An s2s configuration's (precision, int8, shortlist): --precision, --quantize int8, --shortlist."""
    shortlist = c.precision.endswith("shortlist")
    arithmetic = c.precision[:-len("shortlist")] if shortlist else c.precision  # "" for fp32 with a shortlist
    return ("bf16" if arithmetic == "bf16" else "auto" if arithmetic == "auto" else "fp32", arithmetic == "int8",
            shortlist)


def s2s_command(model: Path, src: Path, hyp: Path, c: Config, device: str, flags: dict) -> list[str]:
    cli = [sys.executable, "-m", "s2s", "-q", "translate", "-m", str(model), "--input", str(src), "-o", str(hyp),
           "--device", device, "--workers", str(c.procs), "--threads", str(c.threads)]
    for key, value in flags.items():
        cli += ["--set", f"decode.{key}={value}"]
    precision, int8, shortlist = s2s_arithmetic(c)
    cli += ["--precision", precision]
    cli += (["--quantize", "int8"] if int8 else []) + (["--shortlist"] if shortlist else [])
    return cli


def s2s_steady_seconds(model: Path, src: Path, c: Config, device: str, flags: dict,
                       timeout: float | None = None) -> float:
    """Steady state of ``c`` as ``s2s translate`` runs it (W > 1: a TranslatorPool of W workers; W = 1:
    one process), the models loaded and warmed up; seconds to translate every line."""
    precision, int8, shortlist = s2s_arithmetic(c)
    overrides = {**flags, "shortlist": True} if shortlist else flags
    spec = {"models": [str(model)], "overrides": overrides, "device": device, "threads": c.threads,
            "precision": precision, "quantize": "int8" if int8 else None}
    _, _, stdout = run([sys.executable, "-c", S2S_STEADY_SCRIPT, str(REPO), json.dumps(spec), str(src), str(c.procs)],
                       timeout=timeout)
    return json.loads(stdout.strip().splitlines()[-1])["steady_s"]


# --------------------------------------------------------------------------- #
# One model
# --------------------------------------------------------------------------- #

def export_hf(model: Path, out: Path) -> bool:
    """``s2s export hf``; False (the reason on stderr) where no Hugging Face family fits."""
    done = subprocess.run([sys.executable, "-m", "s2s", "export", "hf", "-m", str(model), "-o", str(out)],
                          check=False, capture_output=True, text=True)
    if done.returncode:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        print(f"decode_speed: {model}: no Hugging Face generate rows: {why}", file=sys.stderr)
    return done.returncode == 0


def run_config(c: Config, model: Path, src: Path, hyp: Path, beam: int, cap: int, args, work: Path, flags: dict,
               hf_site_dir: str | None, ct2_env: dict) -> tuple[float, float, float]:
    """One round of configuration ``c``, its output in ``hyp``: (whole-process seconds, peak RSS in
    MiB, steady-state seconds); :class:`RunFailed` where one of its processes failed."""
    if c.engine == "s2s":
        seconds, rss, _ = run(s2s_command(model, src, hyp, c, args.device, flags), timeout=args.process_timeout)
        return seconds, rss, s2s_steady_seconds(model, src, c, args.device, flags, args.process_timeout)
    if c.engine == "ct2":
        cmd = [sys.executable, "-c", CT2_SCRIPT, str(work / "ct2"), str(src), str(hyp), str(beam),
               str(args.batch), str(c.procs), str(c.threads), str(cap), args.device, CT2_COMPUTE[c.precision]]
    else:
        cmd = [sys.executable, "-c", HF_SCRIPT, str(work / "hf"), str(model), str(src), str(hyp), str(beam),
               str(args.batch), str(c.threads), str(cap), str(REPO), hf_site_dir, args.device]
    seconds, rss, stdout = run(cmd, ct2_env if c.engine == "ct2" else None, args.process_timeout)
    return seconds, rss, json.loads(stdout.strip().splitlines()[-1])["steady_s"]


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def bench_model(model: Path, args, work: Path, src: Path, refs: list[str], n: int) -> dict:
    """Every configuration of one model, both searches; returns its rows and best configurations."""
    import sacrebleu

    from s2s.modeldir import load_spec

    cfg, tok = load_spec(model)[:2]
    decode = cfg.decode
    cap = max(int(decode.max_len_a * len(tok.encode_src([x])[0]) + decode.max_len_b)
              for x in src.read_text(encoding="utf-8").splitlines())
    engines = set(args.engines.split(","))
    has_ct2, ct2_env, ct2_note = False, {}, ""
    if "ct2" in engines:
        try:
            import ctranslate2  # noqa: F401

            done = subprocess.run([sys.executable, "-m", "s2s", "export", "ct2", "-m", str(model),
                                   "-o", str(work / "ct2")], check=False, capture_output=True, text=True)
            has_ct2 = done.returncode == 0
            if not has_ct2:
                print(f"decode_speed: {model}: no CTranslate2 rows: {done.stderr.strip()}", file=sys.stderr)
            elif args.device == "cuda":
                ct2_env, ct2_note = ct2_cuda_environ(work / "ct2", src, work)
                has_ct2 = ct2_env is not None
                print(f"decode_speed: {model}: " + (ct2_note if has_ct2 else f"no CTranslate2 rows: {ct2_note}"),
                      file=sys.stderr)
        except ImportError:
            print("decode_speed: ctranslate2 is not installed; its rows are skipped", file=sys.stderr)
    hf_site_dir = None
    if "hf" in engines and export_hf(model, work / "hf"):
        sys.path.insert(0, str(REPO / "benchmarks"))
        from train_speed import hf_site

        try:
            hf_site_dir = hf_site()
        except subprocess.CalledProcessError:
            print("decode_speed: transformers could not be installed; no Hugging Face rows", file=sys.stderr)

    has_shortlist = (model / "shortlist.safetensors").is_file()
    if "s2s" in engines and not has_shortlist:
        print(f"decode_speed: {model}/shortlist.safetensors missing (`s2s shortlist CONFIG -m {model}`); "
              "no s2s shortlist rows", file=sys.stderr)
    result: dict = {"model": str(model), "max_output_tokens": cap, "rows": []}
    if ct2_note:
        result["ct2_note"] = ct2_note
    for search, beam in SEARCHES:
        configs = configurations(args.device, args.cores, engines, has_ct2, hf_site_dir is not None,
                                 has_shortlist)
        if args.configs:
            configs = [c for c in configs if c.name in args.configs]
        flags = decode_flags(beam, args.batch, cap)
        for rnd in range(args.rounds):
            for c in configs:
                if c.failed:
                    continue
                print(f"decode_speed: {model.name} {search} round {rnd + 1}/{args.rounds}: {c.name}", file=sys.stderr)
                hyp = work / f"{c.name}-{search}.txt"
                try:
                    seconds, rss, steady = run_config(c, model, src, hyp, beam, cap, args, work, flags, hf_site_dir,
                                                      ct2_env)
                except RunFailed as e:
                    c.failed = e.summary
                    print(f"decode_speed: {c.name} {search}: {e.detail}", file=sys.stderr)
                    continue
                c.whole_sent_s.append(n / seconds)
                c.steady_sent_s.append(n / steady)
                c.rss_mib.append(rss)
                if c.bleu is None:
                    c.bleu = sacrebleu.corpus_bleu(hyp.read_text(encoding="utf-8").splitlines(), [refs]).score
        for c in configs:
            if c.failed:
                result["rows"].append({"config": c.name, "engine": c.engine, "search": search, "failed": c.failed})
                continue
            result["rows"].append({"config": c.name, "engine": c.engine, "search": search,
                                   "whole_sent_s": summary(c.whole_sent_s), "steady_sent_s": summary(c.steady_sent_s),
                                   "rss_mib": round(statistics.median(c.rss_mib)), "bleu": round(c.bleu, 2)})
        for engine in ("s2s", "ct2", "hf"):
            mine = [r for r in result["rows"] if r["engine"] == engine and r["search"] == search and "failed" not in r]
            best = max(mine, key=lambda r: r["whole_sent_s"]["median"], default=None)
            result[f"{engine}_best_{search}_sent_s"] = best and best["whole_sent_s"]["median"]
            result[f"{engine}_best_{search}_steady_sent_s"] = best and best["steady_sent_s"]["median"]
            result[f"{engine}_best_{search}_bleu"] = best and best["bleu"]
            result[f"{engine}_best_{search}_config"] = best and best["config"]
    return result


def memory_check(model: Path, args, work: Path, src: Path) -> dict:
    """Peak RSS of ``s2s translate`` (greedy, one worker) on ``--memory-lines`` lines vs the test lines."""
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    big = work / "memory.en"
    with big.open("w", encoding="utf-8") as f:
        for i in range(args.memory_lines):
            f.write(lines[i % len(lines)])
    rss = {}
    for name, path in (("small", src), ("big", big)):
        print(f"decode_speed: memory check, {name} input ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "s2s", "-q", "translate", "-m", str(model), "--input", str(path),
               "-o", str(work / f"memory-{name}.txt"), "--beam", "1", "--workers", "1", "--threads",
               str(args.cores if args.device == "cpu" else 1), "--device", args.device]
        rss[name] = run(cmd, timeout=args.process_timeout)[1]
    return {"memory_lines": args.memory_lines, "memory_small_lines": len(lines),
            "memory_rss_small_mib": round(rss["small"]), "memory_rss_big_mib": round(rss["big"]),
            "memory_ratio": round(rss["big"] / rss["small"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, action="append", required=True,
                    help="a trained s2s model directory (repeatable; the first one gives the headline keys)")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3, help="configurations take turns this many times")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 1 round, 200 sentences, memory check on 2,000 lines")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                    help="cores to split between processes and threads (default: all usable)")
    ap.add_argument("--batch", type=int, default=64, help="sentences per batch")
    ap.add_argument("--engines", default="s2s,ct2,hf", help="comma-separated subset of s2s, ct2, hf")
    ap.add_argument("--configs", type=lambda v: set(v.split(",")), default=None,
                    help="only these configurations, comma-separated (e.g. s2s_fp32_2x1,ct2_int8_2x1)")
    ap.add_argument("--memory-lines", type=int, default=200_000,
                    help="lines of the memory check's big input (0: no memory check)")
    ap.add_argument("--process-timeout", type=float, default=1800,
                    help="seconds after which a configuration's process is killed (its row says so)")
    ap.add_argument("--isa", choices=("native", *ISA_CAPS), default="native",
                    help="avx2: every engine capped to AVX2 and FMA, as on a CPU without AVX-512; avx512: to "
                         "AVX-512 alone (Skylake-SP); avx512_vnni: with VNNI (Cascade Lake; see above)")
    args = ap.parse_args()
    if args.isa != "native":
        os.environ.update(ISA_CAPS[args.isa])
    if not set(args.engines.split(",")) <= {"s2s", "ct2", "hf"}:
        ap.error(f"--engines: {args.engines!r} is not a subset of s2s,ct2,hf")
    for model in args.model:
        if not (model / "config.yaml").is_file():
            ap.error(f"--model: {model} is not an s2s model directory (no config.yaml)")
    if args.quick:
        args.rounds, args.sentences = 1, 200
        args.memory_lines = min(args.memory_lines, 2000)
    # s2s's bytecode compiled once, as `pip install` leaves an installed package: run from a source
    # tree under PYTHONDONTWRITEBYTECODE, every s2s process would compile its modules anew (0.07-0.09 s
    # of each start on the Zen 4), which CTranslate2's script, importing no s2s, never pays
    import compileall

    compileall.compile_dir(str(REPO / "s2s"), quiet=1)
    n = args.sentences
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA GPU")
    if args.device == "cpu":  # s2s's kernels compiled once here too (its cache), as after an installed
        from s2s import native_search  # s2s's first command: else the first round's first process of
        from s2s.model import native  # each route compiles them, seconds in its whole-process time

        native_search.library()
        native.library()
    with tempfile.TemporaryDirectory(prefix="s2s-decode-") as tmp:
        work = Path(tmp)
        src, ref = work / "test.en", work / "test.de"
        for path, name in ((src, "test.en.gz"), (ref, "test.de.gz")):
            with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
                path.write_text("".join(line for _, line in zip(range(n), f)), encoding="utf-8")
        refs = ref.read_text(encoding="utf-8").splitlines()
        models = []
        for i, model in enumerate(args.model):
            (work / str(i)).mkdir()
            models.append(bench_model(model, args, work / str(i), src, refs, n))
        try:
            memory = memory_check(args.model[0], args, work, src) if args.memory_lines else {}
        except RunFailed as e:
            print(f"decode_speed: memory check: {e.detail}", file=sys.stderr)
            memory = {"memory_failed": e.summary}

    where = cpu_name() if args.device == "cpu" else torch.cuda.get_device_name(0)
    if args.isa != "native":
        where += f", every engine capped to {args.isa.upper()} (--isa {args.isa})"
    print(f"# {where}; {args.cores} cores; {n} sentences; {args.rounds} round(s); batch {args.batch}; "
          f"sentences/s median [min-max]")
    for m in models:
        print(f"## {m['model']}" + (f" ({m['ct2_note']})" if "ct2_note" in m else ""))
        print(f"{'config':18s} {'search':7s} {'whole sent/s':>22s} {'steady sent/s':>22s} {'RSS MiB':>8s} {'BLEU':>6s}")
        for r in m["rows"]:
            if "failed" in r:
                print(f"{r['config']:18s} {r['search']:7s} failed: {r['failed']}")
                continue
            w, s = r["whole_sent_s"], r["steady_sent_s"]
            print(f"{r['config']:18s} {r['search']:7s} {w['median']:8.1f} [{w['min']:5.1f}-{w['max']:5.1f}]"
                  f" {s['median']:8.1f} [{s['min']:5.1f}-{s['max']:5.1f}] {r['rss_mib']:8d} {r['bleu']:6.2f}")
    if "memory_failed" in memory:
        print(f"# memory check failed: {memory['memory_failed']}")
    elif memory:
        print(f"# memory: peak RSS {memory['memory_rss_big_mib']} MiB on {memory['memory_lines']} lines vs "
              f"{memory['memory_rss_small_mib']} MiB on {memory['memory_small_lines']}: "
              f"ratio {memory['memory_ratio']} (goal <= 1.5)")
    head = {k: v for k, v in models[0].items() if k != "rows"}
    print(json.dumps({**head, **memory, "device": args.device, "cpu_or_gpu": where, "isa": args.isa,
                      "cores": args.cores, "sentences": n, "rounds": args.rounds, "batch": args.batch,
                      "models": models}))
    failed = [f"{m['model']}: {r['config']} {r['search']}" for m in models for r in m["rows"]
              if "failed" in r and r["engine"] == "s2s"] + (["the memory check"] if "memory_failed" in memory else [])
    if failed:  # the competitors' failures are theirs (their rows say why); s2s's fail the run
        sys.exit(f"decode_speed: s2s failed in {', '.join(failed)}")


if __name__ == "__main__":
    main()
