"""loss=contrastive: the exact window loss (gradient caching, two forwards per sample) against the naive one
(loss.window=false: each micro-batch's own InfoNCE) at the same effective batch and micro-batch, on the digits that
ship with accutrain, two random views per image. Prints, for each: the final weights' distance from the big batch's
(micro_batch = the effective batch, one micro-batch per step), the held-out loss and recall@1, and the time per
optimizer step — exact and naive runs alternated, so that both share the machine's state; then the accumulation of
one window alone (no data loading), exact and naive alternated: the cost of the extra forward.

    python scripts/compare_window_loss.py --epochs 3 --micro 8 --accum 8 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import accutrain
from accutrain.core.batches import Batch
from accutrain.core.gradcache import accumulate_window_loss
from accutrain.core.losses.contrastive import ContrastiveLoss


def run(args: list[str], run_dir: Path) -> tuple[dict[str, torch.Tensor], list[dict], list[dict]]:
    """Train in this process; (final weights, step records, evaluation records)."""
    run_dir.mkdir(parents=True)
    accutrain.run(*args, "trainer.progress=false", run_dir=run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    return weights, [r for r in records if "loss" in r], [r for r in records if "val_loss" in r]


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖₂ over every weight."""
    return float(torch.sqrt(sum((a[k].double() - b[k].double()).square().sum() for k in a)))


def step_seconds(steps: list[dict]) -> list[float]:
    """Each full window's seconds (samples / samples_per_s), the first (warm-up) left out."""
    full = max(r["samples"] for r in steps)
    return [r["samples"] / r["samples_per_s"] for r in steps[1:] if r["samples"] == full]


def window_seconds(micro: int, accum: int, width: int, repeats: int) -> dict[str, float]:
    """The accumulation of one window alone (no data loading: a window of random pairs held in memory), exact and
    naive alternated `repeats` times on the same weights: the median seconds of each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 64))
    x = torch.randn(micro * accum, 2, 1, 8, 8)
    batches = [Batch(part, torch.zeros(len(part), dtype=torch.int64)) for part in x.split(micro)]
    losses = {"exact": ContrastiveLoss(0.2), "naive": ContrastiveLoss(0.2, window=False)}
    seconds: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(repeats):
        for name, loss in losses.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            accumulate_window_loss(model, batches, len(x), torch.device("cpu"), loss)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="exact/naive pairs of timed runs, alternated")
    parser.add_argument("--width", type=int, default=1024, help="the timed encoder's hidden width (window timing)")
    parser.add_argument("overrides", nargs="*", help="more accutrain overrides for every run")
    opts = parser.parse_args(argv)
    logging.getLogger("accutrain").setLevel(logging.WARNING)
    task = ["data=digits", "model=mlp", "model.hidden=[64]", "loss=contrastive", "augment.views=2", "augment.crop=pad",
            "augment.padding=1", "optim=adamw", "optim.lr=0.003", "loss.temperature=0.2", "trainer.grad_clip=1.0",
            f"trainer.epochs={opts.epochs}", "trainer.eval_every=1000000", *opts.overrides]
    split = [f"micro_batch={opts.micro}", f"accum={opts.accum}"]
    effective = opts.micro * opts.accum
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        big, _, big_evals = run([*task, f"micro_batch={effective}", "accum=1"], root / "big")
        start, _, _ = run([*task, f"micro_batch={effective}", "trainer.max_steps=1"], root / "start")
        moved = distance(start, big)  # how far one step moves the weights: the scale of the distances below
        results: dict[str, dict] = {"exact": {"seconds": []}, "naive": {"seconds": []}}
        for repeat in range(opts.repeats):
            for name, extra in (("exact", []), ("naive", ["loss.window=false"])):
                weights, steps, evals = run([*task, *split, *extra], root / f"{name}{repeat}")
                results[name].update(weights=weights, evals=evals[-1])
                results[name]["seconds"] += step_seconds(steps)
    print(f"digits, two views (augment.crop=pad padding=1), mlp [64], AdamW, τ=0.2, {opts.epochs} epochs, effective "
          f"batch {effective}; big batch: micro_batch={effective}; split: micro_batch={opts.micro} accum={opts.accum}")
    print(f"  one optimizer step moves the weights by {moved:.3g} (L2)")
    print(f"  {'':<6} {'‖w − w_big‖₂':>14} {'val_loss':>9} {'recall@1':>9} {'s/step (median)':>16}")
    print(f"  {'big':<6} {0.0:>14.3g} {big_evals[-1]['val_loss']:>9.4f} {big_evals[-1]['val_recall1']:>9.4f} "
          f"{'':>16}")
    for name, r in results.items():
        print(f"  {name:<6} {distance(r['weights'], big):>14.3g} {r['evals']['val_loss']:>9.4f} "
              f"{r['evals']['val_recall1']:>9.4f} {statistics.median(r['seconds']):>16.4f}")
    print("  (the runs' time per step is mostly drawing the views: two torchvision transforms per sample)")
    torch.set_num_threads(1)  # one thread: a shared machine's load disturbs one thread least
    timed = window_seconds(opts.micro, opts.accum, opts.width, 50)
    print(f"one window's accumulation alone (in memory, no views drawn), an MLP 64→{opts.width}→{opts.width}→64, "
          f"{opts.micro}×{opts.accum} pairs, 50 alternated repeats, one thread: exact {timed['exact'] * 1e3:.2f} ms, naive "
          f"{timed['naive'] * 1e3:.2f} ms — the exact loss costs {timed['exact'] / timed['naive']:.2f}× (its extra "
          "forward without gradients)")
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))


if __name__ == "__main__":
    main()
