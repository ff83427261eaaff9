"""loss=moe measured: the router's balancing loss over the whole window (loss.router_aux=window) against each
micro-batch balanced alone (micro_batch), at the same effective batch and micro-batch, on a tiny random Mixtral
trained on generated text from four distinct synthetic domains (sums of numbers, DNA-like strands, a small English-like
grammar, C-like code), one domain per line, shuffled.

`study`: for each seed, window and micro_batch alternated, trained in this process; then each run's last weights on
the held-out lines of every domain: the held-out loss, the expert load over all of them (each layer's busiest expert
over the mean, the entropy of the shares), and how specialised the experts became per domain — the mutual
information between a token's domain and the experts it is routed to (top-k choices, per layer, in bits; at most
log2(4) = 2), and each domain's share of tokens on its own busiest expert.
`cost`: what pass 1 costs — one window of the same model and lines held in memory, accumulated with off (no balancing
loss), micro_batch and window in turn, `--repeats` rounds: the median time per window (and on a GPU the peak memory).

    python scripts/moe_balancing.py study --seeds 0 1 2 --micro-batch 2 --effective 32 --epochs 3 --lines 1920
    python scripts/moe_balancing.py cost --repeats 30 --micro-batch 4 --effective 32
    # on a GPU (a larger tiny model, and bf16):
    python scripts/moe_balancing.py study --device cuda --hidden 256 --layers 4 --experts 8 --lines 20000
    python scripts/moe_balancing.py cost --device cuda --hidden 1024 --layers 8 --experts 8 --micro-batch 16 \\
        --effective 256 --precision bf16-mixed
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

import accutrain
from accutrain.core.batches import Batch, BatchFormat, PadCollate
from accutrain.core.routing import load, route, token_rows
from accutrain.data.tokenizer import ByteTokenizer

DOMAINS = ("sums", "dna", "english", "code")
WORDS = {"noun": "cat dog bird fish child river stone cloud".split(), "verb": "sees finds likes follows hears".split(),
         "adj": "small red quiet old bright".split()}


def line(domain: str, r: random.Random) -> str:
    """One line of `domain`'s grammar."""
    if domain == "sums":
        return " ".join(f"{a}+{b}={a + b};" for a, b in ((r.randint(0, 99), r.randint(0, 99)) for _ in range(4)))
    if domain == "dna":
        strand, base = [], r.choice("ACGT")
        for _ in range(r.randint(30, 50)):  # a Markov chain: a base likely follows its complement
            base = {"A": "T", "T": "A", "C": "G", "G": "C"}[base] if r.random() < 0.6 else r.choice("ACGT")
            strand.append(base)
        return "".join(strand)
    if domain == "english":
        sentence = lambda: f"the {r.choice(WORDS['adj'])} {r.choice(WORDS['noun'])} {r.choice(WORDS['verb'])} " \
                           f"the {r.choice(WORDS['noun'])}."
        return " ".join(sentence() for _ in range(2))
    v = r.choice("xyzijk")
    return f"for({v}=0;{v}<{r.randint(2, 9)};{v}++){{{r.choice('abc')}[{v}]+={r.randint(1, 9)};}}"


def write_data(directory: Path, lines: int, seed: int = 0) -> dict[str, list[str]]:
    """train.txt (`lines` lines, the domains shuffled together), val.txt, and each domain's held-out lines."""
    r = random.Random(seed)
    train_lines = [line(DOMAINS[i % len(DOMAINS)], r) for i in range(lines)]
    r.shuffle(train_lines)
    held = {d: [line(d, r) for _ in range(64)] for d in DOMAINS}
    (directory / "train.txt").write_text("\n".join(train_lines) + "\n")
    (directory / "val.txt").write_text("\n".join(t for d in DOMAINS for t in held[d]) + "\n")
    return held


