"""accutrain: gradient accumulation whose every optimizer step is exactly the big batch's step.

From Python (scripts, notebooks): `accutrain.run(*overrides, run_dir=...)` trains as `accutrain <overrides>` does and
returns the run's record; `accutrain.compose(*overrides)` is the typed run it would train (accutrain.cli.api)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from pathlib import Path

__version__ = "0.1.0"


def run(*overrides: str, run_dir: Optional[str | Path] = None) -> Any:
    """Train as `accutrain <overrides>` would, in this process; the run's record (accutrain.report.runs.RunRow)."""
    from accutrain.cli.api import run as run_overrides  # here: `import accutrain` stays free of PyTorch and Hydra

    return run_overrides(*overrides, run_dir=run_dir)


def compose(*overrides: str) -> Any:
    """The typed, frozen run `accutrain <overrides>` would train (accutrain.config.train.TrainConfig), checked."""
    from accutrain.cli.api import compose as compose_run

    return compose_run(*overrides)
