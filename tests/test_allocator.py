"""s2s.allocator: freed memory kept for the next block of the same size (glibc's malloc)."""

import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import REPO

# a 64 MiB block written, freed, and made again three times: minor page faults per block
SCRIPT = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from s2s.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
block = bytearray(64 << 20)
del block
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    block = bytearray(64 << 20)  # malloc, then every byte written
    del block
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) // 3)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_block_made_again_reuses_its_pages():
    """By default glibc maps a block this large afresh each time, so each of its 4 KiB pages
    faults again; once freed memory is kept, the block made again faults on (almost) none."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode, str(REPO)], capture_output=True,
                                       text=True, check=True).stdout)
              for mode in ("default", "keep")}
    pages = (64 << 20) // 4096
    assert faults["default"] > pages // 2
    assert faults["keep"] < pages // 100


def test_elsewhere_it_changes_nothing(monkeypatch):
    from s2s import allocator

    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.keep_freed_memory() is False


def test_huge_pages_environ_adds_the_tunable_only_where_it_changes_something():
    from s2s.allocator import huge_pages_environ

    env = huge_pages_environ({"PATH": "/bin"}, "madvise", (2, 36))
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert huge_pages_environ({}, "always", (2, 35)) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # other tunables kept, the new one appended
    assert (huge_pages_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, "madvise", (2, 39))["GLIBC_TUNABLES"]
            == "glibc.malloc.arena_max=1:glibc.malloc.hugetlb=1")
    assert huge_pages_environ({}, "never", (2, 36)) is None  # the kernel gives none
    assert huge_pages_environ({}, "", (2, 36)) is None  # no such kernel setting (not Linux)
    assert huge_pages_environ({}, "madvise", (2, 34)) is None  # glibc without the tunable
    assert huge_pages_environ({}, "madvise", None) is None  # musl, macOS
    # the user's own setting stands, whatever its value
    assert huge_pages_environ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36)) is None
    assert huge_pages_environ({"GLIBC_TUNABLES": "a=1:glibc.malloc.hugetlb=2"}, "madvise", (2, 36)) is None


def test_transparent_huge_pages_reads_the_bracketed_mode(tmp_path):
    from s2s.allocator import transparent_huge_pages

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert transparent_huge_pages(str(f)) == "always"
    assert transparent_huge_pages(str(tmp_path / "missing")) == ""


# a fresh 64 MiB block from the heap, written once: minor page faults
FRESH_BLOCK = """
import resource, sys
sys.path.insert(0, sys.argv[1])
from s2s.allocator import keep_freed_memory
assert keep_freed_memory()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(64 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tunable is glibc's")
def test_with_the_tunable_a_growing_heap_faults_per_huge_page():
    """What s2s train starts itself with: a 64 MiB block from the heap, written once, faults a
    few hundred times (mostly once per 2 MiB page) instead of once per 4 KiB page."""
    from s2s.allocator import with_huge_pages

    env = with_huge_pages({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    if env is None:
        pytest.skip("no transparent huge pages on request here, or a glibc before 2.35")
    faults = int(subprocess.run([sys.executable, "-c", FRESH_BLOCK, str(REPO)], capture_output=True, text=True,
                                check=True, env=env).stdout)
    assert faults < (64 << 20) // 4096 // 8, faults  # 16,384 with pages of 4 KiB; 280-530 measured


def test_malloc_in_use_reads_the_environment():
    from s2s.allocator import malloc_in_use

    assert malloc_in_use({}) == "glibc malloc"
    assert malloc_in_use({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "glibc malloc"
    assert malloc_in_use({"LD_PRELOAD": "/x/libfoo.so /y/libmimalloc.so"}) == "mimalloc (LD_PRELOAD)"
    assert malloc_in_use({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == "jemalloc (LD_PRELOAD)"
    if platform.libc_ver()[0] == "glibc":
        assert (malloc_in_use({"GLIBC_TUNABLES": "x=1:glibc.malloc.hugetlb=1"})
                == "glibc malloc in transparent huge pages")


def test_training_environ_preloads_mimalloc_else_huge_pages(monkeypatch):
    from s2s import allocator

    monkeypatch.setattr(allocator, "mimalloc_library", lambda: "/site/cmeel.prefix/lib/libmimalloc.so")
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    env = allocator.training_environ({"LD_PRELOAD": "/lib/libasan.so", "PATH": "/bin"})
    assert env == {"LD_PRELOAD": "/site/cmeel.prefix/lib/libmimalloc.so /lib/libasan.so", "PATH": "/bin",
                   "MIMALLOC_PURGE_DELAY": "-1"}
    # the user's own mimalloc option stands; an allocator preloaded already, or S2S_MALLOC=glibc: no change
    assert allocator.training_environ({"MIMALLOC_PURGE_DELAY": "100"})["MIMALLOC_PURGE_DELAY"] == "100"
    assert allocator.training_environ(env) is None
    assert allocator.training_environ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}) is None
    assert allocator.training_environ({"S2S_MALLOC": "glibc"}) is None
    # no mimalloc (or not Linux): glibc in huge pages, where the machine has them
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    monkeypatch.setattr(allocator, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(allocator, "glibc_version", lambda: (2, 36))
    assert allocator.training_environ({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    monkeypatch.setattr(allocator, "transparent_huge_pages", lambda: "never")
    assert allocator.training_environ({}) is None


# training's pattern: blocks of 4-13 MiB, a different size at every "update", freed, and a pause
# between updates; minor page faults over the last 20 updates
UPDATES = """
import random, resource, time
random.seed(0)
for update in range(40):
    if update == 20:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [bytearray(random.randint(4 << 20, 13 << 20)) for _ in range(6)]
    del blocks
    time.sleep(0.02)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
def test_mimalloc_as_training_starts_it_keeps_freed_memory():
    """The training environment's mimalloc reuses the pages freed by earlier updates (0 faults
    measured); mimalloc at its own defaults gives them back to the kernel between updates and
    faults them in again (14,000 measured), glibc's malloc far more (179,000)."""
    from s2s.allocator import mimalloc_environ, mimalloc_library

    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY")}
    env = mimalloc_environ(base, mimalloc_library())
    if env is None:
        pytest.skip("cmeel-mimalloc is not installed")
    faults = {name: int(subprocess.run([sys.executable, "-c", UPDATES], capture_output=True, text=True,
                                       check=True, env=e).stdout)
              for name, e in (("training", env), ("defaults", {**env, "MIMALLOC_PURGE_DELAY": "10"}))}
    assert faults["training"] < 1000 and faults["training"] * 10 < faults["defaults"], faults


@pytest.mark.parametrize("argv, restarts", [
    (["train", "exp.yaml"], True),
    (["-q", "pretrain", "exp.yaml", "-o", "run"], True),
    (["train", "exp.yaml", "--help"], False),
    (["translate", "-m", "M"], False),
    (["score", "h", "r"], False),
    ([], False),
])
def test_train_and_pretrain_start_themselves_again_for_training(monkeypatch, argv, restarts):
    from s2s import allocator, launch

    started = []
    monkeypatch.setattr(launch.os, "execve", lambda exe, args, env: started.append((exe, args, env)))
    monkeypatch.setattr(launch.sys, "orig_argv", ["python", "-m", "s2s", *argv])
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    monkeypatch.setattr(allocator, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(allocator, "glibc_version", lambda: (2, 36))
    for name in ("GLIBC_TUNABLES", "LD_PRELOAD", "S2S_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    launch.restart_for_training(argv)
    assert [(exe, args, env["GLIBC_TUNABLES"]) for exe, args, env in started] == (
        [(sys.executable, [sys.executable, "-m", "s2s", *argv], "glibc.malloc.hugetlb=1")] if restarts else [])
    # started with the tunable set (as after the restart), or on a kernel without huge pages: no restart
    started.clear()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    launch.restart_for_training(argv)
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr(allocator, "transparent_huge_pages", lambda: "never")
    launch.restart_for_training(argv)
    assert started == []
