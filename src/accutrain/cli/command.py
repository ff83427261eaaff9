"""The command line before Hydra runs anything: --version and --help, and every config the command would run
composed and checked here — a composition error, a key no schema knows, a bad value, a refused combination, a run
directory an earlier run used or one that cannot be written end in one line (UserError) before anything is written.
What it decided is returned (`Decided`) and handed to the job Hydra runs: nothing is kept in module state."""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from accutrain import __version__
from accutrain.cli import recorded
from accutrain.cli.compose import compose, hydra_instance, job_configs, parse, task_config
from accutrain.config.targets import check_plugins
from accutrain.config.train import TrainConfig
from accutrain.config.validate import typed_run
from accutrain.errors import UserError
from accutrain.store import claim, owned, record, rundir


@dataclass
class Place:
    """A directory the command writes into: its run's, its sweep's, or one job's of its sweep, as checked."""

    path: Path
    subdir: Optional[str] = None  # hydra.output_subdir (null: Hydra keeps no record there)
    resume: Optional[str] = None  # the run's resume= (a job's, or the single run's)
    overwrite: bool = False  # its trainer.overwrite
    log: Optional[Path] = None  # the log file the checks created there (they were the first to write it)
    made: list[Path] = field(default_factory=list)  # the directories the checks made (it, checkpoints/, .hydra/)


@dataclass
class Decided:
    """What the command line decided, for the job Hydra runs next in this process."""

    argv: list[str]  # the command line Hydra runs: the user's (~ expanded, old keys renamed), the output dir pinned
    mode: Optional[tuple[Any]] = None  # (hydra.mode,) as the checks composed it (null is a value): Hydra need not
    # compose again to read it; None where the checks composed nothing
    run: Optional[TrainConfig] = None  # a single run: checked and typed (None for a sweep: each job is checked)
    ranks: Any = None  # … its device and ranks (accutrain.runtime.launch.Ranks)
    changes: dict[str, record.Changes] = field(default_factory=dict)  # by run dir: what the command wrote there
    # before its job (the claim's), and Hydra's record of an earlier run as it was before Hydra writes over it
    held: set[str] = field(default_factory=set)  # the run directory the command holds (its claim)
    claimed: Optional[record.Changes] = None  # what the claim wrote (its mark, its lock), once it holds
    sweep_dir: Optional[Path] = None  # a multirun's directory
    place: Optional[Place] = None  # the single run's directory, or the sweep's, that the command claims
    jobs: list[Place] = field(default_factory=list)  # a sweep's jobs


def keep_hydra_record(decided: Decided, place: Place) -> record.Changes:
    """What the command will change in `place`, starting from Hydra's record there as it is now: what Hydra writes
    over before the job runs."""
    changes = decided.changes.setdefault(os.path.abspath(place.path), record.Changes())
    changes.was(record.hydra_record(place.path, place.subdir))
    return changes


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
    (launch.place), and — in the process that decides — its run directory: accutrain's or new, not an earlier run's
    (unless continued or replaced), writable, its log file too."""
    run = typed_run(task)  # before PyTorch is imported (seconds): a mistake in a value is answered at once
    if decide:
        run_dir = output_dir(cfg, "run", decided.argv)
        subdir = None if cfg.hydra.output_subdir is None else str(cfg.hydra.output_subdir)
        decided.place = Place(run_dir, subdir, run.resume, run.trainer.overwrite)
        look_at_run_dir(decided.place)
        made = [run_dir, run_dir / rundir.CHECKPOINTS, *([run_dir / subdir] if subdir is not None else [])]
        decided.place.made = [folder for folder in made if not folder.exists()]
        owned.check_tracker_paths(run_dir, loggers(run), run.resume)
    check_plugins(run)
    from accutrain.runtime.launch import place

    decided.run, decided.ranks = run, place(run)
    if not decide:
        return
    make_output_dir(run_dir, "hydra.run.dir")
    has_log = OmegaConf.select(cfg, "hydra.job_logging.handlers.file") is not None
    log = run_dir / f"{cfg.hydra.job.name}.log" if has_log else None
    decided.place.log = log if log is not None and not log.exists() else None
    rundir.check_writable(run_dir, log)
    if cfg.hydra.output_subdir is not None:
        rundir.writable(run_dir / str(cfg.hydra.output_subdir), "Hydra's record of the config")


def look_at_run_dir(place: Place) -> bool:
    """The single run's directory: accutrain's, new or empty, and holding no earlier run unless the run continues or
    replaces it (or one running now). Whether an earlier run is there."""
    owned.refuse_foreign(place.path, "hydra.run.dir")
    return place.path.is_dir() and rundir.check_reuse(place.path, place.resume, place.overwrite)


def check_sweep(hydra: Any, base: DictConfig, decided: Decided, decide: bool) -> None:
    """A multirun: every job composes with known keys (its values are checked when it runs: a job failing is
    recorded and the sweep goes on); the sweep directory is accutrain's or new, can be written and holds no earlier
    sweep's runs unless they are continued (resume=auto) or replaced (trainer.overwrite=true)."""
    sweep_dir = output_dir(base, "sweep", decided.argv) if decide else Path(str(base.hydra.sweep.dir)).expanduser()
    decided.sweep_dir = sweep_dir
    for _, overrides, cfg in job_configs(hydra, base):
        task = task_config(cfg, overrides)
        job_dir = sweep_dir / str(cfg.hydra.sweep.subdir)
        if decide:
            owned.check_tracker_paths(job_dir, dict(task.get("logger") or {}), task.get("resume"))
        subdir = None if cfg.hydra.output_subdir is None else str(cfg.hydra.output_subdir)
        decided.jobs.append(Place(job_dir, subdir, task.get("resume"), bool(task.trainer.overwrite)))
    if not decide:
        return
    decided.place = Place(sweep_dir)
    look_at_sweep(decided)
    if not sweep_dir.exists():
        decided.place.made.append(sweep_dir)
    make_output_dir(sweep_dir, "hydra.sweep.dir")
    rundir.writable(sweep_dir, "the sweep's jobs")


