"""The `accutrain` console entry point: the command line is checked (accutrain.cli.command), then Hydra composes the
typed config and runs the job; a user error ends in one line."""
from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import ExitStack, nullcontext
from pathlib import Path
from types import FrameType
from typing import Callable, ContextManager, Optional

COMMANDS = ("accutrain", "accutrain-check")
_in_job = False  # Hydra runs the job: Ctrl-C is a KeyboardInterrupt the job answers (status.json: interrupted)


def _interrupted_while_starting(signum: int, frame: Optional[FrameType]) -> None:
    """Ctrl-C while the command imports Hydra and PyTorch, checks the command line or Hydra sets the run up (seconds,
    nothing trained, no status.json yet): one line and exit 130 at once — not the traceback of whatever it landed in
    (or a confused error from a library that was interrupted halfway). In the job, a KeyboardInterrupt as usual."""
    if _in_job:
        raise KeyboardInterrupt
    sys.stderr.write(f"{Path(sys.argv[0]).name}: interrupted while starting: nothing was trained\n")
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


_script = Path(sys.argv[0] if sys.argv and sys.argv[0] else "")
if _script.name in COMMANDS or (_script.name == "__main__.py" and _script.parent.name == "accutrain"):
    signal.signal(signal.SIGINT, _interrupted_while_starting)  # before the imports below (only the command's)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from accutrain.cli import command, hydra_internals
from accutrain.cli.command import check, expand_home
from accutrain.config.renames import renamed
from accutrain.config.targets import plugin_failure
from accutrain.config.train import config_dir, register_schemas
from accutrain.errors import Preempted, RankDied, UserError, one_line
from accutrain.report.sweep import SweepSummary, stopped
from accutrain.run.scheduler import adopt_scheduler_world
from accutrain.store import record, rundir
from accutrain.store.status import Recorded, read_status, recorded, write_status

log = logging.getLogger("accutrain")
trace_log = logging.getLogger("accutrain.traceback")  # train.log only (configs/hydra/job_logging/accutrain.yaml)

register_schemas()


def torchrun_secondary() -> bool:
    """This process is a rank other than 0 of a world torchrun started."""
    return os.environ.get("RANK", "0") != "0" and "LOCAL_RANK" in os.environ


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _train(cfg: DictConfig) -> Optional[float]:
    global _in_job
    _in_job = True
    with ExitStack() as holds:  # the run directory's hold (rundir.held) ends with the job, however it ends
        return _job(cfg, holds)


def _job(cfg: DictConfig, holds: ExitStack) -> Optional[float]:
    """One run; returns the best value of the monitored metric (trainer.monitor), what a searching sweeper (Optuna)
    optimises. Everything that can be checked is checked before the run directory is touched. A single run ends a
    user error with exit 2; in a multirun a failing job (user error or crash) is recorded as failed in its
    status.json and the sweep goes on. A preempted run (trainer.preempt_signals) ends the command, after its
    checkpoint, with exit code 128 + the signal — or, under submitit, is requeued."""
    from accutrain.report.summary import write_loss_plot
    from accutrain.run.launch import preflight, train  # imported here so that `--help` and config errors stay fast

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
    if cfg.resume is None and (read_status(run_dir) or {}).get("state") == "requeued":
        log.info(f"this job was requeued after a preemption: resuming from the newest checkpoint of {run_dir}")
        cfg.resume = "auto"
    in_use = False  # another run holds the directory: nothing of its may be written
    earlier_files = command.earlier_records.pop(os.path.abspath(run_dir), None) if primary else None
    outcome = Recorded()  # kept: the command changed nothing in run_dir (loss.png is not drawn again either)
    try:  # a single run's values and ranks were checked before Hydra ran (command.check); a sweep's job's here
        ranks = command.checked if command.checked is not None and not multirun else preflight(cfg)
        if primary:
            in_use = True
            holds.enter_context(rundir.held(run_dir, "hydra.sweep.dir" if multirun else "hydra.run.dir"))
            in_use = False
            rundir.prepare(run_dir, cfg)
    except UserError as e:
        log.error(one_line(e))
        if earlier_files is not None:  # Hydra's record of the earlier run (or of the one running there) as it was
            record.put_back(earlier_files)
        if multirun:  # recorded in the job's status.json, unless that is an earlier run's
            SweepSummary.failed_here += 1
            if primary and not in_use and rundir.earlier_run(run_dir) is None:
                write_status(run_dir, "failed", one_line(e))
            return None
        sys.exit(2)
    try:
        with recorded(run_dir, earlier_files) if primary else nullcontext(outcome) as outcome:  # status.json
            out = train(cfg, run_dir, log_config, ranks)
        return out.progress.best if out is not None else None
    except UserError as e:
        log.error(one_line(e))
        if e.__cause__ is not None:
            trace_log.error("the traceback behind that error:", exc_info=e.__cause__)
        if not multirun:
            sys.exit(2)
        SweepSummary.failed_here += 1
    except Preempted as e:
        requeue = submitit_requeue(e.signum)
        if requeue is not None and primary:
            write_status(run_dir, "requeued", str(e))
            log.warning(f"{signal.Signals(e.signum).name}: checkpoint written; submitit requeues this job, which "
                        "resumes from it")
            requeue(e.signum, None)  # submitit's own handler: saves the job for the requeue and exits
        if primary:
            say_how_to_resume(run_dir, multirun, signal.Signals(e.signum).name, hydra_cfg)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once, without a checkpoint")
        sys.exit(128 + signal.SIGINT)
    except RankDied as e:
        log.error(str(e))
        if not multirun:
            sys.exit(1)
        SweepSummary.failed_here += 1
    except Exception as e:
        culprit = plugin_failure(e, cfg)
        if culprit is None and not multirun:
            raise  # a bug of accutrain's: Hydra prints its traceback
        if culprit is not None:
            log.error(f"{culprit}; the full traceback is in {run_dir / 'train.log'}")
            trace_log.error("the traceback:", exc_info=e)
        else:
            log.exception("this job failed; the sweep goes on")
        if not multirun:
            sys.exit(2)
        SweepSummary.failed_here += 1
    finally:
        if primary and not outcome.kept:  # (a command that changed nothing leaves the plot too)
            write_loss_plot(run_dir)


