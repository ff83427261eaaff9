"""glibc's allocator and accumulation: accutrain with `trainer.tune_malloc` (its default on the CPU), without it, and
the untuned hand-written loop, each in a fresh process (a process's allocator cannot be untuned), alternated round by
round. Prints samples/s (wall clock and process CPU time), minor page faults per optimizer step and the peak RSS.

    python scripts/bench_malloc.py                                    # resnet18, 3×64×64, micro_batch 8 × accum 4
    python scripts/bench_malloc.py --rounds 5 --threads 2 model=mlp
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("accutrain, tuned", "accutrain, untuned", "hand-written, untuned")
DEFAULT = ["model=resnet18", "data=synthetic", "data.image_size=64", "micro_batch=8", "accum=4"]


def one(variant: str, steps: int, warmup: int, threads: int, overrides: list[str]) -> dict:
    """Run one variant in this process: its rates, minor faults per step and peak RSS (over the timed steps)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_overhead
    import torch

    import accutrain
    from accutrain.runtime.malloc import tune_malloc

    torch.set_num_threads(threads)
    if variant == "accutrain, tuned":
        tune_malloc()  # what accutrain does at the start of a CPU run (session.train_rank)
    stamps: list[tuple[float, float, int]] = []

    def clock() -> float:  # called once per optimizer step by both loops
        stamps.append((time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
        return stamps[-1][0]

    bench_overhead.CLOCK = clock
    cfg = accutrain.compose("trainer.device=cpu", *overrides)
    run = bench_overhead.accutrain_loop if variant.startswith("accutrain") else bench_overhead.hand_written
    run(cfg, steps, warmup)
    samples = cfg.micro_batch * (cfg.accum or 1) * (steps - warmup - 1)  # full windows (no tail this early)
    (w0, c0, f0), (w1, c1, f1) = stamps[warmup], stamps[-1]
    return dict(wall=samples / (w1 - w0), cpu=samples / (c1 - c0), faults=(f1 - f0) / (steps - warmup - 1),
                peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first optimizer steps not timed")
    ap.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one variant
    ap.add_argument("overrides", nargs="*", help=f"accutrain overrides (default: {' '.join(DEFAULT)})")
    args = ap.parse_args(argv)
    overrides = args.overrides or DEFAULT
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.warmup, args.threads, overrides)))
        return
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {os.confstr('CS_GNU_LIBC_VERSION')}, "
          f"{args.threads} thread(s); load average {os.getloadavg()[0]:.1f}")
    print(f"config: {' '.join(overrides)}; {args.steps} optimizer steps per run, first {args.warmup} untimed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            out = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps), "--warmup",
                                  str(args.warmup), "--threads", str(args.threads), *overrides],
                                 capture_output=True, text=True, env=env, check=True)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
            res = results[variant][-1]
            print(f"round {r + 1} {variant:<22} {res['wall']:7.2f} samples/s wall  {res['cpu']:7.2f} per CPU-s  "
                  f"{res['faults']:9.0f} minor faults/step  peak RSS {res['peak_mb']:.0f} MiB")
    hand = results["hand-written, untuned"]
    print("| variant | samples/s (wall) | × hand | samples per CPU-s | × hand | minor faults / step | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        ratio = {k: statistics.median(run[k] / h[k] for run, h in zip(runs, hand)) for k in ("wall", "cpu")}
        print(f"| {variant} | {med['wall']:.2f} | {ratio['wall']:.2f} | {med['cpu']:.2f} | {ratio['cpu']:.2f} | "
              f"{med['faults']:.0f} | {med['peak_mb']:.0f} |")
    print(f"(medians of {args.rounds} rounds; × hand: median of per-round ratios; load average at the end "
          f"{os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
