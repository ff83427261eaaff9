"""The console entry points `accutrain` and `accutrain-check`: the command line is checked (accutrain.cli.command),
then Hydra composes the config again and runs the job (accutrain.cli.job) with what the check decided; a user error
ends in one line. Importing this module does nothing: Hydra and PyTorch are imported once Ctrl-C is answered."""
from __future__ import annotations

import os
import signal
import sys
from contextlib import ExitStack, contextmanager
from types import FrameType
from typing import Any, Callable, Iterator, Optional


class Startup:
    """Ctrl-C while the command imports Hydra and PyTorch, checks the command line or Hydra sets the run up (seconds,
    nothing trained, no status.json yet): one line and exit 130 at once — not the traceback of whatever it landed in
    (or a confused error from a library interrupted halfway). Once the job runs, a KeyboardInterrupt as usual."""

    def __init__(self, prog: str) -> None:
        self.prog, self.in_job, self.before = prog, False, None
        self.changes: Any = None  # what the command wrote before its job (store.record.Changes): put back on Ctrl-C

    def __enter__(self) -> Startup:
        self.before = signal.signal(signal.SIGINT, self.interrupted)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self.before)

    def job_started(self) -> None:
        self.in_job = True

    def interrupted(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.in_job:
            raise KeyboardInterrupt
        if self.changes is not None:
            self.changes.put_back()
        sys.stderr.write(f"{self.prog}: interrupted while starting: nothing was trained\n")
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)


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


def import_from_working_directory() -> None:
    """User plug-ins (`_target_`) import from the working directory, as with `python -m`."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def before_hydra(prog: str, argv: list[str], **checks: bool) -> Any:
    """The command line checked before Hydra runs it (accutrain.cli.command): what it decided, or one line and exit
    code 2."""
    from accutrain.cli.command import check
    from accutrain.cli.compose import expand_home
    from accutrain.cli.job import torchrun_secondary
    from accutrain.config.renames import renamed
    from accutrain.errors import UserError, one_line

    argv = renamed(expand_home(argv), say=lambda line: print(f"{prog}: notice: {line}", file=sys.stderr))
    try:
        return check(argv, prog=prog, **checks)
    except UserError as e:
        rank = "" if not torchrun_secondary() else f"[rank {os.environ['RANK']}] "
        sys.stderr.write(f"{rank}{prog}: error: {one_line(e)}\n")  # one write: ranks' lines never interleave
        sys.stderr.flush()
        sys.exit(2)


@contextmanager
def claim_or_exit(decided: Any, startup: Startup) -> Iterator[None]:
    """The command's claim on its directory (accutrain.cli.command.claimed) for the block: refused, one line and
    exit code 2; Ctrl-C before the job starts puts back what the claim wrote."""
    from accutrain.cli.command import claimed
    from accutrain.errors import UserError, one_line

    hold = ExitStack()
    try:
        hold.enter_context(claimed(decided))
    except UserError as e:
        sys.stderr.write(f"accutrain: error: {one_line(e)}\n")
        sys.stderr.flush()
        sys.exit(2)
    with hold:
        startup.changes = decided.claimed
        yield


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
    with Startup("accutrain-check") as startup:
        import_from_working_directory()
        argv = sys.argv[1:]
        if "--help" in argv or "-h" in argv:  # its own flags, not accutrain's training help
            from accutrain.cli.help import print_check_help

            print_check_help("accutrain-check")
            sys.exit(0)
        show = take_show_sample(argv)
        decided = before_hydra("accutrain-check", argv, run=False)
        decided.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled",
                         "hydra/hydra_logging=disabled"]
        from accutrain.cli import hydra_internals
        from accutrain.cli.check import check_job
        from accutrain.config.train import config_dir

        hydra_internals.run(decided.argv, check_job(decided, show, startup.job_started), str(config_dir()), "train",
                            decided.mode)


@interruptible("accutrain")
def main() -> None:
    """`accutrain [key=value …]`: train (or a sweep with -m); exit 0, 1 (a sweep's job failed, a rank died), 2 (a
    user error) or 128 + a signal."""
    with Startup("accutrain") as startup:
        import_from_working_directory()
        from accutrain.cli import hydra_internals
        from accutrain.cli.job import Tally, torchrun_secondary, train_job
        from accutrain.config.train import config_dir, register_schemas
        from accutrain.errors import UserError, one_line
        from accutrain.report.sweep import failed_jobs
        from accutrain.runtime.scheduler import adopt_scheduler_world

        argv = sys.argv[1:]
        try:  # under srun with several tasks: the world SLURM started, as torchrun's variables
            adopt_scheduler_world()
        except UserError as e:
            print(f"accutrain: error: {one_line(e)}", file=sys.stderr)
            sys.exit(2)
        if torchrun_secondary():
            argv.append("hydra.output_subdir=null")  # under torchrun, rank 0 alone records the run's config
        decided = before_hydra("accutrain", argv, decide=not torchrun_secondary())  # every rank composes; 0 decides
        register_schemas()
        tally = Tally()
        with claim_or_exit(decided, startup):
            hydra_internals.run(decided.argv, train_job(decided, tally, startup.job_started), str(config_dir()),
                                "train", decided.mode)
    if decided.sweep_dir is not None:  # a multirun: its jobs' records, and those that failed here before they had one
        failed, jobs = failed_jobs(decided.sweep_dir)
        failed = max(failed, tally.failed)
        if failed:
            print(f"accutrain: {failed} of {max(jobs, failed)} jobs failed (exit code 1)", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
