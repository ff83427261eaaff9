"""Several devices: samples/s and gradient bytes communicated per optimizer step, one sync vs. a sync per micro-batch.

For accum in 1, 2, 4, 8 at devices=2, accutrain's loop runs twice: as shipped (DDP `no_sync` on every
micro-batch but the last: one gradient all-reduce per optimizer step) and with `no_sync` taken away (an
all-reduce after every micro-batch, what a loop that forgets `no_sync` does). Both count what DDP's
communication hook sent. The micro-batch is fixed, so the effective batch grows with accum. Each run is
fresh worker processes; the first optimizer steps are warm-up and not timed.

    python scripts/bench_ddp.py                                 # resnet18 on digits, micro_batch 16, gloo/CPU
    python scripts/bench_ddp.py --steps 30 model=mlp micro_batch=32
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch

from accutrain import dist
from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.runtime.workers import spawn
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train.build import build
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog


def bench_worker(world: dist.World, cfg, out: str, sync_every_micro_batch: bool) -> None:
    logging.getLogger("accutrain").setLevel(logging.ERROR)
    device = dist.worker_device(dist.resolve_device(cfg.trainer.device), world)
    dist.init_process_group(world, device)
    r = build(cfg, world, device)
    if sync_every_micro_batch:
        r.strategy.no_sync = nullcontext  # the forgotten no_sync: DDP all-reduces after every backward
    metrics = MetricsLog(Path(out) if world.main else None)
    with StopRequest(announce=False) as stop:
        fit(r, metrics, Progress(), lambda *a, **k: None, stop)
    metrics.close()


def measure(cfg, sync_every: bool, warmup: int) -> tuple[float, float, float]:
    """(samples/s after warm-up, gradient all-reduces per optimizer step, MB communicated per optimizer step)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "metrics.jsonl")
        spawn(2, bench_worker, (cfg, out, sync_every), None)
        steps = [r for r in map(json.loads, Path(out).read_text().splitlines()) if "loss" in r]
    timed = steps[warmup:]
    rate = sum(r["samples"] for r in timed[1:]) / (timed[-1]["time"] - timed[0]["time"])
    syncs = sum(r["grad_syncs"] for r in timed) / len(timed)
    megabytes = sum(r["comm_bytes"] for r in timed) / len(timed) / 2**20
    return rate, syncs, megabytes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="first optimizer steps not timed")
    ap.add_argument("--accums", default="1,2,4,8")
    ap.add_argument("overrides", nargs="*", help="accutrain overrides (default: resnet18 on digits, micro_batch=16)")
    args = ap.parse_args(argv)
    overrides = args.overrides or ["micro_batch=16"]
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; devices=2 "
          f"({'NCCL' if torch.cuda.device_count() >= 2 else 'gloo on the CPU'}); {' '.join(overrides)}; "
          f"{args.steps} optimizer steps per run, first {args.warmup} untimed")
    print(f"{'accum':>5} | {'one sync per step':>30} | {'a sync per micro-batch':>30} | speed-up")
    print(f"{'':>5} | {'samples/s  syncs/step  MB/step':>30} | {'samples/s  syncs/step  MB/step':>30} |")
    for accum in map(int, args.accums.split(",")):
        cfg = typed_run(compose("devices=2", f"accum={accum}", "trainer.epochs=null", f"trainer.max_steps={args.steps}",
                                "trainer.eval_every=1000000", "trainer.progress=false", *overrides))
        once = measure(cfg, False, args.warmup)
        every = measure(cfg, True, args.warmup)
        print(f"{accum:>5} | {once[0]:>9.1f}  {once[1]:>10.1f}  {once[2]:>7.1f} | "
              f"{every[0]:>9.1f}  {every[1]:>10.1f}  {every[2]:>7.1f} | {once[0] / every[0]:.2f}×", flush=True)


if __name__ == "__main__":
    main()
