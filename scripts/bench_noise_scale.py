"""What trainer.noise_scale=true costs per optimizer step on the default job (resnet18 on the shipped digits), split
into micro-batches so that there is something to compare: runs with it off and on, alternating round after round in
one process, each step's time read back from metrics.jsonl (samples / samples_per_s: the whole step, from the
window's first micro-batch to its record), medians over steps, then over rounds.

    python scripts/bench_noise_scale.py [--rounds 5] [--steps 40] [--micro-batch 8] [--accum 4]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from accutrain.config.train import compose
from accutrain.run.launch import train


def step_seconds(run_dir: Path, skip: int) -> float:
    """The median time of the run's optimizer steps after the first `skip` (warm-up)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["samples"] / r["samples_per_s"] for r in records if "loss" in r and r["step"] > skip]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    logging.getLogger("accutrain").setLevel(logging.WARNING)
    common = [f"model={args.model}", f"micro_batch={args.micro_batch}", f"accum={args.accum}",
              f"trainer.max_steps={args.steps}", "trainer.progress=false", "trainer.eval_every=100000",
              "loader.num_workers=0"]
    results: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
                run_dir = Path(tmp) / f"{name}{round_}"
                run_dir.mkdir()
                train(compose(*common, f"trainer.noise_scale={'true' if name == 'on' else 'false'}"), run_dir)
                results[name].append(step_seconds(run_dir, skip=5))
            print(f"round {round_ + 1}: off {results['off'][-1] * 1e3:.1f} ms/step, "
                  f"on {results['on'][-1] * 1e3:.1f} ms/step", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"{args.model}, micro_batch {args.micro_batch} × accum {args.accum}, {args.rounds} rounds of {args.steps} "
          f"steps, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {torch.get_num_threads()} threads")
    print(f"median per optimizer step: off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms: "
          f"{100 * (on - off) / off:+.1f} %")


if __name__ == "__main__":
    main()
