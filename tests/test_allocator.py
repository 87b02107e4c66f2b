"""s2s.allocator: freed memory kept for the next block of the same size (glibc's malloc)."""

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