def look_at_sweep(decided: Decided, keep: bool = False) -> None:
    """The sweep's directory and its jobs' that exist: accutrain's, and no earlier sweep's runs unless continued or
    replaced (or one running now). keep: remember Hydra's record of each earlier run before Hydra writes over it."""
    assert decided.place is not None
    owned.refuse_foreign(decided.place.path, "hydra.sweep.dir", "sweep")
    earlier = []
    for job in decided.jobs:
        if not job.path.is_dir():
            continue
        owned.refuse_foreign(job.path, "hydra.sweep.dir")
        if rundir.earlier_run(job.path) and job.resume is None and not job.overwrite:
            earlier.append(job.path.name)
        elif rundir.check_reuse(job.path, job.resume, job.overwrite, "hydra.sweep.dir") and keep:
            keep_hydra_record(decided, job)
    if earlier:
        jobs = ", ".join(earlier[:8]) + (", …" if len(earlier) > 8 else "")
        raise UserError(f"{decided.place.path} (hydra.sweep.dir) holds the runs of an earlier sweep (jobs {jobs}): add "
                        "resume=auto to continue them, trainer.overwrite=true to delete them and start afresh, or "
                        "choose a new hydra.sweep.dir")


@contextmanager
def claimed(decided: Decided) -> Iterator[None]:
    """The command's claim on its run's (or sweep's) directory, from before Hydra writes there to the command's end
    (store.claim): held, checked again under the hold — another command may have started a run there since the
    command line was checked — and marked as accutrain's. Nothing to claim where the command decided no directory
    (accutrain-check, --cfg, torchrun's other ranks). Raises UserError, having put back what it wrote."""
    place = decided.place
    if place is None:
        yield
        return
    here = os.path.abspath(place.path)
    sweep = decided.sweep_dir is not None
    changes = record.Changes()

    def look() -> None:
        # Looked at first: where another command has made an earlier run since, nothing in it is this command's.
        if sweep:
            look_at_sweep(decided, keep=True)
        else:
            look_at_run_dir(place)
        # What the checks made, if no command has written into it since: this command's own.
        changes.made += [folder for folder in place.made
                         if folder.is_dir() and all(owned.empty(p) for p in folder.iterdir())]
        if place.log is not None and place.log.is_file() and not place.log.stat().st_size:
            changes.created.add(place.log)
        if not sweep:
            decided.changes[here] = changes
            keep_hydra_record(decided, place)

    with claim.claimed(place.path, "sweep" if sweep else "run", "hydra.sweep.dir" if sweep else "hydra.run.dir",
                       look, changes):
        decided.held.add(here)
        decided.claimed = changes
        yield


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
