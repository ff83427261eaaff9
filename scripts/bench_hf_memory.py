"""data=hf's host memory against the number of records: the peak RSS of `accutrain` (a tiny GPT-2, a few steps) on
2,000 and on 200,000 short chat records, each from a cold cache (the records read and tokenized by Dataset.map,
then read on demand from its memory-mapped Arrow files). What is held per record — its row and its length — is a
few bytes; the tokens never are, so the peak is flat in the number of records.

Each run is `accutrain` in a process of its own, its peak RSS (ru_maxrss) read by a parent that runs nothing else;
the sizes are alternated over the rounds and the median reported.

    python scripts/bench_hf_memory.py                    # 2,000 vs 200,000 records, 2 rounds (a few minutes)
    python scripts/bench_hf_memory.py --sizes 2000 20000 --rounds 1
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
         "+model.config.n_embd=64", "+model.config.n_positions=128", "model.dropout=0"]


def write_chats(path: Path, n: int) -> None:
    """`n` short conversations (a question, an answer), ≈ 115 bytes each."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i % 7}?"},
                                             {"role": "assistant", "content": f"{i + i % 7}."}]}) + "\n")


def command(train: Path, val: Path, cache: Path, run_dir: Path) -> list[str]:
    return [str(Path(sys.executable).with_name("accutrain")), *MODEL, "data=hf", f"data.train={train}",
            f"data.val={val}", f"data.cache_dir={cache}", "data.max_length=128", "micro_batch=8", "accum=2",
            "trainer.max_steps=4", "trainer.progress=false", f"hydra.run.dir={run_dir}"]


PARENT = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if proc.returncode:
    sys.exit(proc.stdout + proc.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_mib(argv: list[str]) -> float:
    """The peak RSS of the command, in MiB (run under a parent of its own: RUSAGE_CHILDREN is that run's alone)."""
    out = subprocess.run([sys.executable, "-c", PARENT, *argv], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    if out.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed:\n{out.stderr[-3000:]}")
    return int(out.stdout.split()[-1]) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000, 200_000])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_chats(root / "val.jsonl", 100)
        for n in args.sizes:
            write_chats(root / f"chat{n}.jsonl", n)
        peaks: dict[int, list[float]] = {n: [] for n in args.sizes}
        for r in range(args.rounds):
            for n in args.sizes if r % 2 == 0 else args.sizes[::-1]:
                argv = command(root / f"chat{n}.jsonl", root / "val.jsonl", root / f"cache-{n}-{r}",
                               root / f"run-{n}-{r}")
                peaks[n].append(peak_mib(argv))
                print(f"round {r + 1}: {n:,} records: peak RSS {peaks[n][-1]:.0f} MiB", flush=True)
        shown = ["accutrain", *command(Path("chat.jsonl"), Path("val.jsonl"), Path("cache"), Path("run"))[1:]]
        print("\ncommand (per size):", shlex.join(shown))
        print(f"machine: {os.cpu_count()} cores; peak RSS of the whole accutrain process, median of "
              f"{args.rounds} cold-cache runs")
        first = statistics.median(peaks[args.sizes[0]])
        for n in args.sizes:
            median = statistics.median(peaks[n])
            size = os.path.getsize(root / f"chat{n}.jsonl") / 2**20
            print(f"{n:>9,} records ({size:6.1f} MiB of JSON lines): peak RSS {median:6.0f} MiB  "
                  f"({median / first:.3f}× the first)")


if __name__ == "__main__":
    main()
