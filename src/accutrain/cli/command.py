"""The command line before Hydra runs anything: --version and --help, and every config the command would run
composed and checked here — a composition error, a key no schema knows, a bad value, a refused combination, a run
directory an earlier run used or one that cannot be written end in one line (UserError) before anything is written.
What it decided is returned (`Decided`) and handed to the job Hydra runs: nothing is kept in module state."""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from accutrain import __version__
from accutrain.cli import recorded
from accutrain.cli.compose import compose, hydra_instance, job_configs, parse, task_config
from accutrain.config.targets import check_plugins
from accutrain.config.train import TrainConfig
from accutrain.config.validate import typed_run
from accutrain.errors import UserError
from accutrain.store import owned, record, rundir


@dataclass
class Decided:
    """What the command line decided, for the job Hydra runs next in this process."""

    argv: list[str]  # the command line Hydra runs: the user's (~ expanded, old keys renamed), the output dir pinned
    mode: Optional[tuple[Any]] = None  # (hydra.mode,) as the checks composed it (null is a value): Hydra need not
    # compose again to read it; None where the checks composed nothing
    run: Optional[TrainConfig] = None  # a single run: checked and typed (None for a sweep: each job is checked)
    ranks: Any = None  # … its device and ranks (accutrain.run.launch.Ranks)
    earlier: dict[str, record.Files] = field(default_factory=dict)  # Hydra's record of an earlier run, by run dir
    new: set[str] = field(default_factory=set)  # run directories that did not exist before this command
    sweep_dir: Optional[Path] = None  # a multirun's directory


def keep_hydra_record(decided: Decided, run_dir: Path, cfg: DictConfig) -> None:
    """Remember Hydra's record of the earlier run in run_dir before Hydra writes over it."""
    subdir = cfg.hydra.output_subdir
    decided.earlier[os.path.abspath(run_dir)] = record.hydra_record(run_dir, None if subdir is None else str(subdir))


