"""What the command line takes from Hydra's private modules (`hydra._internal`, hydra-core 1.3), in one place: the
argument parser, the config search path and the Hydra instance that `hydra.main` makes, and the basic sweeper's
split of a sweep into jobs — so that the checks before Hydra runs compose exactly what Hydra will.
tests/config/test_hydra_internals.py fails, naming the function, when a Hydra release moves or changes one of them."""
from __future__ import annotations

import os
import sys
from argparse import ArgumentParser
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional


def args_parser() -> ArgumentParser:
    """The parser `hydra.main` applies to the command line (--multirun, --config-dir, --cfg, overrides, …)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def main_hydra(task_name: str, primary_config_dir: str, extra_dir: str | None = None) -> Any:
    """A Hydra instance over `primary_config_dir` (and --config-dir's `extra_dir` before it), as `hydra.main` sets it
    up; its `compose_config` and `config_loader` compose as the run will. GlobalHydra must be cleared after use."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    search_path = create_config_search_path(f"file://{primary_config_dir}")
    if extra_dir is not None:
        search_path.prepend(provider="command-line", path=f"file://{extra_dir}",
                            anchor=SearchPathQuery(provider="schema"))
    return Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path)


@contextmanager
def known_mode(mode: Any) -> Iterator[None]:
    """While Hydra runs: its `Hydra.get_mode`, which composes the whole config once more only to read `hydra.mode`,
    answers `mode` — the value the checks read from their composition of the same command line (a third of a short
    run's start-up time)."""
    from hydra._internal.hydra import Hydra

    original = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = original


def sweep_jobs(parsed_overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper makes them from parsed sweep overrides (one batch: all jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [list(job) for job in BasicSweeper.split_arguments(parsed_overrides, None)[0]]


def run(argv: list[str], task: Callable[[Any], Any], config_path: str, config_name: str,
        mode: Optional[tuple[Any]] = None) -> None:
    """What `hydra.main` does with a command line, for `argv` (not sys.argv) and `task` (a closure holding what the
    command line decided): --experimental-rerun, or Hydra's run of the job (a sweep's jobs); `mode`, where the
    checks read it — `(hydra.mode,)` — spares Hydra a composition (known_mode)."""
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser
    from hydra.main import _get_rerun_conf

    version.setbase("1.3")
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.experimental_rerun is not None:
        task(_get_rerun_conf(args.experimental_rerun, args.overrides))
        return
    with known_mode(mode[0]) if mode is not None else nullcontext(), hydra_write_errors_in_one_line():
        _run_hydra(args=args, args_parser=parser, task_function=task, config_path=config_path,
                   config_name=config_name)


@contextmanager
def hydra_write_errors_in_one_line() -> Iterator[None]:
    """While Hydra runs: a file Hydra itself cannot write (its record of the run, .hydra/*.yaml, or a sweep's
    multirun.yaml, on a full disk) is one line and exit code 2, not the traceback Hydra's run_and_report prints. An
    OSError raised in accutrain's own code (the job) is not Hydra's: it goes its usual way."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except OSError as e:
                if not hydras_own(e):
                    raise
                where = f" {e.filename or written_file(e) or ''}".rstrip()
                sys.stderr.write(f"accutrain: error: Hydra could not write{where} ({e.strerror or e}): make room on "
                                 "that disk (or choose a directory on another) and run the command again\n")
                sys.exit(2)
        return original(guarded)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = original


def hydras_own(error: BaseException) -> bool:
    """Whether no frame of the error's traceback is accutrain's: Hydra (or OmegaConf under it) raised it."""
    import accutrain

    ours = os.path.dirname(accutrain.__file__)
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None  # (the first: `guarded` above)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(ours):
            return False
        tb = tb.tb_next
    return True


def written_file(error: BaseException) -> Any:
    """The file Hydra's _save_config (the run's record) or OmegaConf.save (its `f`: a sweep's multirun.yaml) was
    writing when `error` was raised, if it was."""
    tb, found = error.__traceback__, None
    while tb is not None:
        name, local = tb.tb_frame.f_code.co_name, tb.tb_frame.f_locals
        if name == "_save_config" and "output_dir" in local and "filename" in local:
            found = os.path.join(str(local["output_dir"]), str(local["filename"]))
        elif name == "save" and isinstance(local.get("f"), (str, os.PathLike)):
            found = local["f"]
        tb = tb.tb_next
    return found