def command(a: argparse.Namespace, data: Path, mode: str, seed: int) -> list[str]:
    model = ["model=hf_causal_lm", "+model.config.model_type=mixtral", f"+model.config.hidden_size={a.hidden}",
             f"+model.config.intermediate_size={2 * a.hidden}", f"+model.config.num_hidden_layers={a.layers}",
             "+model.config.num_attention_heads=4", "+model.config.num_key_value_heads=4",
             f"+model.config.num_local_experts={a.experts}", "+model.config.num_experts_per_tok=2",
             "+model.config.max_position_embeddings=128", "model.dropout=0"]
    return [*model, "data=text", f"data.train={data / 'train.txt'}", f"data.val={data / 'val.txt'}",
            "data.max_length=96", "loss=moe", f"loss.router_aux={mode}", f"loss.router_aux_coef={a.coef}",
            f"micro_batch={a.micro_batch}", f"global_batch={a.effective}", "optim=adamw", f"optim.lr={a.lr}",
            f"trainer.epochs={a.epochs}", f"trainer.device={a.device}", f"seed={seed}", "trainer.progress=false",
            *a.extra]


def trained(args: list[str], run_dir: Path) -> tuple[list[dict], list[dict]]:
    run_dir.mkdir(parents=True)
    accutrain.run(*args, run_dir=run_dir)
    records = [json.loads(text) for text in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "step"], [r for r in records if r.get("kind") == "eval"]