def make_output_dir(path: Path, key: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output directory {path} ({key}): {e.strerror or e}") from None


SAFE_PATH = re.compile(r"[\w./:+-]+")


def output_dir(cfg: DictConfig, mode: str, pins: list[str]) -> Path:
    """hydra.<mode>.dir as it resolves now. One computed from interpolations (the default's ${now:…}) is pinned:
    `hydra.<mode>.dir=<it>` is added to `pins`, for the command line Hydra runs, so that Hydra, resolving it again a
    second later, uses the very directory checked here."""
    raw = str(OmegaConf.to_container(cfg.hydra[mode], resolve=False)["dir"])
    value = str(cfg.hydra[mode].dir)
    owned.refuse_empty(value, f"hydra.{mode}.dir")
    if "${" in raw and SAFE_PATH.fullmatch(value):
        pins.append(f"hydra.{mode}.dir={value}")
    return Path(value).expanduser()


def loggers(run: TrainConfig) -> dict[str, Any]:
    return {name: node.arguments for name, node in run.logger.items()}


def check_run(cfg: DictConfig, task: DictConfig, decided: Decided, decide: bool) -> None:
    """A single run: the values and combinations (typed_run), the plug-ins, the device and the ranks
    (launch.place), and — in the process that decides — its run directory: not an earlier run's (unless continued
    or replaced), writable, its log file too."""
    run = typed_run(task)  # before PyTorch is imported (seconds): a mistake in a value is answered at once
    if decide:
        run_dir = output_dir(cfg, "run", decided.argv)
        owned.refuse_foreign(run_dir, "hydra.run.dir")
        if not run_dir.exists():
            decided.new.add(os.path.abspath(run_dir))
        elif run_dir.is_dir() and rundir.check_reuse(run_dir, run.resume, run.trainer.overwrite):
            keep_hydra_record(decided, run_dir, cfg)
        owned.check_tracker_paths(run_dir, loggers(run), run.resume)
    check_plugins(run)
    from accutrain.run.launch import place

    decided.run, decided.ranks = run, place(run)
    if not decide:
        return
    make_output_dir(run_dir, "hydra.run.dir")
    has_log = OmegaConf.select(cfg, "hydra.job_logging.handlers.file") is not None
    rundir.check_writable(run_dir, run_dir / f"{cfg.hydra.job.name}.log" if has_log else None)
    if cfg.hydra.output_subdir is not None:
        rundir.writable(run_dir / str(cfg.hydra.output_subdir), "Hydra's record of the config")


def check_sweep(hydra: Any, base: DictConfig, decided: Decided, decide: bool) -> None:
    """A multirun: every job composes with known keys (its values are checked when it runs: a job failing is
    recorded and the sweep goes on); the sweep directory can be written and holds no earlier sweep's runs unless
    they are continued (resume=auto) or replaced (trainer.overwrite=true)."""
    sweep_dir = output_dir(base, "sweep", decided.argv) if decide else Path(str(base.hydra.sweep.dir)).expanduser()
    decided.sweep_dir = sweep_dir
    earlier = []
    for _, overrides, cfg in job_configs(hydra, base):
        task = task_config(cfg, overrides)
        job_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
        if decide:
            owned.check_tracker_paths(job_dir, dict(task.get("logger") or {}), task.get("resume"))
        if not decide or not job_dir.is_dir():
            continue
        owned.refuse_foreign(job_dir, "hydra.sweep.dir")
        if rundir.earlier_run(job_dir) and task.resume is None and not task.trainer.overwrite:
            earlier.append(job_dir.name)
        elif rundir.check_reuse(job_dir, task.resume, task.trainer.overwrite, "hydra.sweep.dir"):
            keep_hydra_record(decided, job_dir, cfg)
    if earlier:
        jobs = ", ".join(earlier[:8]) + (", …" if len(earlier) > 8 else "")
        raise UserError(f"{sweep_dir} (hydra.sweep.dir) holds the runs of an earlier sweep (jobs {jobs}): add "
                        "resume=auto to continue them, trainer.overwrite=true to delete them and start afresh, or "
                        "choose a new hydra.sweep.dir")
    if decide:
        make_output_dir(sweep_dir, "hydra.sweep.dir")
        rundir.writable(sweep_dir, "the sweep's jobs")


def check(argv: list[str], *, decide: bool = True, run: bool = True, prog: str = "accutrain") -> Decided:
    """Check the command `prog argv` before Hydra runs it; print --version or --help and exit. decide: this process
    decides about the run directory (not torchrun's other ranks); run: the command trains (not accutrain-check).
    Returns what it decided, the command line Hydra is to run among it. Raises UserError."""
    decided = Decided(list(argv))
    if "--version" in argv:
        print(f"{prog} {__version__}")
        sys.exit(0)
    args = parse(argv)
    if run:  # resume=auto with only the run directory: the run's own overrides, carried (and named)
        decided.argv += recorded.carry(args, prog if decide else None)
    if args.config_path is not None or args.experimental_rerun is not None or args.hydra_help:
        return decided  # Hydra's own business
    with hydra_instance(args) as hydra:
        if args.help:
            from accutrain.cli.help import print_help

            print_help(hydra, args, prog)
            sys.exit(0)
        multirun = args.multirun and run
        base = compose(hydra, args, list(args.overrides), multirun)
        if args.info or args.shell_completion:
            return decided  # Hydra prints something and runs nothing
        decided.mode = (base.hydra.mode,)
        if multirun:
            check_sweep(hydra, base, decided, decide)
        else:
            task = task_config(base, list(args.overrides))  # --cfg prints the config: one with a typo is refused
            if run and not args.cfg:
                check_run(base, task, decided, decide)
            elif not args.cfg:  # accutrain-check: the values and the plug-ins, before PyTorch is imported
                decided.run = typed_run(task)
                check_plugins(decided.run)
    return decided
