"""What trainer.noise_scale=true costs per optimizer step: the default job (resnet18 on the shipped digits) split
into micro-batches so that there is something to compare, with the noise scale off and on, alternating round after
round in one process (off then on in odd rounds, on then off in even ones); each run's steady samples/s after its
warm-up steps (bench_overhead.py's accutrain side, metrics.jsonl and all), medians over rounds. `--clock cpu` times
by the process's CPU time: on a shared machine it leaves out the time the process waited for a core (use it with
`--threads 1`).

    python scripts/bench_noise_scale.py --clock cpu --threads 1 --rounds 5 --steps 30
    python scripts/bench_noise_scale.py --rounds 5 model=mlp micro_batch=8 accum=8
    python scripts/bench_noise_scale.py --isolated --clock cpu --threads 1 --rounds 41

`--isolated` times what the hooks add to one micro-batch — a norm of each parameter's gradient — against that
micro-batch's forward and backward alone, alternating the two `--rounds` times in one process: the overhead as a
fraction of the work it rides on, much less noisy on a shared machine than whole runs.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import time

import bench_overhead  # scripts/: run as `python scripts/bench_noise_scale.py`
import torch

from accutrain.config.train import compose
from accutrain.config.validate import typed_run
from accutrain.dist import World
from accutrain.train.noise_scale import NoiseScale


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="first optimizer steps not timed")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time")
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("overrides", nargs="*", help="accutrain overrides (default: the default job, micro_batch=8 "
                                                 "accum=4)")
    ap.add_argument("--isolated", action="store_true", help="the hooks' work against a micro-batch's alone")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        bench_overhead.CLOCK = time.process_time
    logging.getLogger("accutrain").setLevel(logging.ERROR)
    overrides = args.overrides or ["micro_batch=8", "accum=4"]
    if args.isolated:
        return isolated(overrides, args.rounds)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(args.rounds):
        for name in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            cfg = typed_run(compose(*overrides, "trainer.progress=false", "loader.num_workers=0", "trainer.device=cpu",
                                    f"trainer.noise_scale={str(name == 'on').lower()}"))
            rates[name].append(bench_overhead.accutrain_loop(cfg, args.steps, args.warmup))
        print(f"round {round_ + 1}: off {rates['off'][-1]:.1f} samples/s, on {rates['on'][-1]:.1f} samples/s",
              flush=True)
    cfg = compose(*overrides)
    samples = cfg.micro_batch * (cfg.accum or 1)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{' '.join(overrides)}: {args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up), {args.clock} "
          f"clock, torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads")
    print(f"median per optimizer step of {samples} samples: off {1e3 * samples / off:.2f} ms, on "
          f"{1e3 * samples / on:.2f} ms: the noise scale costs {100 * (off / on - 1):+.1f} % of a step")


def isolated(overrides: list[str], rounds: int) -> None:
    """One micro-batch's forward and backward without the hooks, and with them (armed, as in a window), timed
    alternately; also the hooks' norms alone, on the gradients after the backward."""
    c = bench_overhead.setup(typed_run(compose(*overrides, "trainer.progress=false", "loader.num_workers=0",
                                               "trainer.device=cpu")))
    batch = c.loader.dataset.__getitems__(next(c.sampler.windows())[0])[1]  # the first micro-batch
    params = [p for p in c.model.parameters() if p.requires_grad]
    clock = bench_overhead.CLOCK
    times: dict[str, list[float]] = {"plain": [], "hooked": [], "norms": []}

    def backward() -> None:
        torch.nn.functional.cross_entropy(batch.forward(c.model, c.precision.inputs), batch.target,
                                          reduction="sum").backward()

    for round_ in range(rounds):
        for name in (("plain", "hooked") if round_ % 2 == 0 else ("hooked", "plain")):
            c.model.zero_grad(set_to_none=True)
            noise = NoiseScale(params, World(), torch.device("cpu")) if name == "hooked" else None
            if noise is not None:
                noise.begin(len(batch), 1)
            start = clock()
            backward()
            if noise is not None:
                noise.micro_batch_done(len(batch))
            times[name].append(clock() - start)
            if noise is not None:
                noise.remove()
        grads = [p.grad for p in params]
        start = clock()
        torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).double().square().sum()
        times["norms"].append(clock() - start)
    plain, hooked, norms = (statistics.median(times[k]) for k in ("plain", "hooked", "norms"))
    print(f"{' '.join(overrides)}, {rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads: "
          f"a micro-batch's forward and backward {plain * 1e3:.2f} ms, with the hooks {hooked * 1e3:.2f} ms "
          f"({100 * (hooked / plain - 1):+.1f} %); the norms alone {norms * 1e3:.3f} ms ({100 * norms / plain:.1f} %)")


if __name__ == "__main__":
    main()
