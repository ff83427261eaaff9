"""accutrain at a git revision against the working tree and the hand-written loop, alternated in ONE process.

bench_overhead.py compares accutrain with the hand loop in one process, but two versions of accutrain can only be
compared across processes there, and on a shared machine a process's own luck (its heap, where its pages landed)
moves a run's ratio by ±0.03 — more than most changes to the loop. This script imports the revision's package
under another name (`git archive` into a temporary directory, its imports renamed) beside the working tree's, and
runs the three sides in rotating order, round after round: hand-written, revision, working tree. CPU time of the
process, 1 intra-op thread, steps after `--warmup` timed. Prints per-round µs per optimizer step, the medians of
the per-round ratios to the hand loop, and the median per-round difference between the two versions.

    python scripts/bench_overhead_vs.py HEAD~1 --rounds 15 model=mlp micro_batch=8 accum=8
"""
from __future__ import annotations

import argparse
import importlib
import logging
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead  # noqa: E402  (the hand-written loop and the timed metrics log)


def import_revision(rev: str, into: Path) -> str:
    """The package as it was at `rev`, importable as `accutrain_at_rev` (its configs beside it)."""
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "src/accutrain", "configs"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "accutrain_at_rev"
    (into / "src" / "accutrain").rename(package)
    (into / "configs").rename(package / "configs")
    for path in package.rglob("*.py"):  # imports, and the `_target_` paths its schemas name
        text = re.sub(r"\b(from|import) accutrain\b(?=[. ])", r"\1 accutrain_at_rev", path.read_text())
        path.write_text(re.sub(r"([\"'])accutrain\.", r"\1accutrain_at_rev.", text))
    for path in (package / "configs").rglob("*.yaml"):
        path.write_text(re.sub(r"(_target_: )accutrain\.", r"\1accutrain_at_rev.", path.read_text()))
    sys.path.insert(0, str(into))
    return "accutrain_at_rev"


# Where each module the bench uses lives: the layered package, then the flat one that came before it.
LAYOUTS = ({"build": "train.build", "config": "config.train", "dist": "dist", "loop": "train.loop",
            "metrics": "train.metrics", "progress": "store.progress", "signals": "signals"},
           {k: k for k in ("build", "config", "dist", "loop", "metrics", "progress", "signals")})


def package_modules(package: str) -> dict:
    """The bench's modules of `package`, in whichever layout it has."""
    for layout in LAYOUTS:
        try:
            return {k: importlib.import_module(f"{package}.{path}") for k, path in layout.items()}
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"{package}: neither layout found")


def typed_run(package: str):
    """`package`'s config.validate.typed_run, or none before the typed run (issue 39): its build took the composed
    config."""
    try:
        return importlib.import_module(f"{package}.config.validate").typed_run
    except (ModuleNotFoundError, AttributeError):
        return lambda cfg: cfg


def accutrain_side(package: str, overrides: list[str], steps: int, warmup: int) -> float:
    """µs per optimizer step of `package`'s fit on the config."""
    m = package_modules(package)
    # Both packages store their schemas in Hydra's one ConfigStore: this side's, again, before it composes.
    getattr(m["config"].register_schemas, "cache_clear", lambda: None)()
    cfg = typed_run(package)(m["config"].compose(*overrides, "trainer.epochs=null", f"trainer.max_steps={steps}",
                                                 "trainer.eval_every=1000000000"))
    c = m["build"].build(cfg, m["dist"].World(), torch.device(cfg.trainer.device))
    times: list[float] = []

    class Timed(m["metrics"].MetricsLog):
        def step(self, record: dict) -> None:
            times.append(time.process_time())
            super().step(record)

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Timed(Path(tmp) / "metrics.jsonl")
        with m["signals"].StopRequest() as stop:
            m["loop"].fit(c, metrics, m["progress"].Progress(), lambda *a, **k: None, stop)
        metrics.close()
    return (times[-1] - times[warmup]) / (len(times) - 1 - warmup) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the git revision to compare the working tree with (e.g. HEAD~1, main)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=20, help="first optimizer steps not timed")
    ap.add_argument("--hand-loader", choices=("dataloader", "gather"), default="dataloader",
                    help="the hand loop's batches (bench_overhead.py --help)")
    ap.add_argument("overrides", nargs="*", help="accutrain overrides (default: model=mlp micro_batch=8 accum=8)")
    args = ap.parse_intermixed_args(argv)
    overrides = ["trainer.device=cpu", *(args.overrides or ["model=mlp", "micro_batch=8", "accum=8"])]
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)
    bench_overhead.CLOCK = time.process_time
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    with tempfile.TemporaryDirectory() as tmp:
        old = import_revision(args.rev, Path(tmp))
        from accutrain.config.train import compose

        cfg = typed_run("accutrain")(compose(*overrides))
        per_step = 1e6 * cfg.micro_batch * cfg.accum  # samples/s → µs per optimizer step
        sides = {"hand-written": lambda: per_step / bench_overhead.hand_written(cfg, args.steps, args.warmup,
                                                                                   args.hand_loader),
                 args.rev: lambda: accutrain_side(old, overrides, args.steps, args.warmup),
                 "working tree": lambda: accutrain_side("accutrain", overrides, args.steps, args.warmup)}
        names, results = list(sides), {name: [] for name in sides}
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:  # each side follows each other side as often
                results[name].append(sides[name]())
            print(f"round {r + 1}: " + "   ".join(f"{n} {results[n][-1]:.0f} µs" for n in names), flush=True)
    hand = results["hand-written"]
    for name in names[1:]:
        ratio = statistics.median(h / x for h, x in zip(hand, results[name]))
        extra = statistics.median(x - h for h, x in zip(hand, results[name]))
        print(f"{name}: {ratio:.3f}× the hand-written loop, extra {extra:.0f} µs per optimizer step (medians)")
    change = statistics.median(n - o for n, o in zip(results["working tree"], results[args.rev]))
    print(f"working tree − {args.rev}: {change:+.0f} µs per optimizer step (median of per-round differences)")


if __name__ == "__main__":
    main()
