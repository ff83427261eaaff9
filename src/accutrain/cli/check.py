"""The job Hydra runs for `accutrain-check`: the accumulated gradient of the run's first window against the big
batch's (accutrain.train.check), or with --show-sample a training sample as the loss counts it."""
from __future__ import annotations

import sys
from typing import Callable, Optional

from omegaconf import DictConfig

from accutrain.cli.command import Decided
from accutrain.config.validate import typed_run
from accutrain.errors import UserError, one_line


def check_job(decided: Decided, show_sample: Optional[int], started: Callable[[], None]
              ) -> Callable[[DictConfig], None]:
    """The task function: exit 0 when the run's accumulation is faithful, 1 when not, 2 on a user error."""
    def check(cfg: DictConfig) -> None:
        started()
        from accutrain.train.check import components_for_check, run_check

        try:
            run = decided.run if decided.run is not None else typed_run(cfg)
            if show_sample is not None:  # what the loss counts of one sample; no model, no check
                from accutrain.train.show_sample import show_sample as render

                print(render(run, show_sample))
                return
            result = run_check(components_for_check(run))
        except UserError as e:
            print(f"accutrain-check: error: {one_line(e)}", file=sys.stderr)
            sys.exit(2)
        print("\n".join(result.lines()))
        sys.exit(0 if result.faithful else 1)
    return check
