"""What the default checkpointing (trainer.checkpoint_minutes: every 10 minutes and at every epoch end) costs a
job: one checkpoint write of its state, through the real call (runtime/checkpoints.Checkpoints: the state gathered, checked
finite, written atomically and fsynced, last.pt linked, the rotation pruned), timed `--writes` times; and what that
adds to the job's length, one write per epoch and per 10 minutes of training.

    python scripts/bench_checkpoint_cost.py --writes 7            # the default job: resnet18 on the digits
    python scripts/bench_checkpoint_cost.py --writes 3 model=mlp
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.dist import World
from accutrain.runtime.checkpoints import Checkpoints
from accutrain.store import mark
from accutrain.store.progress import Progress
from accutrain.trackers import Trackers
from accutrain.train.build import build


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writes", type=int, default=7, help="checkpoints written and timed")
    ap.add_argument("overrides", nargs="*", help="the job's overrides (none: the default job)")
    args = ap.parse_args(argv)
    cfg = typed_run(compose(*args.overrides, "trainer.progress=false"))
    with tempfile.TemporaryDirectory() as tmp:
        parts = build(cfg, World(), torch.device("cpu"), cache_dir=Path(tmp))
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        mark.write_new(run_dir, "run")
        (run_dir / "checkpoints").mkdir()
        save, times = Checkpoints(parts, run_dir / "checkpoints", Trackers()), []
        for step in range(1, args.writes + 1):
            progress = Progress()
            progress.step = step
            start = time.perf_counter()
            save(progress)
            times.append(time.perf_counter() - start)
        size = (run_dir / "checkpoints" / "last.pt").stat().st_size
    median = statistics.median(times)
    epochs, steps = parts.plan.total_epochs, parts.plan.total_steps
    print(f"{args.overrides or 'the default job'}: a checkpoint of {size / 2**20:.1f} MiB, written in "
          f"{' '.join(f'{t:.3f}' for t in times)} s: median {median:.3f} s")
    print(f"{steps} optimizer steps over {epochs} epochs: the default checkpointing adds {epochs - 1} writes (the "
          f"last epoch's end is the run's end) and one per 10 minutes of training: {(epochs - 1) * median:.2f} s, "
          f"plus {median:.3f} s per 10 minutes ({median / 600:.3%})")


if __name__ == "__main__":
    main()
