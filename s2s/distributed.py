"""Data-parallel training across processes started by torchrun (torch.distributed).

    torchrun --standalone --nproc_per_node 2 -m s2s train CONFIG -o RUN_DIR

Every rank computes the same batch order from (seed, epoch).  One update takes
``update_freq * world_size`` consecutive batches; rank r trains on batches
r, r + world_size, ... of them.  Each rank back-propagates its summed loss;
one all-reduce sums the gradients together with the token count, the loss and
the token counters, and the gradients are divided by the update's target
token count afterwards:

    g = (1 / sum_r n_r) * sum_r grad(L_r)

which is the gradient one process computes over all those batches
(``update_freq * world_size`` of them), up to the order of floating-point sums.
Rank 0 alone validates, logs and writes checkpoints; whether to stop (time
budget, step limit, early stopping, a signal on any rank) is agreed by a
one-number all-reduce before every update, so no rank waits for another that
has left.

Without torchrun, ``train.procs`` (N, or auto) makes ``s2s train`` and ``s2s
pretrain`` start the N ranks themselves on this machine (:func:`launch_local`):
the same process group and the same updates as under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch
from torch import Tensor

from s2s.device import resolve_device, use_device
from s2s.errors import S2SError
from s2s.workerserver import usable_cores

if TYPE_CHECKING:
    from s2s.config import ExperimentConfig

log = logging.getLogger("s2s")
GRACE_SECONDS = 30  # after one rank fails, how long the others get to stop before they are killed


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on at least one."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()


def _comm_device() -> torch.device:
    """Where collective buffers live: the rank's GPU under NCCL, else the CPU (gloo)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_world(device: str = "auto") -> tuple[World, torch.device]:
    """The process group torchrun describes in the environment (WORLD_SIZE, RANK,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and this rank's device: gloo on CPUs,
    NCCL with one GPU per local rank.  Without torchrun: one process, rank 0.
    ``device`` (train.device): auto takes the GPU when there is one."""
    wanted = resolve_device(device, "train.device")
    cuda = wanted.type == "cuda"
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        use_device(wanted)
        return World(), wanted
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return World(dist.get_rank(), dist.get_world_size()), device


def all_reduce_update(params: Iterable[torch.nn.Parameter], extras: Tensor) -> Tensor:
    """Sum every parameter's gradient and the numbers in ``extras`` over all ranks,
    in one flat all-reduce.  A parameter without a gradient on this rank (no batch,
    or unused) contributes zeros.  Returns the summed ``extras``."""
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads] + [extras.to(grads[0].dtype).reshape(-1)])
    comm = flat.to(_comm_device())
    dist.all_reduce(comm)
    flat = comm.to(flat.device)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).clone()
        offset += n
    return flat[offset:]


def shard(group: list, world: World) -> list:
    """This rank's batches of an update: every ``world.size``-th, starting at its rank."""
    return group[world.rank::world.size]


# --------------------------------------------------------------------------- #
# train.procs: the ranks of one machine, started by s2s itself
# --------------------------------------------------------------------------- #

def under_torchrun() -> bool:
    """torchrun (or another launcher) describes this process's rank in the environment."""
    return "WORLD_SIZE" in os.environ or "RANK" in os.environ


def memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def training_bytes(params: int, max_tokens: int, layers: int, d_model: int, d_ff: int, vocab: int) -> int:
    """A rough upper estimate of one training process's memory:

        M = 24 P + 4 N (L (16 d_model + 2 d_ff) + 3 V) + 512 MiB

    P parameters: fp32 weights, gradients, two AdamW moments and the all-reduce buffer
    (6 x 4 bytes); activations kept for the backward pass of a batch of N = max_tokens
    tokens through L = enc_layers + dec_layers blocks, and the logits, their softmax and
    its gradient over the vocabulary V; 512 MiB for the interpreter and torch itself.
    """
    activations = 4 * max_tokens * (layers * (16 * d_model + 2 * d_ff) + 3 * vocab)
    return 24 * params + activations + (512 << 20)


