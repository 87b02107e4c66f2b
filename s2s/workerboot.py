"""What the translate workers' forkserver imports once, before it forks any worker (see
s2s.workerserver.worker_context): torch, through s2s.leantorch (its meta kernels and
torch.export deferred), then the modules every worker builds its translator with, and the
attention kernel's library (s2s.model.native).

The server ends when the s2s process that started it does, and then skips the
interpreter's teardown (``os._exit``): tearing torch down took it 0.1–0.5 s, and until it
ends a pipeline's next command (``s2s translate < in | s2s score - ref``) waits for the
server's copy of stdout to close.  The workers it forked end with ``os._exit`` already."""

import atexit
import os
import sys
from multiprocessing import forkserver

from s2s.leantorch import import_torch


def imported_by_forkserver() -> bool:
    """Whether multiprocessing's forkserver (its ``main``, preloading) is importing this module."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


import_torch()

import s2s.modeldir  # noqa: E402,F401  (after torch: imported for the forks)
import s2s.translate  # noqa: E402,F401
from s2s.model.native import available  # noqa: E402

available()  # the attention kernel compiled (once per machine) and loaded once, for every worker

if imported_by_forkserver():
    atexit.register(os._exit, 0)  # the server holds no output of its own to flush
