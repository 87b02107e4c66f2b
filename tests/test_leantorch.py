"""s2s.leantorch: torch imported for decoding with its meta kernels and torch.export deferred.

Each check runs in a fresh interpreter: this one imported torch whole long ago."""

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import untrained_model_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
from s2s.leantorch import DEFERRED, complete_torch, deferred, import_torch
torch = import_torch()
def meta_take():  # aten::take has a Python meta kernel only (torch._meta_registrations)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::take", "Meta")
"""


def probe(body: str) -> str:
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                       timeout=180, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def model_dir(prepared, tmp_path_factory):
    return untrained_model_dir(prepared, tmp_path_factory.mktemp("leantorch") / "model")


def test_import_defers_until_complete():
    out = probe("""
        assert deferred() == sorted(DEFERRED), deferred()
        assert not meta_take()
        import inspect
        inspect.getmodule(torch.add)  # reads every module's __file__: nothing runs
        linear = torch.nn.Linear(4, 3)
        x = torch.arange(8.0).view(2, 4)
        assert torch.equal(linear(x), x @ linear.weight.T + linear.bias)  # CPU operations as ever
        assert deferred() == sorted(DEFERRED)
        complete_torch()
        assert deferred() == [] and meta_take()
        assert callable(torch.export.export)
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.parametrize("use", [
    "import torch._decomp.decompositions",  # a module torch imports only from the meta kernels
    "torch.export.export",  # an attribute
    "import torch.export.exported_program",  # a submodule (__path__)
    "import torch.export; torch.export.export",  # an attribute after a bare import
])
def test_first_use_runs_them_all_in_torchs_order(use):
    """Running only the module used, in the middle of another torch import, breaks torch's import
    cycles (``import torch._decomp.decompositions`` then fails: duplicate registrations)."""
    out = probe(f"""
        {use}
        assert deferred() == [] and meta_take()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_decoding_uses_none_of_them(model_dir):
    """The lean import pays only while decoding leaves them deferred: fp32 and int8, greedy and beam,
    through TranslatorSpec(lean_torch=True), as `s2s translate` builds its translator."""
    out = probe(f"""
        from s2s.workers import TranslatorSpec
        for quantize in (None, "int8"):
            for beam in (1, 3):
                spec = TranslatorSpec(({str(model_dir)!r},), {{"beam": beam}}, device="cpu", quantize=quantize,
                                      threads=1, lean_torch=True)
                assert len(spec.build().translate(["a b c", "port scanner"])) == 2
        assert deferred() == sorted(DEFERRED), deferred()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_sampling_runs_them_first(model_dir):
    """torch.Generator needs torch._prims.rng_prims, which only the meta kernels import: --sampling
    runs them before its first batch (without it: "torch.Generator() cannot be called before the
    opaque metaclass is set")."""
    out = probe(f"""
        from s2s.workers import TranslatorSpec
        spec = TranslatorSpec(({str(model_dir)!r},), {{"sampling": True, "seed": 5}}, device="cpu", threads=1,
                              lean_torch=True)
        translator = spec.build()
        assert deferred() == sorted(DEFERRED)
        first = translator.translate(["a b c", "port scanner"])
        assert deferred() == [] and translator.translate(["a b c", "port scanner"]) == first
        print("ok")
    """)
    assert out.strip() == "ok"


def test_cli_translate_in_its_own_process_imports_lean(model_dir, tmp_path):
    (tmp_path / "in.txt").write_text("a b c\nport scanner\n")
    out = probe(f"""
        import sys
        from s2s.cli import run
        sys.argv = ["s2s", "translate", "-m", {str(model_dir)!r}, "--workers", "1", "-i", {str(tmp_path / "in.txt")!r},
                    "-o", {str(tmp_path / "out.txt")!r}]
        try:
            run()
        except SystemExit as e:
            assert not e.code, e.code
        assert deferred() == sorted(DEFERRED), deferred()
        print("ok")
    """)
    assert out.strip() == "ok"
    assert (tmp_path / "out.txt").read_text().count("\n") == 2


def test_forkserver_workers_start_lean():
    """The translate workers' forkserver (s2s.workerboot) imports torch lean and the decoder once."""
    from s2s.leantorch import DEFERRED
    from s2s.workers import worker_context

    ctx = worker_context()
    if ctx.get_start_method() != "forkserver":
        pytest.skip("no forkserver on this platform")
    results = ctx.Queue()
    look = "import sys\nfrom s2s.leantorch import deferred\nresults.put((deferred(), 's2s.translate' in sys.modules))"
    p = ctx.Process(target=exec, args=(look, {"results": results}))  # exec: nothing of this module to import
    p.start()
    try:
        assert results.get(timeout=120) == (sorted(DEFERRED), True)
    finally:
        p.join(timeout=60)


def test_compile_runs_them_first(model_dir):
    """--compile: fake tensors need the Python meta kernels, so they run before torch.compile."""
    out = probe(f"""
        from s2s.modeldir import load_model_dir
        from s2s.translate import compile_decode_step
        seen = []
        torch.compile = lambda fn, **kwargs: seen.append(deferred()) or fn
        compile_decode_step(load_model_dir({str(model_dir)!r}).model)
        assert seen == [[]] and meta_take(), seen
        print("ok")
    """)
    assert out.strip() == "ok"


def test_workerboot_leaves_a_programs_exit_alone():
    """Only the forkserver skips its teardown: a program importing s2s.workerboot exits as ever
    (an atexit handler registered before the import still runs)."""
    out = probe("""
        import atexit
        atexit.register(print, "teardown ran")
        import s2s.workerboot
        assert not s2s.workerboot.imported_by_forkserver()
    """)
    assert out.strip() == "teardown ran"


def test_an_error_while_they_run_is_raised_not_lost():
    """Ctrl-C while a first use runs them reaches the caller (the import statement, which reads
    __spec__ in C, would drop it): a bare import runs nothing, an attribute raises."""
    out = probe("""
        import signal, sys
        import torch.export  # reads nothing: nothing runs
        assert deferred() == sorted(DEFERRED)
        sys.modules["torch.export.custom_ops"] = None  # the run fails where torch.export imports it
        try:
            torch.export.export
        except ImportError:
            print("raised")
    """)
    assert out.strip() == "raised"


def test_a_run_that_failed_is_never_taken_for_done():
    out = probe("""
        import sys
        sys.modules["torch.export.custom_ops"] = None  # the run fails where torch.export imports it
        for attempt in range(2):
            try:
                complete_torch()
            except ImportError as e:
                print("raised", "stopped half run" in str(e) if attempt else "first")
        try:
            torch.export.export
        except ImportError:
            print("raised again")
    """)
    assert out.split("\n")[:3] == ["raised first", "raised True", "raised again"]
