"""Importing torch for a decoding process, less of it at start-up.

``import torch`` runs three modules that a CPU or GPU decoding process never uses: the
Python meta kernels (``torch._meta_registrations`` and
``torch.distributed._meta_registrations``, with the decompositions they import), which
only tensors on the meta device, fake tensors and torch.compile read, and ``torch.export``.
On a 2-core AMD EPYC (Zen 2) they are about 0.4 s of the 1.4–1.7 s that ``import torch``
takes, so a quarter of what ``s2s translate`` spends before it translates a line.

:func:`import_torch` imports torch with those modules deferred: each is created (its
``__name__``, ``__file__``, ``__spec__`` and ``__path__`` set, so ``inspect`` and the import
system see an ordinary module) but its code waits.  The first use of any of them (one of
its attributes, ``torch.export.export`` or ``from torch.export import export``; an import of
a submodule of it; not a bare ``import torch.export``, which reads nothing) or the first
import of a torch module that torch's own import did not load (``torch._dynamo``,
``torch._decomp``) runs all three first, in torch's own order: torch's modules import each
other in cycles that hold only in that order (running the meta kernels alone in the middle
of ``import torch._decomp.decompositions`` fails with duplicate registrations).  The meta
kernels register for the Meta dispatch key (and one MPS kernel), so no CPU or CUDA
operation changes while they wait; :func:`complete_torch` runs them at once (``--compile``
calls it before torch.compile, ``--sampling`` before its first torch.Generator).  The cyclic
garbage collector is off during the import (it makes about 185,000 objects that outlive it;
under a thousand are garbage) and what it made is frozen after.  Not thread-safe: the
processes that use it import torch and decode on one thread.

Only the processes s2s owns take this path: the translate workers' forkserver and
``s2s translate`` / ``s2s summarize`` decoding in their own process.  A program that
imports ``s2s`` as a library imports torch as it always does.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Optional

DEFERRED = ("torch._meta_registrations", "torch.distributed._meta_registrations", "torch.export")

_RUN_ON_READ = ("__path__",)  # not __spec__: C's import reads it and drops any error raised there
_pending: dict[str, importlib.abc.Loader] = {}  # deferred module name -> its loader, in torch's import order
_completing = False  # complete_torch is running the deferred modules
_failed: Optional[str] = None  # what stopped a run: torch's registrations are then half made, for good


class _DeferredModule(types.ModuleType):
    """A module whose code has not run yet.  Reading ``__path__`` (importing a submodule of
    it) or any attribute it does not have yet runs the deferred modules (:func:`_use`); the
    attributes the import system set (``__name__``, ``__file__``, ``__loader__``,
    ``__package__``, ``__spec__``) read as they are, so scans of ``sys.modules``
    (``inspect.getmodule``) and a bare ``import`` of it leave it waiting.  (The import
    statement reads ``__spec__`` in C and discards an exception raised there, a Ctrl-C
    included, which would leave a module half run.)"""

    def __getattribute__(self, attr: str):
        if attr in _RUN_ON_READ:
            _use(self)  # may make it a plain module: no super() below
        return types.ModuleType.__getattribute__(self, attr)

    def __getattr__(self, attr: str):
        if not _use(self):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        return getattr(self, attr)


def _use(module: types.ModuleType) -> bool:
    """A deferred module is used: run every deferred module, in torch's order (one used while
    :func:`complete_torch` runs another is run there and then, as torch's own import would
    have run it); False if it has run already."""
    name = types.ModuleType.__getattribute__(module, "__name__")
    _check_not_failed()
    if name not in _pending:
        return False
    if _completing:
        _run(name, module)
    else:
        complete_torch()
    return True


def _check_not_failed() -> None:
    if _failed is not None:
        raise ImportError(f"torch's deferred modules (s2s.leantorch) stopped half run earlier: {_failed}")


def _run(name: str, module: types.ModuleType) -> None:
    """Run a deferred module's code in its module object.  An error there (a Ctrl-C included)
    is raised, and every later use raises it again: the registrations it made cannot be undone
    or made twice."""
    global _failed
    loader = _pending.pop(name)
    module.__class__ = types.ModuleType
    module.__loader__ = loader
    if module.__spec__ is not None:
        module.__spec__.loader = loader
    try:
        loader.exec_module(module)
    except BaseException as e:
        _failed = f"{name}: {type(e).__name__}: {e}"
        module.__class__ = _DeferredModule  # what it lacks raises that, not a bare AttributeError
        raise


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return None  # the default module object, attributes set from the spec

    def exec_module(self, module: types.ModuleType) -> None:
        _pending[module.__name__] = self.loader
        module.__class__ = _DeferredModule


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """While torch imports: the modules of DEFERRED, created and not run.  After: the first
    import of a torch module that torch's own import did not load (torch._dynamo,
    torch._decomp, ...) runs the deferred ones first, as torch's import would have: torch's
    modules import each other in cycles that hold only in that order."""

    def __init__(self):
        self.torch_imported = False

    def find_spec(self, name: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if not self.torch_imported:
            if name not in DEFERRED:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _DeferringLoader(spec.loader)
            return spec
        if name.startswith("torch.") and not _completing:
            complete_torch()
        return None  # the import goes on as usual


_finder: Optional[_DeferringFinder] = None


def import_torch() -> types.ModuleType:
    """torch, imported with :data:`DEFERRED` left to run on first use (see the module's
    docstring); torch itself where it is imported already."""
    global _finder
    if "torch" in sys.modules:
        return sys.modules["torch"]
    _finder = _DeferringFinder()
    collecting = gc.isenabled()
    gc.disable()  # the import's objects outlive it (all but a few hundred): no cyclic collection while it runs
    sys.meta_path.insert(0, _finder)
    try:
        import torch
    except BaseException:
        sys.meta_path.remove(_finder)
        raise
    finally:
        if collecting:
            gc.freeze()  # what the import made lives as long as the process: later collections skip it
            gc.enable()
    _finder.torch_imported = True
    if not _pending:  # this torch imported none of them
        sys.meta_path.remove(_finder)
    return torch


def deferred() -> list[str]:
    """The modules whose code has not run yet."""
    return sorted(_pending)


def complete_torch() -> None:
    """Run every module :func:`import_torch` deferred, in torch's import order, as torch's
    own import would have (before torch.compile, fake or meta tensors: they need the Python
    meta kernels).  Nothing to do where none waits."""
    global _completing
    _check_not_failed()
    if _completing or not _pending:
        return
    _completing = True
    try:
        while _pending:
            name = next(iter(_pending))
            _run(name, sys.modules[name])
    finally:
        _completing = False
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
