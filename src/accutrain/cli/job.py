"""The job Hydra runs for `accutrain`: one run in its run directory (Hydra's run mode, or one job of a sweep), from
what the command line decided (accutrain.cli.command.Decided), ending in a status.json and one line on failure."""
from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from accutrain.cli.command import Decided
from accutrain.config.targets import check_plugins, plugin_failure
from accutrain.config.train import TrainConfig
from accutrain.config.validate import typed_run
from accutrain.errors import Preempted, RankDied, UserError, one_line
from accutrain.report.sweep import stopped
from accutrain.runtime.scheduler import adopt_scheduler_world
from accutrain.store import claim, mark, owned, record, rundir
from accutrain.store.status import Recorded, read_status, recorded, taken_over, write_status

log = logging.getLogger("accutrain")
trace_log = logging.getLogger("accutrain.traceback")  # train.log only (configs/hydra/job_logging/accutrain.yaml)


@dataclass
class Tally:
    """The jobs of this command that failed in this process (a multirun's exit code counts them)."""

    failed: int = 0


def torchrun_secondary() -> bool:
    """This process is a rank other than 0 of a world torchrun started."""
    return os.environ.get("RANK", "0") != "0" and "LOCAL_RANK" in os.environ


def train_job(decided: Decided, tally: Tally, started: Callable[[], None]) -> Callable[[DictConfig], Optional[float]]:
    """The task function Hydra runs: `started()` first (Ctrl-C is then the job's), then one run."""
    def train(cfg: DictConfig) -> Optional[float]:
        started()
        with ExitStack() as holds:  # the run directory's hold (rundir.held) ends with the job, however it ends
            return job(cfg, decided, tally, holds)
    return train


def job(cfg: DictConfig, decided: Decided, tally: Tally, holds: ExitStack) -> Optional[float]:
    """One run; returns the best value of the monitored metric (trainer.monitor), what a searching sweeper (Optuna)
    optimises. Everything that can be checked is checked before the run directory is touched; a run refused before
    it takes a directory this command created leaves no directory. A single run ends a user error with exit 2; in a
    multirun a failing job (user error or crash) is recorded as failed in its status.json and the sweep goes on. A
    preempted run (trainer.preempt_signals) ends the command, after its checkpoint, with exit code 128 + the signal —
    or, under submitit, is requeued."""
    from accutrain.report.summary import write_loss_plot
    from accutrain.runtime.launch import place, train  # imported here so that `--help` and config errors stay fast

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:  # a task of a submitit job with several tasks: its world (the command line adopted srun's already)
        adopt_scheduler_world()
    except UserError as e:
        log.error(one_line(e))
        sys.exit(2)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    log_config = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)  # for spawned workers' rank 0
    primary = not torchrun_secondary()  # one process decides about the run directory and records the run
    here = os.path.abspath(run_dir)
    # What this command wrote in run_dir so far (its claim's mark and lock; Hydra's record and log for it), over
    # what was there before: put back whenever the run ends before it takes the directory over.
    changes = decided.changes.pop(here, None) or record.Changes()
    earlier = any(content is not None for content in changes.before.values())  # Hydra's record of an earlier run
    outcome = Recorded()  # kept: the command changed nothing in run_dir (loss.png is not drawn again either)
    run: Optional[TrainConfig] = None
    in_use = False  # another run holds the directory: nothing of its may be written
    try:  # a single run was checked before Hydra ran it (command.check); a sweep's job here
        if primary:
            changes.found(record.hydra_record(run_dir, hydra_cfg.output_subdir))  # what Hydra wrote for this job
        if decided.run is not None and not multirun:
            run, ranks = decided.run, decided.ranks
        else:
            run = typed_run(cfg)
            check_plugins(run)
            ranks = place(run)
        if run.resume is None and (read_status(run_dir) or {}).get("state") == "requeued":
            log.info(f"this job was requeued after a preemption: resuming from the newest checkpoint of {run_dir}")
            run = requeued(run)
        if primary and here not in decided.held:  # a sweep's job: its own hold, under the sweep's
            in_use = True
            key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
            holds.enter_context(claim.claimed(run_dir, "run", key, lambda: job_dir_ours(run_dir, key), changes))
            in_use = False
        if primary:
            rundir.prepare(run_dir, run.resume, run.trainer.overwrite)
    except UserError as e:
        log.error(one_line(e))
        if multirun:  # recorded in the job's status.json, unless that is an earlier run's
            tally.failed += 1
            if primary and not earlier and not in_use:
                write_status(run_dir, "failed", one_line(e))
            else:  # an earlier run's record, or another command's directory: as it was
                outcome.kept = True
                if primary and earlier:
                    changes.put_back()
            return None
        if primary:
            changes.put_back()
        sys.exit(2)
    try:
        with recorded(run_dir, changes) if primary else nullcontext(outcome) as outcome:  # status.json
            out = train(run, run_dir, log_config, ranks)
        return out.progress.best if out is not None else None
    except UserError as e:
        log.error(one_line(e))
        if e.__cause__ is not None:
            trace_log.error("the traceback behind that error:", exc_info=e.__cause__)
        put_back(run_dir, changes, outcome, primary and not multirun)
        if not multirun:
            sys.exit(2)
        tally.failed += 1
    except Preempted as e:
        requeue = submitit_requeue(e.signum)
        if requeue is not None and primary:
            write_status(run_dir, "requeued", str(e))
            log.warning(f"{signal.Signals(e.signum).name}: checkpoint written; submitit requeues this job, which "
                        "resumes from it")
            requeue(e.signum, None)  # submitit's own handler: saves the job for the requeue and exits
        if primary:
            say_how_to_resume(run_dir, multirun, signal.Signals(e.signum).name, hydra_cfg, decided.argv)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once, without a checkpoint")
        put_back(run_dir, changes, outcome, primary and not multirun)
        sys.exit(128 + signal.SIGINT)
    except RankDied as e:
        log.error(str(e))
        if not multirun:
            sys.exit(e.exit_code)
        tally.failed += 1
    except (Exception, SystemExit) as e:
        if isinstance(e, SystemExit) and e.code not in (None, 0):
            raise
        culprit = plugin_failure(e, run) if run is not None else None
        if culprit is None and isinstance(e, SystemExit):  # a plug-in ended the program mid-run: not a success
            culprit = f"sys.exit({e.code}) was called during training"
        if culprit is None and not multirun:
            raise  # a bug of accutrain's: Hydra prints its traceback
        if culprit is not None:
            log.error(f"{culprit}; the full traceback is in {run_dir / 'train.log'}")
            trace_log.error("the traceback:", exc_info=e)
            put_back(run_dir, changes, outcome, primary and not multirun)
        else:
            log.exception("this job failed; the sweep goes on")
        if not multirun:
            sys.exit(2)
        tally.failed += 1
    finally:
        if primary and not outcome.kept and run_dir.is_dir():  # (a command that changed nothing leaves the plot too)
            write_loss_plot(run_dir)
    return None


