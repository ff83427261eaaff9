"""What each tracker costs the training loop per optimizer step: the time its log_step (and, every 50 steps, a
flush, as a checkpoint would ask) takes for a metrics.jsonl record of the usual keys, after start and before finish.
For MLflow, the same records sent one log_batch per step (what batching saves) are timed beside it. Trackers
alternate over the rounds; medians are printed.

    python scripts/bench_trackers.py                     # 500 steps per round, 5 rounds
    python scripts/bench_trackers.py --steps 200 --rounds 3
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import accutrain
from accutrain.core.plan import make_plan
from accutrain.trackers import RunEnd, Trackers, scalars


def record(step: int) -> dict:
    return dict(step=step, epoch=1 + step // 100, loss=2.3 / step ** 0.5, samples=32, micro_batches=4, lr=0.05,
                grad_norm=1.0 / step, samples_per_s=700.0, samples_seen=32 * step, time=0.1 * step, peak_mem_mb=800.0)


def time_tracker(name: str, root: Path, steps: int) -> float:
    """ms per optimizer step of logger=<name> (start and finish not timed)."""
    run_dir = root / f"{name}-{time.monotonic_ns()}"
    run_dir.mkdir()
    cfg = accutrain.compose(f"logger={name}", "debug=fast")
    trackers = Trackers.build(cfg, run_dir)
    plan = make_plan(micro_batch=8, accum=4, devices=1, global_batch=None, train_size=32 * steps,
                     last_window=cfg.trainer.last_window, epochs=1, max_steps=None)
    trackers.start(cfg, {}, plan, 0, resumed=False)
    began = time.perf_counter()
    for step in range(1, steps + 1):
        trackers.log_step(record(step))
        if step % 50 == 0:
            trackers.flush()
    seconds = time.perf_counter() - began
    assert trackers.active, f"{name} stopped logging"
    for tracker in trackers.active.values():  # close, without drawing a plot
        tracker.finish(RunEnd("completed", {}, None))
    return seconds / steps * 1000


def time_mlflow_unbatched(root: Path, steps: int) -> float:
    """ms per step when each step's metrics are one synchronous log_batch (no batching), for comparison."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=f"sqlite:///{(root / 'mlflow.db').resolve()}")
    found = client.get_experiment_by_name("unbatched")
    experiment = found.experiment_id if found else client.create_experiment("unbatched")
    run_id = client.create_run(experiment).info.run_id
    began = time.perf_counter()
    for step in range(1, steps + 1):
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in scalars(record(step)).items()])
    return (time.perf_counter() - began) / steps * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("WANDB_MODE", "offline")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, python "
          f"{platform.python_version()}")
    print(f"command: python {' '.join(sys.argv)}")
    names = ["csv", "tensorboard", "mlflow", "wandb"]
    results: dict[str, list[float]] = {name: [] for name in [*names, "mlflow, one log_batch per step"]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        root.mkdir()
        for r in range(args.rounds):
            for name in names:
                results[name].append(time_tracker(name, root, args.steps))
            results["mlflow, one log_batch per step"].append(time_mlflow_unbatched(root, min(args.steps, 100)))
            print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in results.items()))
    print(f"\n| tracker | ms per optimizer step (median of {args.rounds} rounds of {args.steps} steps) |")
    print("|---|---:|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
