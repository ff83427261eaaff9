"""The `accutrain` console entry point: Hydra composes the typed config, a user error ends in one line."""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from accutrain.config import register_schemas
from accutrain.errors import UserError, one_line

log = logging.getLogger("accutrain")


def config_dir() -> Path:
    """The configs: inside the package in a wheel, at the repository's top level in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "configs", here.parent.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise RuntimeError(f"accutrain's configs are missing (looked in {here / 'configs'}): reinstall accutrain")


register_schemas()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def _train(cfg: DictConfig) -> None:
    from accutrain.train import run  # imported here so that `--help` and config errors stay fast

    hydra_cfg = HydraConfig.get()
    log_config = OmegaConf.to_container(hydra_cfg.job_logging, resolve=True)  # for spawned workers' rank 0
    try:
        outcome = run(cfg, Path(hydra_cfg.runtime.output_dir), log_config)
    except UserError as e:
        log.error(one_line(e))
        sys.exit(2)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once, without a checkpoint")
        sys.exit(128 + signal.SIGINT)
    if outcome is not None and outcome.stopped_by:
        sys.exit(128 + signal.Signals[outcome.stopped_by])


def check_output_dir(argv: list[str]) -> None:
    """Create an output directory given on the command line now, so a bad one is one line, not a traceback."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            try:
                Path(value).expanduser().mkdir(parents=True, exist_ok=True)
            except OSError as e:
                print(f"accutrain: error: cannot create the output directory {key}={value}: {e.strerror or e}",
                      file=sys.stderr)
                sys.exit(2)


def main() -> None:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # user plug-ins (`_target_`) import from the working directory, as with -m
    if os.environ.get("RANK", "0") != "0" and "LOCAL_RANK" in os.environ:
        sys.argv.append("hydra.output_subdir=null")  # under torchrun, rank 0 alone records the run's config
    check_output_dir(sys.argv[1:])
    _train()


if __name__ == "__main__":
    main()
