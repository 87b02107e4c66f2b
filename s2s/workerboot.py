"""What the translate workers' forkserver imports once, before it forks any worker (see
s2s.workers.worker_context): torch, through s2s.leantorch (its meta kernels and
torch.export deferred), then the modules every worker builds its translator with."""

from s2s.leantorch import import_torch

import_torch()

import s2s.modeldir  # noqa: E402,F401  (after torch: imported for the forks)
import s2s.translate  # noqa: E402,F401