def say_how_to_resume(run_dir: Path, multirun: bool, signal_name: str, hydra_cfg: DictConfig) -> None:
    """After a signal stopped the run at a checkpoint: the command that continues it — the whole sweep's in a
    multirun (with the summary of what ran), else this run directory's."""
    if multirun:
        stopped(Path(str(hydra_cfg.sweep.dir)), str(hydra_cfg.job.num), signal_name, sys.argv[1:])
    else:
        log.info(f"Resume with the same command plus: resume=auto hydra.run.dir={run_dir}")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _check(cfg: DictConfig) -> None:
    """accutrain-check: exit 0 when the configured run's accumulation is faithful, 1 when not, 2 on a user error."""
    from accutrain.train.check import components_for_check, run_check

    try:
        if show_sample is not None:  # --show-sample: what the loss counts of one sample; no model, no check
            from accutrain.train.show_sample import show_sample as render
            print(render(cfg, show_sample))
            return
        result = run_check(components_for_check(cfg))
    except UserError as e:
        print(f"accutrain-check: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(result.lines()))
    sys.exit(0 if result.faithful else 1)


def submitit_requeue(signum: int) -> Optional[Callable[..., None]]:
    """Under submitit, its handler for `signum` that checkpoints the job and requeues it (None elsewhere)."""
    handler = signal.getsignal(signum)
    owner = getattr(handler, "__self__", None)
    if owner is not None and type(owner).__module__.startswith("submitit") and \
            getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
        return handler
    return None


def import_from_working_directory() -> None:
    """User plug-ins (`_target_`) import from the working directory, as with `python -m`."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def before_hydra(prog: str, **checks: bool) -> None:
    """The command line checked before Hydra runs it (accutrain.cli.command); a mistake is one line and exit code 2."""
    sys.argv[1:] = renamed(expand_home(sys.argv[1:]), say=lambda line: print(f"{prog}: notice: {line}",
                                                                             file=sys.stderr))
    try:
        sys.argv += check(sys.argv[1:], prog=prog, **checks)  # Hydra then uses the output directory checked
    except UserError as e:
        rank = "" if not torchrun_secondary() else f"[rank {os.environ['RANK']}] "
        print(f"{rank}{prog}: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


def composed_once() -> ContextManager[None]:
    """Hydra told the mode the checks read from their composition (hydra_internals.known_mode), where they made one."""
    return nullcontext() if command.mode is None else hydra_internals.known_mode(command.mode[0])


def interruptible(prog: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """A KeyboardInterrupt the job did not answer (between a sweep's jobs, say) is one line and exit 130."""
    def wrap(command: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                command()
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                sys.exit(128 + signal.SIGINT)
        run.__doc__ = command.__doc__
        return run
    return wrap


show_sample: Optional[int] = None  # accutrain-check --show-sample[=N]: the training sample to show


def take_show_sample(argv: list[str]) -> Optional[int]:
    """--show-sample[=N] taken out of `argv` (accutrain-check's own option): N, 0 without a value, or None."""
    found = None
    for arg in [a for a in argv if a == "--show-sample" or a.startswith("--show-sample=")]:
        argv.remove(arg)
        value = arg.partition("=")[2] or "0"
        if not value.isdigit():
            print(f"accutrain-check: error: {arg}: expected --show-sample or --show-sample=N, N a training sample's "
                  "index (0, 1, …)", file=sys.stderr)
            sys.exit(2)
        found = int(value)
    return found


@interruptible("accutrain-check")
def check_main() -> None:
    """`accutrain-check` takes accutrain's overrides; it writes no run directory and prints its report (with
    --show-sample[=N], training sample N with the tokens the loss counts marked, instead)."""
    global show_sample
    import_from_working_directory()
    show_sample = take_show_sample(sys.argv)
    before_hydra("accutrain-check", run=False)
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                 "hydra/hydra_logging=disabled"]
    with composed_once():
        _check()


@interruptible("accutrain")
def main() -> None:
    import_from_working_directory()
    try:  # under srun with several tasks: the world SLURM started, as torchrun's variables
        adopt_scheduler_world()
    except UserError as e:
        print(f"accutrain: error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    if torchrun_secondary():
        sys.argv.append("hydra.output_subdir=null")  # under torchrun, rank 0 alone records the run's config
    before_hydra("accutrain", decide=not torchrun_secondary())  # every rank composes; rank 0 decides
    SweepSummary.failed_jobs = 0
    with composed_once():
        _train()
    if SweepSummary.failed_jobs:  # a multirun whose summary counted failed jobs
        sys.exit(1)


if __name__ == "__main__":
    main()
