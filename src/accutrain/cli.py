"""The `accutrain` console entry point: Hydra composes the typed config, a user error ends in one line."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from accutrain.config import register_schemas
from accutrain.errors import UserError
from accutrain.plots import write_loss_plot
from accutrain.run_status import recorded
from accutrain.sweep import SweepSummary

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
    """One run. A single run ends a user error with exit 2; in a multirun a failing job (user error or crash) is
    recorded as failed in its status.json and the sweep goes on with the next job."""
    from accutrain.train import train  # imported here so that `--help` and config errors stay fast

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        with recorded(run_dir):  # status.json: running, then completed | failed | interrupted
            train(cfg, run_dir)
    except UserError as e:
        log.error(str(e))
        if not multirun:
            sys.exit(2)
    except Exception:
        if not multirun:
            raise
        log.exception("this job failed; the sweep goes on")
    finally:
        write_loss_plot(run_dir)


def main() -> None:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # user plug-ins (`_target_`) import from the working directory, as with -m
    _train()
    if SweepSummary.failed_jobs:  # a multirun whose summary counted failed jobs
        sys.exit(1)


if __name__ == "__main__":
    main()