def auto_procs(cores: int, threads: int, per_process: int, memory: int, gpus: int) -> int:
    """train.procs: auto.  One process per GPU on CUDA.  On CPUs one process per
    ``threads`` cores (train.threads; 0 counts as 1: one single-thread process per core),
    as many as fit in half the machine's memory at ``per_process`` bytes each, at least one:

        procs = max(1, min(cores // threads, memory // (2 M)))

    Processes beat threads at every model size: the all-reduce of an update moves 4 P bytes
    while its compute is 6 P FLOPs per token, so its share of the time is about the same
    small fraction (~ 1 / tokens per process) for a small model as for a big one.  What
    grows with the model is memory: every process holds the weights, gradients and AdamW
    moments (:func:`training_bytes`), so large models get fewer processes with more threads.
    """
    if gpus:
        return gpus
    by_cores = cores // max(threads, 1)
    by_memory = memory // (2 * per_process) if memory and per_process else by_cores
    return max(1, min(by_cores, by_memory))


def threads_per_process(procs: int, threads: int, cores: int) -> int:
    """train.threads when set, else the cores shared out: max(1, cores // procs)."""
    return threads or max(1, cores // procs)


def model_size(cfg: ExperimentConfig) -> tuple[int, int]:
    """(parameters, output vocabulary) of the model ``cfg`` describes with the tokenizer
    prepared in data.dir (built on the meta device: no memory, no initialization)."""
    from s2s.modeldir import build_model, vocab_sizes
    from s2s.tokenizer import Tokenizer, resolve_tokenizer_config

    cfg = resolve_tokenizer_config(cfg)
    tok = Tokenizer.load(Path(cfg.data.dir), cfg.tokenizer, cfg.data)
    with torch.device("meta"):
        model = build_model(cfg, tok)
    return sum(p.numel() for p in model.parameters()), vocab_sizes(cfg, tok)[-1]


def process_split(cfg: ExperimentConfig) -> tuple[int, int]:
    """(processes, threads each) this machine runs ``cfg`` with; (1, train.threads) under torchrun."""
    tc = cfg.train
    if under_torchrun() or tc.procs == 1:
        return 1, tc.threads
    cores = usable_cores()
    # the GPUs the ranks would take (init_world): none where train.device is not CUDA
    gpus = torch.cuda.device_count() if resolve_device(tc.device, "train.device").type == "cuda" else 0
    if tc.procs == "auto":
        from s2s.trainer import check_prepared

        check_prepared(cfg)  # the tokenizer that sizes the model is there
        m = cfg.model
        params, vocab = model_size(cfg)
        per_process = training_bytes(params, tc.max_tokens, m.enc_layers + m.dec_layers, m.d_model, m.d_ff, vocab)
        procs = auto_procs(cores, tc.threads, per_process, memory_bytes(), gpus)
    else:
        procs = tc.procs
        if gpus and procs > gpus:
            raise S2SError(f"train.procs: {procs} processes need one GPU each; this machine has {gpus}")
    return procs, threads_per_process(procs, tc.threads, cores)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_launcher() -> None:
    """In a rank: SIGTERM when the launching process dies (Linux), so no rank trains on as
    an orphan (SIGTERM makes it write a checkpoint and stop); an orphan already: stop now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(os.environ["S2S_LAUNCHER_PID"]):
        sys.exit(128 + signal.SIGTERM)


def launch_local(command: str, cfg: ExperimentConfig, run_dir: Path, resume: bool, show_progress: bool,
                 procs: int, threads: int) -> None:
    """Run ``command`` (train or pretrain) as ranks 0..procs-1 of one process group on this machine.

    Each rank is a fresh interpreter (:func:`rank_main`) with the environment torchrun would
    give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT on 127.0.0.1) and
    OMP_NUM_THREADS = ``threads``, and with the allocator that suits training
    (s2s.allocator.training_environ); rank 0's stderr is the user's.  The ranks run in
    sessions of their own, so a Ctrl-C at the terminal reaches this process alone, and
    this process passes SIGINT, SIGTERM and SIGHUP on to every rank, once per signal received:
    the first makes them finish the update and write a checkpoint, a second stops them.
    When one rank fails the others get GRACE_SECONDS to stop, then are killed.  Rank 0's
    outcome is this call's: it returns, or raises its S2SError (exit code included) or
    KeyboardInterrupt; when rank 0 succeeded but another rank failed, that rank's.
    """
    from s2s.allocator import training_environ
    from s2s.config import to_dict

    job = json.dumps({"command": command, "config": to_dict(cfg), "run_dir": str(run_dir), "resume": resume,
                      "show_progress": show_progress, "threads": threads,
                      "log_level": log.getEffectiveLevel()})
    root = str(Path(__file__).resolve().parents[1])  # the ranks import this same s2s
    path = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="s2s-ranks-") as tmp:
        base = {**os.environ, "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": str(threads),
                "PYTHONPATH": root + (os.pathsep + path if path else ""), "S2S_LAUNCHER_PID": str(os.getpid())}
        base = training_environ(base) or base
        ranks: list[subprocess.Popen] = []

        def forward(signum, frame) -> None:
            for p in ranks:
                if p.poll() is None:
                    p.send_signal(signum)

        main_thread = threading.current_thread() is threading.main_thread()
        passed = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # under nohup SIGHUP stays ignored
                  if main_thread and signal.getsignal(s) != signal.SIG_IGN]
        handlers = {s: signal.signal(s, forward) for s in passed}
        try:
            for rank in range(procs):
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "S2S_RANK_RESULT": os.path.join(tmp, f"{rank}.json")}
                p = subprocess.Popen([sys.executable, "-c", "from s2s.distributed import rank_main; rank_main()"],
                                     stdin=subprocess.PIPE, env=env, start_new_session=True)
                ranks.append(p)
                p.stdin.write(job.encode())
                p.stdin.close()
            codes = _wait_all(ranks)
        finally:
            for p in ranks:  # only left running when this process is being torn down
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for s, h in handlers.items():
                signal.signal(s, h)
        results = []
        for rank, code in enumerate(codes):
            f = Path(tmp) / f"{rank}.json"
            results.append(json.loads(f.read_text()) if f.is_file() else {"code": code, "message": None})
    _raise_outcome(codes, results)


def _wait_all(ranks: list[subprocess.Popen]) -> list[int]:
    """Every rank's exit status; once one has failed, the rest are killed after GRACE_SECONDS."""
    failed_at = None
    while any(p.poll() is None for p in ranks):
        if failed_at is None and any(p.returncode not in (None, 0) for p in ranks):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.1)
    return [p.returncode for p in ranks]


