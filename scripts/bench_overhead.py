"""accutrain's steady-state samples/s against the minimal hand-written accumulation loop, in one process.

Both loops train the same model (same seed), on the same dataset, with the same micro_batch × accum split and
the same optimizer. The hand-written loop is the textbook one:

    loss = cross_entropy(model(x), y) / accum;  loss.backward()
    if (i + 1) % accum == 0: optimizer.step(); optimizer.zero_grad()

accutrain runs its whole recipe (window sampler, exact normalisation, grad-norm, scheduler, metrics.jsonl,
progress bar). Runs alternate (hand then accutrain in odd rounds, accutrain then hand in even ones) so that
machine noise and the heap one run leaves to the next hit both sides alike; the first steps of
each run are warm-up and not timed. Prints the per-round figures, the medians, their ratio, and accutrain's extra
cost per optimizer step in µs. `--clock cpu` times by the process's CPU time instead of the wall clock: on a shared
machine it leaves out the time the process waited for a core (CPU training only; with 1 thread it is the stablest
figure — `--threads 1`).

    python scripts/bench_overhead.py                                   # resnet18 on digits, 32 × 4
    python scripts/bench_overhead.py --rounds 7 model=mlp micro_batch=8 accum=8
    python scripts/bench_overhead.py --device cuda accum=4                # on a GPU (scripts/gpu_check.sh)
    python scripts/bench_overhead.py --clock cpu --threads 1 --rounds 9 model=mlp micro_batch=8 accum=8
    python scripts/bench_overhead.py --hand-loader gather --clock cpu --threads 1 model=mlp micro_batch=8 accum=8

accutrain's train loader takes a micro-batch of in-memory tensors (the digits, generated data) with one indexing per
tensor; the textbook loop's DataLoader fetches and stacks it sample by sample. `--hand-loader gather` gives the hand
loop the same one-indexing batches, so that what is left between the two is accutrain's own bookkeeping.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import accutrain
from accutrain.config.typed import seal
from accutrain.dist import World
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train.build import build
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog


def setup(cfg):
    return build(cfg, World(), torch.device(cfg.trainer.device))


CLOCK = time.perf_counter  # or time.process_time (--clock cpu)


def now(device: torch.device) -> float:
    """The time once the device's queued work is done (accutrain's loop waits for it too, once per step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return CLOCK()


class TimedMetrics(MetricsLog):
    """metrics.jsonl as accutrain writes it, and the clock at each step's record."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.times: list[float] = []
        self.samples: list[int] = []

    def step(self, record: dict) -> None:
        self.times.append(CLOCK())
        self.samples.append(record["samples"])
        super().step(record)


def steady_rate(times: list[float], samples: list[int], warmup: int) -> float:
    """Samples per second from the end of step `warmup` to the end of the last step."""
    return sum(samples[warmup + 1 :]) / (times[-1] - times[warmup])


def gathered(dataset, micro_batch: int, seed: int):
    """Micro-batches of in-memory tensors, each taken with one indexing from a shuffled order (what a hand-written
    loop does without a DataLoader when the data is two tensors)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        for index in torch.randperm(len(dataset), generator=g).split(micro_batch):
            yield dataset.images[index], dataset.labels[index]


def hand_written(cfg, steps: int, warmup: int, loader: str = "dataloader") -> float:
    r = setup(cfg)  # the same model (seed), data and optimizer as accutrain's; only the loop is the textbook one
    model, optimizer, accum = r.model, r.optimizer, r.plan.accum
    dataset = r.loader.dataset.dataset
    if loader == "gather":
        if not hasattr(dataset, "images"):
            sys.exit(f"--hand-loader gather needs data held as tensors (digits, synthetic), not {cfg.data.target}")
        batches = gathered(dataset, cfg.micro_batch, cfg.seed)
    else:
        batches = DataLoader(dataset, batch_size=cfg.micro_batch, shuffle=True, pin_memory=r.device.type == "cuda",
                             generator=torch.Generator().manual_seed(cfg.seed))
    times, samples, window = [], [], 0
    model.train()
    while len(times) < steps:
        for i, (x, y) in enumerate(batches):
            x, y = x.to(r.device, non_blocking=True), y.to(r.device, non_blocking=True)
            loss = F.cross_entropy(model(x), y) / accum
            loss.backward()
            window += len(y)
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
                times.append(now(r.device))
                samples.append(window)
                window = 0
                if len(times) == steps:
                    break
    return steady_rate(times, samples, warmup)


def accutrain_loop(cfg, steps: int, warmup: int) -> float:
    trainer = dataclasses.replace(cfg.trainer, epochs=None, max_steps=steps, eval_every=10**9)
    cfg = seal(dataclasses.replace(cfg, trainer=trainer))
    r = setup(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = TimedMetrics(Path(tmp) / "metrics.jsonl")
        with StopRequest() as stop:
            fit(r, metrics, Progress(), lambda *a, **k: None, stop)
        metrics.close()
    return steady_rate(metrics.times, metrics.samples, warmup)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="first optimizer steps not timed")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--hand-loader", choices=("dataloader", "gather"), default="dataloader",
                    help="the hand loop's batches: torch's DataLoader (the textbook loop), or in-memory tensors "
                         "indexed per micro-batch as accutrain's loader takes them (then the difference is "
                         "accutrain's bookkeeping alone)")
    ap.add_argument("overrides", nargs="*", help="accutrain overrides (default: the default job, accum=4)")
    args = ap.parse_args(argv)
    overrides = args.overrides or ["accum=4"]
    cfg = accutrain.compose(f"trainer.device={args.device}", *overrides)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)

    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    gpu = f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
    print(f"machine: {platform.processor() or platform.machine()}{gpu}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, MALLOC_ARENA_MAX="
          f"{os.environ.get('MALLOC_ARENA_MAX', '-')} "
          f"MALLOC_TRIM_THRESHOLD_={os.environ.get('MALLOC_TRIM_THRESHOLD_', '-')}")
    print(f"config: {' '.join(overrides)}; {args.steps} optimizer steps per run, first {args.warmup} untimed; "
          f"{args.clock} clock; load average {os.getloadavg()[0]:.1f}")
    hand, ours = [], []

    def hand_side(cfg, steps: int, warmup: int) -> float:
        return hand_written(cfg, steps, warmup, args.hand_loader)

    for r in range(args.rounds):  # which side runs first alternates: neither always inherits the other's heap
        for side in ((hand_side, hand), (accutrain_loop, ours))[:: 1 if r % 2 == 0 else -1]:
            side[1].append(side[0](cfg, args.steps, args.warmup))
        print(f"round {r + 1}: hand-written {hand[-1]:8.1f} samples/s   accutrain {ours[-1]:8.1f} samples/s   "
              f"ratio {ours[-1] / hand[-1]:.3f}")
    ratios = [o / h for o, h in zip(ours, hand)]
    print(f"median: hand-written {statistics.median(hand):.1f} samples/s, accutrain {statistics.median(ours):.1f} "
          f"samples/s; accutrain / hand-written = {statistics.median(ratios):.3f} (median of per-round ratios)")
    step = cfg.micro_batch * (cfg.accum or 1)
    extra = statistics.median((1 / o - 1 / h) * step * 1e6 for o, h in zip(ours, hand))
    print(f"per optimizer step ({step} samples): hand-written {step / statistics.median(hand) * 1e6:.0f} µs; "
          f"accutrain's extra {extra:.0f} µs (median of per-round differences)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
