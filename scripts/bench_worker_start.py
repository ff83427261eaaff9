"""What starting the workers of `devices=2` costs: forked from the fork server (accutrain's way where the platform
has one) against spawned (each worker a fresh interpreter importing PyTorch and accutrain), each run a fresh
`accutrain` process, alternated. A run is a short job (2 optimizer steps of a tiny MLP), so what is measured is
mostly the start: the wall time of the command, and the CPU time of the whole machine while it ran (Linux
/proc/stat: the fork server and its workers are no children this process could wait for) — run it on an idle
machine.

    python scripts/bench_worker_start.py                  # 5 rounds, devices=2
    python scripts/bench_worker_start.py --rounds 7 devices=4
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

RUN = ["devices=2", "micro_batch=8", "accum=2", "trainer.max_steps=2", "trainer.progress=false", "model=mlp",
       "model.hidden=[16]", "data=synthetic", "data.size=64", "data.val_size=16", "data.image_size=8",
       "data.channels=1"]
# The accutrain command, with the workers' start method forced for the comparison.
DRIVER = ("import sys, accutrain.runtime.workers as workers; method = sys.argv.pop(1); "
          "workers.start_method = (lambda: method) if method == 'spawn' else workers.start_method; "
          "from accutrain.cli.main import main; sys.argv[0] = 'accutrain'; main()")


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def one_run(method: str, overrides: list[str], run_dir: str) -> tuple[float, float]:
    """(wall s, machine CPU s) of one `accutrain` command whose workers start by `method`."""
    cpu, start = busy_seconds(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", DRIVER, method, *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall, cpu = time.perf_counter() - start, busy_seconds() - cpu
    if proc.returncode != 0:
        sys.exit(f"{method}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="accutrain overrides added to the short job (devices=4, say)")
    args = ap.parse_args(argv)
    overrides = RUN + args.overrides
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"job: accutrain {' '.join(overrides)}")
    figures: dict[str, list[tuple[float, float]]] = {"forkserver": [], "spawn": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # which side runs first alternates
            for method in ("forkserver", "spawn")[:: 1 if r % 2 == 0 else -1]:
                figures[method].append(one_run(method, overrides, f"{tmp}/{method}-{r}"))
            print(f"round {r + 1}: " + "   ".join(f"{m} {w:5.1f} s wall {c:5.1f} s CPU" for m, (w, c) in
                                                  ((m, figures[m][-1]) for m in figures)))
    for method, runs in figures.items():
        print(f"median {method:10s}: {statistics.median(w for w, _ in runs):5.1f} s wall, "
              f"{statistics.median(c for _, c in runs):5.1f} s CPU")
    saved = statistics.median(s[1] - f[1] for f, s in zip(figures["forkserver"], figures["spawn"]))
    print(f"forked workers save {saved:.1f} CPU-s per command (median of per-round differences)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
