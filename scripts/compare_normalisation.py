"""Where to divide by |W|: before each micro-batch's backward (accutrain: the seed of the backward is world/|W|) or
once after the window's last backward (the gradients of the summed losses, divided at the end, as torchtune does).
Both are exact in real arithmetic; this measures which keeps float32 closer to a float64 reference, on a token
model with variable-length sequences, over many windows.

    python scripts/compare_normalisation.py --windows 20 --accum 16
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn


def model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64))
    return net.to(dtype)


def window_grad(net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], terms: int, where: str
                ) -> list[torch.Tensor]:
    net.zero_grad(set_to_none=True)
    for x, y in batches:
        loss = F.cross_entropy(net(x).transpose(1, 2), y, reduction="sum", ignore_index=-100)
        if where == "before":
            loss.backward(torch.full_like(loss, 1.0 / terms))
        else:
            loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    if where == "after":
        grads = [g / terms for g in grads]
    return grads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--accum", type=int, default=16, help="micro-batches per window")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    args = ap.parse_args(argv)
    print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
    errors: dict[str, list[float]] = {"before": [], "after": []}
    for w in range(args.windows):
        g = torch.Generator().manual_seed(w)
        batches = []
        for _ in range(args.accum):
            x = torch.randint(1, 64, (args.micro_batch, args.length), generator=g)
            y = torch.randint(0, 64, (args.micro_batch, args.length), generator=g)
            lengths = torch.randint(1, args.length + 1, (args.micro_batch,), generator=g)
            y[torch.arange(args.length)[None, :] >= lengths[:, None]] = -100
            batches.append((x, y))
        terms = sum(int((y != -100).sum()) for _, y in batches)
        reference = window_grad(model(torch.float64, w), batches, terms, "before")
        ref_norm = torch.linalg.vector_norm(torch.cat([r.flatten() for r in reference]))
        for where in errors:
            got = window_grad(model(torch.float32, w), batches, terms, where)
            diff = torch.cat([(a.double() - r).flatten() for a, r in zip(got, reference)])
            errors[where].append(float(torch.linalg.vector_norm(diff) / ref_norm))
    for where, values in errors.items():
        label = "÷|W| before each backward (accutrain)" if where == "before" else "÷|W| once after the window"
        print(f"{label}: relative L2 error to float64, median {statistics.median(values):.3e}, "
              f"max {max(values):.3e}")
    wins = sum(b < a for b, a in zip(errors["before"], errors["after"]))
    print(f"before closer in {wins} of {args.windows} windows")


if __name__ == "__main__":
    main()
