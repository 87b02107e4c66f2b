"""benchmarks/decode_speed.py's machinery for machines it has not run on.

CTranslate2 on the GPU: its wheels open libcublas.so.12 by name; where a machine has another cuBLAS
(CUDA 13's libcublas.so.13 from torch's nvidia wheels), the benchmark opens that one under the
name.  Checked with stand-in libraries built by the C compiler under a made-up name (so that no
cuBLAS of this machine takes part) and a probe that opens its library as CTranslate2 would.
A configuration's process that crashes or hangs is a row saying so."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_benchmark

FAKE = "libs2sfake.so.12"  # what the probe below asks for, as CTranslate2 asks for libcublas.so.12


def probe_script(same: int = 8) -> str:
    """A probe that fails as CTranslate2 does without the library, and otherwise reports ``same``
    of 8 outputs alike on GPU and CPU (once the library's cublasGemmEx answers 13)."""
    return f"""
import ctypes, sys
try:
    lib = ctypes.CDLL("{FAKE}")
except OSError:
    sys.exit("RuntimeError: Library {FAKE} is not found or cannot be loaded")
assert lib.cublasGemmEx() == 13
print('{{"same": {same}, "of": 8}}')
"""


@pytest.fixture
def bench(monkeypatch, tmp_path):
    module = load_benchmark("decode_speed", monkeypatch)
    monkeypatch.setattr(module, "CT2_CUBLAS", FAKE)
    monkeypatch.setattr(module, "cublas_roots", lambda: [tmp_path / "site"])
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    return module


def _library(path: Path, body: str, needs: str = "") -> Path:
    """A shared library at ``path`` built from C ``body``, linked against ``needs`` (in the same
    folder, found through $ORIGIN, as libcublas finds libcublasLt)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_name(path.name.replace(".", "_") + ".c")
    source.write_text(body)
    link = [f"-L{path.parent}", f"-l:{needs}", "-Wl,-rpath,$ORIGIN"] if needs else []
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(source), *link], check=True)
    return path


def _cublas(lib: Path, major: int) -> Path:
    """libs2sfake.so.MAJOR in ``lib``, whose cublasGemmEx calls its libs2sfakeLt (returning 13)."""
    _library(lib / f"libs2sfakeLt.so.{major}", "int lt(void) { return 13; }\n")
    return _library(lib / f"libs2sfake.so.{major}", "int lt(void); int cublasGemmEx(void) { return lt(); }\n",
                    needs=f"libs2sfakeLt.so.{major}")


def test_cublas_libraries_the_asked_for_name_first_then_newest(bench, tmp_path):
    for name in ("nvidia/cu13/lib/libs2sfake.so.13", "nvidia/cu13/lib/libs2sfakeLt.so.13",
                 "nvidia/cu13/lib/libs2sfake.so.13.1.0", "nvidia/cu14/lib/libs2sfake.so.14",
                 "nvidia/cublas/lib/libs2sfake.so.12"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert bench.cublas_libraries([tmp_path]) == [tmp_path / "nvidia/cublas/lib/libs2sfake.so.12",
                                                  tmp_path / "nvidia/cu14/lib/libs2sfake.so.14",
                                                  tmp_path / "nvidia/cu13/lib/libs2sfake.so.13"]


def test_ct2_on_cuda_opens_another_major_version_under_the_asked_for_name(bench, tmp_path, monkeypatch):
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    cublas = _cublas(lib, 13)
    # a newer one that loads but lacks the function: tried first, then its link replaced
    _library(tmp_path / "site" / "nvidia" / "cu14" / "lib" / "libs2sfake.so.14", "int other(void) { return 0; }\n")
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", probe_script())
    env, note = bench.ct2_cuda_environ(tmp_path / "ct2", tmp_path / "src", tmp_path)
    assert env == {"LD_LIBRARY_PATH": f"{tmp_path / 'cublas-link'}:{lib}"}
    assert (tmp_path / "cublas-link" / FAKE).resolve() == cublas
    assert note == f"CTranslate2 ran on {cublas} as {FAKE}; 8 of 8 greedy outputs as on the CPU"
    # the library's own folder is needed: the link's $ORIGIN is the link's folder, not libs2sfakeLt's
    only_link = {"LD_LIBRARY_PATH": str(tmp_path / "cublas-link")}
    done = subprocess.run([sys.executable, "-c", probe_script()], env=only_link, capture_output=True, text=True)
    assert done.returncode != 0


def test_ct2_on_cuda_that_computes_unlike_its_cpu_has_no_rows(bench, tmp_path, monkeypatch):
    cublas = _cublas(tmp_path / "site" / "nvidia" / "cu13" / "lib", 13)
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", probe_script(same=3))
    assert bench.ct2_cuda_environ(tmp_path / "ct2", tmp_path / "src", tmp_path) == (
        None, f"RuntimeError: Library {FAKE} is not found or cannot be loaded; "
              f"in its stead {cublas}: its GPU outputs unlike its CPU's (3 of 8 alike)")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "site" / "nvidia" / "cu13" / "lib"))
    (tmp_path / "site" / "nvidia" / "cu13" / "lib" / FAKE).symlink_to("libs2sfake.so.13")  # found at once
    assert bench.ct2_cuda_environ(tmp_path / "ct2", tmp_path / "src", tmp_path) == (
        None, "its GPU outputs unlike its CPU's (3 of 8 alike)")


def test_ct2_on_cuda_without_the_library_or_another_failure_says_why(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", probe_script())
    assert bench.ct2_cuda_environ(tmp_path, tmp_path, tmp_path) == (
        None, f"RuntimeError: Library {FAKE} is not found or cannot be loaded (and no cuBLAS found here to stand in)")
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", "import sys; sys.exit('RuntimeError: no CUDA-capable device')")
    assert bench.ct2_cuda_environ(tmp_path, tmp_path, tmp_path) == (None, "RuntimeError: no CUDA-capable device")


def test_a_process_that_crashes_or_hangs_is_run_failed(bench):
    with pytest.raises(bench.RunFailed) as e:
        bench.run([sys.executable, "-c", "import os, sys; print('half', file=sys.stderr, flush=True); os.abort()"])
    assert e.value.summary == "killed by SIGABRT: half"
    assert e.value.detail.splitlines() == [f"`{sys.executable} -c SCRIPT`: killed by SIGABRT", "half"]
    with pytest.raises(bench.RunFailed) as e:
        bench.run(["sleep", "30"], timeout=0.5)
    assert (e.value.summary, e.value.detail) == ("timed out after 0.5 s", "`sleep 30`: timed out after 0.5 s")
    assert bench.run([sys.executable, "-c", "print('out')"], timeout=30)[2] == "out\n"


def test_a_failing_s2s_configuration_is_a_row_and_fails_the_run(prepared, tmp_path):
    """A model whose weights cannot be read: every s2s row says how its process ended, the table
    and the JSON line are still printed, and the run's exit status is non-zero."""
    import json

    from tests.conftest import untrained_model_dir

    model = untrained_model_dir(prepared, tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"not safetensors")
    done = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "decode_speed.py"),
                           "--model", str(model), "--engines", "s2s", "--configs", "s2s_fp32_1x1", "--cores", "1",
                           "--sentences", "4", "--rounds", "1", "--memory-lines", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (f"decode_speed: s2s failed in {model}: s2s_fp32_1x1 beam5, "
                                                    f"{model}: s2s_fp32_1x1 greedy")
    rows = json.loads(done.stdout.strip().splitlines()[-1])["models"][0]["rows"]
    assert [(r["config"], r["search"]) for r in rows] == [("s2s_fp32_1x1", "beam5"), ("s2s_fp32_1x1", "greedy")]
    assert all(r["failed"].startswith("exit status 1: ") and "model.safetensors" in r["failed"] for r in rows)
    assert f"s2s_fp32_1x1       beam5   failed: {rows[0]['failed']}" in done.stdout