def job_dir_ours(run_dir: Path, key: str) -> None:
    """A sweep's job directory, as its job finds it under its hold: accutrain's (marked, or made before the mark
    existed), or holding only what Hydra wrote for this job (its record and log, in a sweep directory accutrain
    marked: the job marks it); anything else is refused."""
    hydra = HydraConfig.get()
    sweep_dir = Path(str(hydra.sweep.dir)).resolve() if hydra.mode == RunMode.MULTIRUN else None
    if mark.owner(run_dir) is None and sweep_dir is not None and run_dir.resolve().is_relative_to(sweep_dir) \
            and mark.owner(sweep_dir) == "sweep":
        names = {p.name for p in run_dir.iterdir()} - {rundir.LOCK_FILE}
        if names <= {str(hydra.output_subdir), log_file(hydra)}:
            return
    owned.refuse_foreign(run_dir, key)


def put_back(run_dir: Path, changes: record.Changes, outcome: Recorded, single: bool) -> None:
    """A single run that ended before it took its directory over (refused in the build, interrupted while its ranks
    started, a plug-in's mistake) changes nothing: what the command wrote there is put back (a directory it made is
    removed again), only where it still holds what the command wrote."""
    if single and not outcome.kept and not taken_over(run_dir):
        outcome.kept = True
        changes.put_back()


def requeued(run: TrainConfig) -> TrainConfig:
    """The run continued from its newest checkpoint (resume=auto): a job submitit requeued."""
    import dataclasses

    from accutrain.config.typed import seal

    return seal(dataclasses.replace(run, resume="auto"))


def log_file(hydra_cfg: Any) -> Optional[str]:
    """The name of the log file Hydra writes into the run directory (train.log), if it writes one."""
    return f"{hydra_cfg.job.name}.log" if OmegaConf.select(hydra_cfg, "job_logging.handlers.file") else None


def say_how_to_resume(run_dir: Path, multirun: bool, signal_name: str, hydra_cfg: DictConfig, argv: list[str]
                      ) -> None:
    """After a signal stopped the run at a checkpoint: the command that continues it — the whole sweep's in a
    multirun (with the summary of what ran), else this run directory's."""
    if multirun:
        stopped(Path(str(hydra_cfg.sweep.dir)), str(hydra_cfg.job.num), signal_name, argv)
    else:
        log.info(f"Resume with the same command plus: resume=auto hydra.run.dir={run_dir}")


def submitit_requeue(signum: int) -> Optional[Callable[..., None]]:
    """Under submitit, its handler for `signum` that checkpoints the job and requeues it (None elsewhere)."""
    handler = signal.getsignal(signum)
    owner = getattr(handler, "__self__", None)
    if owner is not None and type(owner).__module__.startswith("submitit") and \
            getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
        return handler
    return None
