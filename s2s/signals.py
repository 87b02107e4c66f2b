"""The signals that end a command (SIGINT, SIGTERM, SIGHUP), sent to a handler for a while."""

from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator


@contextlib.contextmanager
def signals_caught(handler: Callable) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP (unless ignored, as under nohup) go to ``handler`` meanwhile."""
    ending = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # under nohup hangups stay ignored
        ending.append(signal.SIGHUP)
    handlers = {s: signal.signal(s, handler) for s in ending}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
