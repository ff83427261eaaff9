"""The `accutrain` console entry point: Hydra composes the typed config, a user error ends in one line."""
from __future__ import annotations

import logging
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from accutrain.config import config_dir, register_schemas
from accutrain.errors import Preempted, UserError, one_line
from accutrain.run_status import read_status, recorded, write_status
from accutrain.sweep import SweepSummary

log = logging.getLogger("accutrain")

register_schemas()


def torchrun_secondary() -> bool:
    """This process is a rank other than 0 of a world torchrun started."""
    return os.environ.get("RANK", "0") != "0" and "LOCAL_RANK" in os.environ


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _train(cfg: DictConfig) -> Optional[float]:
    """One run; returns the best value of the monitored metric (trainer.monitor), what a searching sweeper (Optuna)
    optimises. A single run ends a user error with exit 2; in a multirun a failing job (user error or crash) is
    recorded as failed in its status.json and the sweep goes on. A preempted run (trainer.preempt_signals) ends
    the command, after its checkpoint, with exit code 128 + the signal — or, under submitit, is requeued."""
    from accutrain.launch import train  # imported here so that `--help` and config errors stay fast
    from accutrain.report import write_loss_plot

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    log_config = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)  # for spawned workers' rank 0
    primary = not torchrun_secondary()  # one process records the run's status and plots its loss
    if cfg.resume is None and (read_status(run_dir) or {}).get("state") == "requeued":
        log.info(f"this job was requeued after a preemption: resuming from the newest checkpoint of {run_dir}")
        cfg.resume = "auto"
    try:
        with recorded(run_dir) if primary else nullcontext():  # status.json: running, then how it ended
            out = train(cfg, run_dir, log_config)
        return out.progress.best if out is not None else None
    except UserError as e:
        log.error(one_line(e))
        if not multirun:
            sys.exit(2)
    except Preempted as e:
        requeue = submitit_requeue(e.signum)
        if requeue is not None and primary:
            write_status(run_dir, "requeued", str(e))
            log.warning(f"{signal.Signals(e.signum).name}: checkpoint written; submitit requeues this job, which "
                        "resumes from it")
            requeue(e.signum, None)  # submitit's own handler: saves the job for the requeue and exits
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once, without a checkpoint")
        sys.exit(128 + signal.SIGINT)
    except Exception:
        if not multirun:
            raise
        log.exception("this job failed; the sweep goes on")
    finally:
        if primary:
            write_loss_plot(run_dir)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _check(cfg: DictConfig) -> None:
    """accutrain-check: exit 0 when the configured run's accumulation is faithful, 1 when not, 2 on a user error."""
    from accutrain.check import components_for_check, run_check

    try:
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


def check_main() -> None:
    """`accutrain-check` takes accutrain's overrides; it writes no run directory and prints its report."""
    import_from_working_directory()
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                 "hydra/hydra_logging=disabled"]
    _check()


HYDRA_INFO_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
                    "--shell-completion", "-sc", "--resolve", "-p", "--package"}


def check_output_dir(argv: list[str]) -> None:
    """Create the output directory now (the one given on the command line, else Hydra's default outputs/ or
    multirun/ in the working directory), so one that cannot be made is one line, not Hydra's traceback."""
    if any(arg.split("=")[0] in HYDRA_INFO_FLAGS for arg in argv):
        return  # --help, --cfg, …: nothing will be written
    multirun = "-m" in argv or "--multirun" in argv
    given = {key: value for key, _, value in (arg.partition("=") for arg in argv)
             if key in ("hydra.run.dir", "hydra.sweep.dir")}
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = given.get(key, "multirun" if multirun else "outputs")
    if "${" in value:
        return
    try:
        Path(value).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"accutrain: error: cannot create the output directory {value} ({key}): {e.strerror or e}",
              file=sys.stderr)
        sys.exit(2)


def main() -> None:
    import_from_working_directory()
    if torchrun_secondary():
        sys.argv.append("hydra.output_subdir=null")  # under torchrun, rank 0 alone records the run's config
    check_output_dir(sys.argv[1:])
    _train()
    if SweepSummary.failed_jobs:  # a multirun whose summary counted failed jobs
        sys.exit(1)


if __name__ == "__main__":
    main()
