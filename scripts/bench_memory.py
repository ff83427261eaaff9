"""Peak memory and samples/s against the micro-batch, at a fixed effective batch, each run in a fresh process.

resnet18 on generated images large enough that activations dominate memory; effective batch 64 split as
64×1, 32×2, 16×4, 8×8, 4×16, plus 8×1 (the reference for 8×8: accumulating must not add memory), and 8×8 with
activation checkpointing and with offloaded gradients. Peak memory is what accutrain records per optimizer step
(`peak_mem_mb`: CUDA max allocated on a GPU, the process's peak RSS on the CPU); samples/s is measured after
the first optimizer steps. Prints a table and the command that made it, and saves a plot.

With --strategies it compares how 2 devices share a model whose AdamW state matters (an MLP of 2048-wide layers,
12.6 M parameters): DDP, FSDP with sync=each and sync=last, and FSDP with CPU offload, micro_batch 8 × accum 4 ×
devices 2, each a fresh process, alternated over --rounds (medians of samples/s). Peak memory is rank 0's (the
ranks are symmetric); on the CPU it is the resident set, with glibc's MALLOC_MMAP_THRESHOLD_ set so that freed
buffers return to the system (FSDP's many transient all-gather buffers otherwise fragment the heap and the RSS
shows the allocator, not the tensors). "state" is params + gradients + AdamW's two moments one rank holds;
"above the process" subtracts the peak of the same run with a 2-wide MLP (imports, process group, data, loader).

    python scripts/bench_memory.py                       # 224 px images, 6 optimizer steps per run
    python scripts/bench_memory.py --image-size 224 --steps 12 --out docs/memory_gpu.png   # on a GPU
    python scripts/bench_memory.py --strategies --rounds 3   # DDP vs FSDP at devices=2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SPLITS = [(64, 1), (32, 2), (16, 4), (8, 8), (4, 16), (8, 1)]
EXTRA = [("8×8 + activation checkpointing", (8, 8), ["trainer.activation_checkpointing=true"]),
         ("8×8 + offload_grads", (8, 8), ["trainer.offload_grads=true"])]


def run(micro: int, accum: int, extra: list[str], args: argparse.Namespace) -> tuple[float, float]:
    """(highest per-step peak MiB, samples/s after the warm-up steps) of one fresh accutrain process."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "accutrain", "model=resnet18", "data=synthetic",
                   f"data.image_size={args.image_size}", "data.size=512", "data.val_size=16",
                   f"micro_batch={micro}", f"accum={accum}", "trainer.epochs=null", f"trainer.max_steps={args.steps}",
                   "trainer.eval_every=1000000", "trainer.progress=false", f"hydra.run.dir={tmp}", *extra,
                   *args.overrides]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
        steps = [r for r in map(json.loads, Path(tmp, "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    timed = steps[args.warmup :]
    rate = sum(r["samples"] for r in timed[1:]) / (timed[-1]["time"] - timed[0]["time"])
    return max(r["peak_mem_mb"] for r in steps), rate


STRATEGIES = [("DDP", ["strategy=ddp"]),
              ("FSDP sync=each", ["strategy=fsdp", "strategy.sync=each"]),
              ("FSDP sync=last", ["strategy=fsdp", "strategy.sync=last"]),
              ("FSDP sync=each + cpu_offload", ["strategy=fsdp", "strategy.cpu_offload=true"])]
MLP = ["model=mlp", "data=synthetic", "data.image_size=32", "data.channels=2",
       "data.size=1024", "data.val_size=16", "optim=adamw", "micro_batch=8", "accum=4", "devices=2",
       "strategy.wrap=[Linear]"]


def run_strategy(extra: list[str], args: argparse.Namespace, width: int = 2048) -> tuple[float, float, float]:
    """(highest per-step peak MiB of rank 0, samples/s after the warm-up, params + grads + AdamW MiB per rank)."""
    overrides = [*MLP[:-1], *extra, f"model.hidden=[{width},{width},{width}]"] + (
        [MLP[-1]] if "strategy=fsdp" in extra else [])
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else None
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "accutrain", *overrides, "trainer.epochs=null",
                   f"trainer.max_steps={args.steps}", "trainer.eval_every=1000000", "trainer.progress=false",
                   f"hydra.run.dir={tmp}", *args.overrides]
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
        steps = [r for r in map(json.loads, Path(tmp, "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        saved = torch.load(Path(tmp, "checkpoints", "last.pt"), weights_only=True)
    params = sum(t.numel() * t.element_size() for t in saved["model"].values())
    moments = sum(t.numel() * t.element_size() for s in saved["optimizer"]["state"].values() for t in s.values())
    shards = 2 if "strategy=fsdp" in extra else 1
    timed = steps[args.warmup :]
    rate = sum(r["samples"] for r in timed[1:]) / (timed[-1]["time"] - timed[0]["time"])
    return max(r["peak_mem_mb"] for r in steps), rate, (2 * params + moments) / shards / 2**20


def strategies(args: argparse.Namespace) -> None:
    threshold = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold else "glibc's default malloc"
    print(f"MLP 2048×2048 ×3 (12.6 M parameters), AdamW, micro_batch 8 × accum 4 × devices 2; {threshold}; "
          f"{args.steps} optimizer steps per run, first {args.warmup} untimed; {args.rounds} round(s)")
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in STRATEGIES}
    base = {name: run_strategy(extra, args, width=2)[0] for name, extra in STRATEGIES}
    print("the process without the model (a 2-wide MLP): " + ", ".join(f"{n} {mb:.0f} MiB" for n, mb in base.items()))
    for round_ in range(args.rounds):
        order = STRATEGIES if round_ % 2 == 0 else STRATEGIES[::-1]  # alternate: the machine's drift hits both
        for name, extra in order:
            results[name].append(run_strategy(extra, args))
            print(f"round {round_ + 1}: {name:<30} peak {results[name][-1][0]:7.0f} MiB  "
                  f"{results[name][-1][1]:8.1f} samples/s", flush=True)
    print(f"| {'strategy (devices=2)':<30} | {'state per rank (MiB)':>20} | {'peak memory, rank 0 (MiB)':>25} | "
          f"{'above the process (MiB)':>23} | {'samples/s (median)':>18} |")
    print(f"|{'-' * 32}|{'-' * 22}|{'-' * 27}|{'-' * 25}|{'-' * 20}|")
    for name, runs in results.items():
        peak = max(r[0] for r in runs)
        print(f"| {name:<30} | {runs[0][2]:>20.0f} | {peak:>25.0f} | {peak - base[name]:>23.0f} | "
              f"{statistics.median(r[1] for r in runs):>18.1f} |")


def plot(rows: list[tuple[str, int, int, float, float]], out: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), tight_layout=True)
    memory_ax, speed_ax = fig.subplots(1, 2)
    split = [r for r in rows if r[0] == f"{r[1]}×{r[2]}" and r[1] * r[2] == 64]
    for ax, column, label in ((memory_ax, 3, "peak memory (MiB)"), (speed_ax, 4, "samples/s")):
        ax.plot([r[1] for r in split], [r[column] for r in split], "o-", label="effective batch 64: micro × accum")
        for name, micro, accum, mem, rate in rows:
            if (name, micro * accum) != (f"{micro}×{accum}", 64):
                ax.plot([micro], [mem if column == 3 else rate], "s", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro_batch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    memory_ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first optimizer steps not timed")
    ap.add_argument("--out", type=Path, default=Path("docs/memory.png"))
    ap.add_argument("--strategies", action="store_true", help="DDP vs FSDP (each/last/offload) at devices=2")
    ap.add_argument("--rounds", type=int, default=1, help="--strategies: alternated rounds (median samples/s)")
    ap.add_argument("--mmap-threshold", type=int, default=131072,
                    help="--strategies: MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc's default)")
    ap.add_argument("overrides", nargs="*", help="more accutrain overrides, e.g. trainer.precision=bf16-mixed")
    args = ap.parse_args(argv)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    header = (f"resnet18, {args.image_size}×{args.image_size} images, {device}, torch {torch.__version__}, "
              f"{platform.machine()}")
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    if args.strategies:
        print(f"{device}, torch {torch.__version__}, {platform.machine()}")
        return strategies(args)
    print(header)
    print(f"| {'micro_batch × accum':<32} | {'peak memory (MiB)':>17} | {'samples/s':>9} |")
    print(f"|{'-' * 34}|{'-' * 19}|{'-' * 11}|")
    rows = []
    for name, (micro, accum), extra in [(f"{m}×{a}", (m, a), []) for m, a in SPLITS] + EXTRA:
        mem, rate = run(micro, accum, extra, args)
        rows.append((name, micro, accum, mem, rate))
        print(f"| {name:<32} | {mem:>17.0f} | {rate:>9.1f} |", flush=True)
    by_name = {r[0]: r for r in rows}
    print(f"8×8 peak / 8×1 peak = {by_name['8×8'][3] / by_name['8×1'][3]:.3f}; "
          f"4×16 peak / 64×1 peak = {by_name['4×16'][3] / by_name['64×1'][3]:.3f}")
    plot(rows, args.out, header)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
