"""Is accumulation worth it? An equal-samples study on the shipped digits (docs/batch-size.md): the small CNN
(model=cnn: no BatchNorm, no dropout, so every accumulated step is exactly the big batch's), AdamW at lr 1e-3 and β2
0.999 taken as tuned for a base batch of 64, 10 epochs each (the same 14,370 samples), one run after another in one
process on one thread:

    a      micro_batch=8, no accumulation, β2 scaled to the batch (scaling.beta2=half_life)
    a/2×2  the same windows of 8 as two micro-batches of 4, only to log the noise scale along (a)'s path
    b64    micro_batch=8 × accum 8 = 64, lr scaled (scaling.lr=sqrt: the base's lr)
    b256   micro_batch=8 × accum 32 = 256, lr scaled (sqrt: 2× the base's)

Prints one row per run: the validation loss and accuracy after each epoch (per sample seen), the training time
(wall, and the process's CPU time: on a shared machine the latter leaves out the waits for a core), and the noise
scale each run logged, late in training.

    python scripts/batch_size_study.py [--epochs 10] [--only a,b64]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

import accutrain

COMMON = ["model=cnn", "optim=adamw", "optim.lr=1e-3", "scaling.base_batch=64", "trainer.progress=false",
          "loader.num_workers=0"]
RUNS = {
    "a": ["micro_batch=8", "scaling.beta2=half_life"],
    "a/2x2": ["micro_batch=4", "accum=2", "scaling.beta2=half_life", "trainer.noise_scale=true"],
    "b64": ["micro_batch=8", "accum=8", "scaling.lr=sqrt", "trainer.noise_scale=true"],
    "b256": ["micro_batch=8", "accum=32", "scaling.lr=sqrt", "trainer.noise_scale=true"],
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--only", default=",".join(RUNS), help="the runs, comma-separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("accutrain").setLevel(logging.ERROR)
    print("| run | effective | steps | val loss / acc by samples seen | wall s | CPU s | B_simple, last fifth |")
    print("|---|--:|--:|---|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            run_dir = Path(tmp) / name.replace("/", "_")
            run_dir.mkdir()
            cpu, wall = time.process_time(), time.perf_counter()
            accutrain.run(*COMMON, *RUNS[name], f"trainer.epochs={args.epochs}", run_dir=run_dir)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in records if "loss" in r]
            seen = {r["step"]: r["samples_seen"] for r in steps}
            evals = [f"{seen[r['step']]}: {r['val_loss']:.3f} / {r['val_acc']:.3f}" for r in records if "val_acc" in r]
            noise = [r["b_simple"] for r in steps if r.get("b_simple") is not None]
            late = f"{statistics.median(noise[int(0.8 * len(noise)):]):.0f}" if noise else "–"
            print(f"| {name} | {steps[-1]['effective']} | {len(steps)} | {'; '.join(evals)} | {wall:.0f} | {cpu:.0f} "
                  f"| {late} |", flush=True)


if __name__ == "__main__":
    main()
