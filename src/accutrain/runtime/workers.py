"""Worker processes on one machine: one per device, forked from a fork server (or spawned), each joining the
process group and running its rank; the first failure of any said in one line (runtime.rank_errors), the others
stopped; a preemption signal passed on to every rank."""
from __future__ import annotations

import logging
import logging.config
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from accutrain.core.precision import float32_math
from accutrain.dist import World, leave_process_group
from accutrain.errors import RankDied
from accutrain.runtime.rank_errors import exited, rank_failure, reported
from accutrain.seeding import deterministic_algorithms
from accutrain.signals import SIGNALS, StopRequest, ctrl_c_deferred, die_with_parent
from accutrain.store.rotation import Rotation
from accutrain.train.threads import available_cpus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_logging(rank: int) -> None:
    """Ranks other than 0 log nothing but errors, named by rank."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.ERROR)


@dataclass
class _Job:
    nprocs: int
    port: int
    errors: Any  # a queue of (rank, message): user errors
    results: Any  # a queue holding rank 0's return value
    log_config: Optional[dict]
    threads: int
    target: Callable[..., Any]
    args: tuple = field(default_factory=tuple)
    deterministic: bool = False  # trainer.deterministic: the settings are per process
    tf32: Optional[bool] = None  # trainer.tf32: likewise
    environ: dict[str, str] = field(default_factory=dict)  # the parent's environment when it started the workers


def _worker(local_rank: int, job: _Job) -> None:
    die_with_parent()  # and the fork server dies with the command (accutrain.runtime.forkserver)
    if hasattr(os, "setsid"):  # a session of its own, as torchrun's workers: the terminal's Ctrl-C reaches the command
        os.setsid()  # alone, which passes it on once (spawn) — not twice, which a rank would take for a second Ctrl-C
    # The fork server ignores Ctrl-C (accutrain.runtime.forkserver); a rank takes the command's at once — before it trains
    # a KeyboardInterrupt (exit 130 below), then its stop request's handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ != job.environ:  # a forked worker holds the fork server's environment; a spawned one the parent's
        os.environ.clear()
        os.environ.update(job.environ)
    world = World(local_rank, job.nprocs, local_rank)
    if world.main and job.log_config:
        logging.config.dictConfig(job.log_config)
    elif not world.main:
        quiet_logging(world.rank)
    torch.set_num_threads(job.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(world.rank),
                      WORLD_SIZE=str(world.size), LOCAL_RANK=str(world.local_rank))
    try:
        with deterministic_algorithms(job.deterministic), float32_math(job.tf32):
            result = job.target(world, *job.args)
        if world.main:
            job.results.put(result)
    except Exception as e:  # a user error, or a plug-in's: said in the parent (a bug of accutrain's: raised)
        job.errors.put(rank_failure(e, world.rank, world.size, job.args))
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before this rank trains, or a second one: stopped at once (the command says so)
        sys.exit(128 + signal.SIGINT)
    finally:
        leave_process_group()


def first_failure(context: Any) -> Optional[int]:
    """Wait until every worker has ended, or one has failed: then kill the others at once and return its index (the
    others' left out of `context`, whose join then reports that one). SIGKILL, not torch's SIGTERM: a survivor
    would take that for a stop request, announce a checkpoint, and fail at its next collective with a dead peer."""
    while context.sentinels:
        for sentinel in multiprocessing.connection.wait(list(context.sentinels)):
            index = context.sentinels[sentinel]
            process = context.processes[index]
            process.join()
            if process.exitcode == 0:
                del context.sentinels[sentinel]  # joined: its join then has nothing left to wait for
                continue
            for other in context.processes:
                if other is not process and other.is_alive():
                    other.kill()
            for other_sentinel, other_index in list(context.sentinels.items()):
                if other_index != index:
                    context.processes[other_index].join()
                    del context.sentinels[other_sentinel]
            return index
    return None


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def newest_checkpoint(args: tuple) -> str:
    """What resume=auto would continue from in the run directory among `args` (train_rank's: cfg, run_dir, …)."""
    run_dir = next((a for a in args if isinstance(a, Path)), None)
    steps = Rotation(run_dir / "checkpoints", 1).steps() if run_dir is not None else []
    return (f"resume=auto continues from its newest checkpoint, {steps[0]}" if steps else
            "no checkpoint was written before it")


def start_method() -> str:
    """How workers start: forked from a fork server that imported accutrain (and PyTorch) once — a worker then starts
    without importing them again (seconds each) — where the platform has one, else spawned. Neither forks a process
    that has run anything: the server has only imported, and CUDA is never initialised before a worker starts."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # torch._dynamo too: every rank imports it anyway (≈ 2 s), at its optimizer's first call of a function PyTorch
    # keeps out of compiled graphs (torch._disable_dynamo imports it then); importing starts no thread, touches no GPU
    multiprocessing.get_context("forkserver").set_forkserver_preload(["accutrain.runtime.forkserver", __name__,
                                                                      "torch._dynamo"])
    return "forkserver"


def spawn(nprocs: int, target: Callable[..., Any], args: tuple, log_config: Optional[dict],
          deterministic: bool = False, signals: tuple[int, ...] = SIGNALS, tf32: Optional[bool] = None) -> Any:
    """Run target(world, *args) in `nprocs` fresh processes (start_method) and return rank 0's result.

    A failure on any rank ends them all and is raised here: a UserError as itself (one line), anything else
    with the failing rank's traceback. One of `signals` (the preemption signals) sent to this process is passed on
    to the workers, which stop together after their current optimizer step.
    """
    method = start_method()
    # multiprocessing's resource tracker, started with this process's warning options, cleans up the queues'
    # semaphores that a rank killed outright leaves registered; without this its notice adds two lines of its own
    # to the one that says which rank died
    quiet_tracker = "ignore:resource_tracker:UserWarning"
    if quiet_tracker not in sys.warnoptions:
        sys.warnoptions.append(quiet_tracker)
    ctx = multiprocessing.get_context(method)
    errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
    threads = max(1, available_cpus() // nprocs)  # the cores this process may use (its affinity), shared
    job = _Job(nprocs, _free_port(), errors, results, log_config, threads, target, args, deterministic, tf32,
               dict(os.environ))
    context = None

    def start() -> Any:
        return torch.multiprocessing.start_processes(_worker, args=(job,), nprocs=nprocs, join=False,
                                                     start_method=method)

    def pass_on(signum: int) -> None:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    try:
        with ctrl_c_deferred():  # answered once every worker forked is known here (a worker whose parent is gone
            context = start()  # as it starts would print a traceback)
        with StopRequest(on_request=pass_on, announce=False, signals=signals):
            failed = first_failure(context)
            if failed is not None and context.processes[failed].exitcode == 128 + signal.SIGINT:
                raise KeyboardInterrupt  # a rank stopped at once on Ctrl-C: before it trained, or a second one
            if failed is not None and context.processes[failed].exitcode < 0 and errors.empty():
                name = signal_name(-context.processes[failed].exitcode)
                raise RankDied(f"rank {failed} of {nprocs} was killed by {name} (the OOM killer, kill -9, a "
                               f"scheduler): every rank stopped; {newest_checkpoint(args)}")
            while not context.join():
                pass
    except torch.multiprocessing.ProcessExitedException as e:
        if not errors.empty():
            raise reported(errors.get()) from None
        raise exited(e.error_index, nprocs, e.exit_code, newest_checkpoint(args)) from None
    except torch.multiprocessing.ProcessRaisedException as e:
        if not errors.empty():  # a user error on one rank, seen here after another rank's broken collective
            raise reported(errors.get()) from None
        cause = str(e).strip().splitlines()[-1]  # the failing rank's exception, `Type: message`
        raise RuntimeError(f"rank {e.error_index} of {nprocs} failed ({cause}); every rank stopped. Its traceback:"
                           f"\n{e}") from None
    except KeyboardInterrupt:  # (workers started but not yet known here die with this process)
        for process in context.processes if context is not None else []:
            process.kill()
        raise
    return results.get() if not results.empty() else None