def _raise_outcome(codes: list[int], results: list[dict]) -> None:
    """Nothing when every rank succeeded; else rank 0's failure, or the first other rank's
    (the others' failures follow from it: a rank that stops leaves the rest waiting for it)."""
    failed = [r for r, code in enumerate(codes) if code != 0]
    if not failed:
        return
    rank = failed[0]
    code, message = results[rank]["code"], results[rank]["message"]
    if code < 0:  # killed by a signal before it could report
        code, message = 128 - code, f"killed by {signal.Signals(-code).name}"
    if message is None:
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt
        message = f"exited with status {code} (its traceback is above)"
    from s2s.trainer import TrainingInterrupted

    text = message if rank == 0 else f"rank {rank}: {message}"
    if code - 128 in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        raise TrainingInterrupted(text, code)
    raise _with_code(S2SError(text), code)


def _with_code(e: S2SError, code: int) -> S2SError:
    e.exit_code = code
    return e


def rank_main() -> None:
    """One rank started by :func:`launch_local`: reads its job (JSON) from stdin, runs it, and
    leaves its outcome ({"code", "message"}) in $S2S_RANK_RESULT for the launcher to report."""
    if sys.platform == "linux":
        _die_with_launcher()
    job = json.loads(sys.stdin.read())
    rank = int(os.environ["RANK"])
    from s2s.cli import configure_logging
    from s2s.config import config_from_dict
    from s2s.trainer import TrainingInterrupted

    configure_logging(rank, job["log_level"])
    torch.set_num_threads(job["threads"])
    cfg = config_from_dict(job["config"], "train.procs")
    code, message = 0, None
    try:
        if job["command"] == "train":
            from s2s.trainer import train

            train(cfg, job["run_dir"], job["resume"], job["show_progress"])
        elif job["command"] == "pretrain":
            from s2s.pretrain import pretrain

            pretrain(cfg, job["run_dir"], job["resume"], job["show_progress"])
        else:
            raise ValueError(f"unknown command {job['command']!r}")
    except TrainingInterrupted as e:
        code, message = e.exit_code, str(e)
    except S2SError as e:
        code, message = getattr(e, "exit_code", 1), str(e)
    except OSError as e:  # an output that cannot be written
        code, message = 1, f"{e.filename or '<stdout>'}: {e.strerror or e}"
    except KeyboardInterrupt:  # a second Ctrl-C
        code = 128 + signal.SIGINT
    Path(os.environ["S2S_RANK_RESULT"]).write_text(json.dumps({"code": code, "message": message}))
    sys.exit(code)
