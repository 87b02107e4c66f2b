"""benchmarks/decode_speed.py's CTranslate2-on-the-GPU set-up: CTranslate2's wheels open
libcublas.so.12 by name; where a machine has another cuBLAS (CUDA 13's libcublas.so.13 from torch's
nvidia wheels), the benchmark opens that one under the name.  Checked here with a stand-in library
built by the C compiler and a probe that opens it as CTranslate2 would."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_speed.py"

# a probe that fails as CTranslate2 does without libcublas.so.12 and runs once it opens with the
# function CTranslate2 calls
PROBE = """
import ctypes, sys
try:
    assert ctypes.CDLL("libcublas.so.12").cublasGemmEx() == 13
except OSError:
    sys.exit("RuntimeError: Library libcublas.so.12 is not found or cannot be loaded")
"""


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("decode_speed_benchmark", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _library(path: Path, needs: str = "") -> Path:
    """A shared library at ``path`` whose cublasGemmEx returns 13 (calling ``needs``'s symbol, if
    given, so that the loader must find that library too, as libcublas needs libcublasLt)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_suffix(".c")
    if needs:
        source.write_text("int lt(void); int cublasGemmEx(void) { return lt(); }\n")
        link = [f"-L{path.parent}", f"-l:{needs}", "-Wl,-rpath,$ORIGIN"]
    else:
        source.write_text("int lt(void) { return 13; }\n")
        link = []
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(source), *link], check=True)
    return path


def test_cublas_libraries_newest_major_first(bench, tmp_path):
    for name in ("nvidia/cublas/lib/libcublas.so.12", "nvidia/cu13/lib/libcublas.so.13",
                 "nvidia/cu13/lib/libcublasLt.so.13", "nvidia/cu13/lib/libcublas.so.13.1.0"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert bench.cublas_libraries([tmp_path]) == [tmp_path / "nvidia/cu13/lib/libcublas.so.13",
                                                  tmp_path / "nvidia/cublas/lib/libcublas.so.12"]


def test_ct2_on_cuda_opens_cublas_13_as_12(bench, tmp_path, monkeypatch):
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    _library(lib / "libcublasLt.so.13")
    cublas = _library(lib / "libcublas.so.13", needs="libcublasLt.so.13")
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", PROBE)
    monkeypatch.setattr(bench, "cublas_roots", lambda: [tmp_path / "site"])
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    env, note = bench.ct2_cuda_environ(tmp_path / "ct2", tmp_path)
    assert env == {"LD_LIBRARY_PATH": f"{tmp_path / 'cublas-link'}:{lib}"}
    assert (tmp_path / "cublas-link" / "libcublas.so.12").resolve() == cublas
    assert note == f"CTranslate2 ran on {cublas} as libcublas.so.12"
    # the library's own folder matters: a link's $ORIGIN is the link's folder, not libcublasLt's
    only_link = {"LD_LIBRARY_PATH": str(tmp_path / "cublas-link")}
    done = subprocess.run([sys.executable, "-c", PROBE], env=only_link, capture_output=True, text=True)
    assert done.returncode != 0


def test_ct2_on_cuda_without_any_cublas_says_why(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", PROBE)
    monkeypatch.setattr(bench, "cublas_roots", lambda: [tmp_path])
    env, note = bench.ct2_cuda_environ(tmp_path / "ct2", tmp_path)
    assert env is None
    assert note == ("RuntimeError: Library libcublas.so.12 is not found or cannot be loaded "
                    "(and no cuBLAS found here stood in for it)")


def test_ct2_on_cuda_other_failure_is_reported_as_is(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CT2_CUDA_PROBE", "import sys; sys.exit('RuntimeError: no CUDA-capable device')")
    assert bench.ct2_cuda_environ(tmp_path, tmp_path) == (None, "RuntimeError: no CUDA-capable device")
