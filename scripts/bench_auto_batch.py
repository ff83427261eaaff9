"""micro_batch=auto's choice against the largest micro-batch that really fits, on a CUDA GPU.

All but `--free-mb` MiB of the GPU is held first, so that the limit is reached in seconds. accutrain's search then
picks the largest divisor of global_batch whose trial step fits (global_batch defaults to 720720, whose divisors lie
a few per cent apart, so the divisor rule costs little). Independently, a bisection over every integer finds the
largest micro-batch for which the hand-written step (forward, backward, optimizer step, the model fresh from the
same build) fits. Prints both, their ratio, and the command.

    python scripts/bench_auto_batch.py                                  # resnet18, 64 px, 4000 MiB free
    python scripts/bench_auto_batch.py --free-mb 8000 data.image_size=128 trainer.precision=bf16-mixed
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys

import torch
import torch.nn.functional as F

import accutrain
from accutrain.config.train import TrainConfig
from accutrain.dist import World
from accutrain.train.build import build
from accutrain.train.memory import is_oom

DEFAULTS = ["model=resnet18", "data=synthetic", "data.image_size=64", "data.size=512", "trainer.device=cuda",
            "global_batch=720720", "micro_batch=auto", "trainer.max_steps=1"]


def run_config(overrides: list[str], micro_batch: int | None = None) -> TrainConfig:
    """The run of `overrides`; with `micro_batch`, that micro-batch alone per optimizer step (global_batch too)."""
    if micro_batch is not None:
        overrides = [*(o for o in overrides if not o.startswith(("micro_batch=", "global_batch="))),
                     f"micro_batch={micro_batch}", f"global_batch={micro_batch}"]
    return accutrain.compose(*overrides)


def hand_step_fits(cfg, size: int) -> bool:
    """One forward, backward and optimizer step on `size` samples, with the run's model, optimizer and precision."""
    r = build(cfg, World(), torch.device("cuda", 0))
    try:
        shape = next(iter(r.loader))[1].inputs.shape[1:]
        x = torch.randn(size, *shape, device=r.device)
        y = torch.randint(0, 10, (size,), device=r.device)
        with r.precision.autocast():
            loss = F.cross_entropy(r.model(x), y)
        r.precision.backward(loss)
        r.optimizer.step()
        torch.cuda.synchronize()
        return True
    except Exception as e:
        if not is_oom(e):
            raise
        return False
    finally:
        del r
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free-mb", type=int, default=4000, help="MiB of the GPU left free for the search")
    ap.add_argument("overrides", nargs="*", help="more accutrain overrides")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        sys.exit("bench_auto_batch needs a CUDA GPU")
    overrides = [*DEFAULTS, *args.overrides]
    free, _ = torch.cuda.mem_get_info()
    hold = torch.empty(free - args.free_mb * 2**20, dtype=torch.uint8, device="cuda")
    chosen = build(run_config(overrides), World(), torch.device("cuda", 0)).plan.micro_batch
    torch.cuda.empty_cache()
    cfg = lambda m: run_config(overrides, m)  # noqa: E731
    lo, hi = chosen, 2 * chosen  # lo fits (checked), hi grows until it does not
    assert hand_step_fits(cfg(lo), lo), f"auto's choice {chosen} does not fit the hand-written step"
    while hand_step_fits(cfg(hi), hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if hand_step_fits(cfg(mid), mid) else (lo, mid)
    del hold
    print(f"$ python scripts/bench_auto_batch.py {shlex.join(sys.argv[1:])}")
    print(f"{torch.cuda.get_device_name(0)}, {args.free_mb} MiB free, {' '.join(overrides)}")
    print(f"micro_batch=auto chose {chosen}; the largest that fits the hand-written step: {lo}; "
          f"ratio {chosen / lo:.3f}")


if __name__ == "__main__":
    main()