def routing_by_domain(run_dir: Path, held: dict[str, list[str]], device: str) -> torch.Tensor:
    """Top-k choices per (layer, domain, expert) of the run's last weights over each domain's held-out lines."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    model = hydra.utils.instantiate(cfg.model).to(device).eval()
    model.load_state_dict(torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"])
    tokenizer, counts = ByteTokenizer(), []
    for domain in DOMAINS:
        encoded = tokenizer(held[domain])["input_ids"]
        longest = max(map(len, encoded))
        ids = torch.tensor([e + [0] * (longest - len(e)) for e in encoded], device=device)
        mask = torch.tensor([[1] * len(e) + [0] * (longest - len(e)) for e in encoded], device=device)
        with torch.no_grad():
            _, aux = model(aux=("router_logits",), input_ids=ids, attention_mask=mask)
        counts.append(route(aux["router_logits"], model.routing.top_k, token_rows(dict(attention_mask=mask))).counts)
    return torch.stack(counts, 1).cpu()  # (L, D, E)


def specialisation(counts: torch.Tensor) -> dict[str, float]:
    """The held-out figures of one run from its (layer, domain, expert) counts, averaged over the layers."""
    p = counts / counts.sum((1, 2), keepdim=True)
    pd, pe = p.sum(2, keepdim=True), p.sum(1, keepdim=True)
    mi = (p * (p.clamp(min=1e-30) / (pd * pe)).log2()).nan_to_num().sum((1, 2))
    busiest, entropy = load(counts.sum(1))
    own = (counts.max(2).values / counts.sum(2)).mean(1)  # each domain's share on its busiest expert
    return dict(mi_bits=float(mi.mean()), load_max=float(busiest.mean()), entropy=float(entropy.mean()),
                domain_top_share=float(own.mean()))


def study(a: argparse.Namespace, root: Path) -> None:
    held = write_data(root, a.lines)
    rows: dict[str, list[dict]] = {"window": [], "micro_batch": []}
    for seed in a.seeds:
        for mode in (("window", "micro_batch") if seed % 2 == 0 else ("micro_batch", "window")):
            args = command(a, root, mode, seed)
            print("accutrain " + " ".join(shlex.quote(x) for x in args), file=sys.stderr)
            steps, evals = trained(args, root / f"{mode}-{seed}")
            figures = specialisation(routing_by_domain(root / f"{mode}-{seed}", held, a.device))
            rows[mode].append(dict(seed=seed, val_loss=evals[-1]["val_loss"], **figures))
            print(mode, rows[mode][-1], flush=True)
    print("\n| router_aux | held-out loss | load: busiest / mean | entropy (nats, max "
          f"{math.log(a.experts):.2f}) | MI(domain; expert) bits | domain's share on its busiest expert |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, runs in rows.items():
        cells = [f"{statistics.mean(r[k] for r in runs):.4f} ± {statistics.pstdev(r[k] for r in runs):.4f}"
                 for k in ("val_loss", "load_max", "entropy", "mi_bits", "domain_top_share")]
        print(f"| {mode} | " + " | ".join(cells) + " |")


def window_batches(held: dict[str, list[str]], micro: int, count: int, device: str) -> list[Batch]:
    """`count` micro-batches of `micro` lines (the domains mixed), padded per micro-batch, labels = input_ids."""
    lines = [t for group in zip(*held.values()) for t in group][: micro * count]
    collate = BatchFormat(PadCollate(dict(input_ids=0, attention_mask=0, labels=-100)), ("input_ids", "attention_mask"))
    encoded = ByteTokenizer()(lines)["input_ids"]
    items = [dict(input_ids=torch.tensor(e), attention_mask=torch.ones(len(e), dtype=torch.int64),
                  labels=torch.tensor(e)) for e in encoded]
    return [collate(items[i: i + micro]).to(torch.device(device)) for i in range(0, len(items), micro)]


def cost(a: argparse.Namespace, root: Path) -> None:
    """One window held in memory (no data loading), accumulated by each option in turn, `repeats` times: the median
    time per window, and on a GPU the peak memory of each."""
    from accutrain.core.losses.moe import moe
    from accutrain.core.losses.moe_window import count_window
    from accutrain.core.precision import make_precision
    from accutrain.models.hf import causal_lm

    device = torch.device(a.device)
    held = {d: [line(d, random.Random(i)) for i in range(a.effective)] for d in DOMAINS}
    torch.manual_seed(0)
    config = dict(model_type="mixtral", hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                  num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=4,
                  num_local_experts=a.experts, num_experts_per_tok=2, max_position_embeddings=128)
    model = causal_lm(259, config=config, dropout=0.0).to(device)
    precision = make_precision(a.precision, device)
    batches = window_batches(held, a.micro_batch, a.effective // a.micro_batch, a.device)
    losses = {mode: moe(mode, router_aux_coef=a.coef, model_defaults=causal_lm.loss_defaults)
              for mode in ("off", "micro_batch", "window")}
    for loss in losses.values():
        loss.check(model, batches[0], "cost")
    terms = losses["window"].terms(batches)
    modes = [*losses, "pass 1 alone"]
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    peak: dict[str, float] = {}
    for repeat in range(a.repeats + 1):  # the first round warms up
        for mode in (modes if repeat % 2 == 0 else list(reversed(modes))):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            if mode == "pass 1 alone":  # the counting pass without the accumulation
                count_window(losses["window"], model, batches, device, precision, 1)
            else:
                losses[mode].accumulate(model, batches, terms, device, precision=precision)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak[mode] = torch.cuda.max_memory_allocated() / 2**20
            if repeat:
                seconds[mode].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    base = statistics.median(seconds["micro_batch"])
    print(f"\n{a.effective // a.micro_batch} micro-batches of {a.micro_batch} lines, {terms} tokens counted, "
          f"{a.repeats} rounds alternated ({a.device}, precision {a.precision})")
    print("| loss.router_aux | ms per window (median) | vs micro_batch | peak memory (MiB) |\n|---|---:|---:|---:|")
    for mode, times in seconds.items():
        ms = 1000 * statistics.median(times)
        print(f"| {mode} | {ms:.1f} | {ms / 1000 / base:.2f}× | {f'{peak[mode]:.0f}' if peak else 'n/a (CPU)'} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("study", "cost"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--effective", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--precision", default="32", help="cost: trainer.precision's choices")
    parser.add_argument("--lines", type=int, default=1600)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--coef", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch's CPU threads")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides, as accutrain takes them")
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)  # a tiny model: more threads than free cores only wait on each other
    with tempfile.TemporaryDirectory() as tmp:
        (study if a.what == "study" else cost)(a, Path(tmp))


if __name__ == "__main__":
    main()
