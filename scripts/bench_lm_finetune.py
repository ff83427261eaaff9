"""LoRA fine-tuning of a randomly initialised causal LM: micro-batches of a fixed sample count (padded to their
longest) against micro_tokens (the same windows cut by a token budget), in one process, sides alternated.

The model is built through accutrain's own config (`model=hf_causal_lm +model.config.model_type=llama` and its
shape; default ≈ 0.5B parameters, Qwen2-0.5B-like: hidden 896, 24 layers, 14 heads, 2 key/value heads,
intermediate 4864, vocabulary 32000), with model.adapter=lora, trainer.precision=bf16-mixed and
trainer.activation_checkpointing=true, on generated text lines of very different lengths (byte tokenizer; the
vocabulary stays the model's). Both sides take the same windows (global_batch samples): `micro_batch=N` pads each
micro-batch of N samples to its longest; `micro_tokens=N × max_length` has the same worst-case micro-batch size, but
sorts each window by length and fills micro-batches up to the budget. Reported per side: input tokens/s (real
tokens, padding excluded; the median over rounds, after the warm-up steps), the padding fraction, the peak GPU
memory (torch.cuda.max_memory_allocated; on the CPU the per-step peak accutrain records), and the last loss (the
same windows: equal to bf16 rounding). `--quantize 4bit` adds QLoRA (bitsandbytes; the random model saved and
loaded back in 4-bit NF4), reported as not installed where bitsandbytes is absent.

    python scripts/bench_lm_finetune.py --device cuda                 # ≈ 0.5B, a few minutes on one GPU
    python scripts/bench_lm_finetune.py --device cuda --quantize 4bit # + QLoRA
    python scripts/bench_lm_finetune.py --tiny                        # a tiny shape on the CPU, in seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import accutrain

WORDS = "the of and to in is was for on that with as by at from his her an are were which this be or had".split()


def write_lines(path: Path, n: int, max_chars: int, seed: int) -> None:
    """`n` lines of heavy-tailed lengths (most short, a few up to max_chars): what chat data looks like."""
    r = random.Random(seed)
    lines = []
    for _ in range(n):
        chars = min(max_chars, int(24 * r.paretovariate(1.1)))
        words = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(r.choice(WORDS))
        lines.append(" ".join(words)[:chars])
    path.write_text("\n".join(lines) + "\n")


def shape(args: argparse.Namespace) -> list[str]:
    """The model's config overrides, as typed on accutrain's command line."""
    return ["model=hf_causal_lm", f"+model.config.model_type={args.model_type}",
            f"+model.config.hidden_size={args.hidden}", f"+model.config.num_hidden_layers={args.layers}",
            f"+model.config.num_attention_heads={args.heads}", f"+model.config.num_key_value_heads={args.kv_heads}",
            f"+model.config.intermediate_size={args.intermediate}", f"+model.config.vocab_size={args.vocab}",
            f"+model.config.max_position_embeddings={args.max_length}", "model.dropout=0"]


def common(args: argparse.Namespace, work: Path) -> list[str]:
    return ["model.adapter=lora", f"model.lora.r={args.lora_r}", "data=text", f"data.train={work / 'train.txt'}",
            f"data.val={work / 'val.txt'}", f"data.max_length={args.max_length}", "optim=adamw", "optim.lr=2e-4",
            f"global_batch={args.global_batch}", f"trainer.max_steps={args.steps}", "trainer.epochs=null",
            "trainer.eval_every=1000000", "trainer.progress=false", f"trainer.device={args.device}",
            f"trainer.precision={args.precision}", "trainer.activation_checkpointing=true", *args.overrides]


def run_accutrain(overrides: list[str], work: Path, name: str) -> list[dict]:
    """One in-process accutrain run in a new directory under `work`: its optimizer steps' records (metrics.jsonl)."""

    run_dir = work / f"{name}-{time.monotonic_ns()}"
    run_dir.mkdir()
    accutrain.run(*overrides, run_dir=run_dir)
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def run(overrides: list[str], work: Path, name: str, args: argparse.Namespace) -> dict:
    """One in-process accutrain run: its figures from metrics.jsonl (and CUDA's peak)."""
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    steps = run_accutrain(overrides, work, name)
    timed = steps[args.warmup:] or steps
    seconds = sum(r["input_tokens"] / r["input_tokens_per_s"] for r in timed)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else max(r["peak_mem_mb"] for r in steps)
    return dict(tokens_s=sum(r["input_tokens"] for r in timed) / seconds,
                pad=1 - sum(r["input_tokens"] for r in timed) / sum(r["input_tokens"] / (1 - r["pad_fraction"])
                                                                     for r in timed),
                peak=peak, loss=steps[-1]["loss"], micro_batches=statistics.mean(r["micro_batches"] for r in timed))


def qlora_base(args: argparse.Namespace, work: Path) -> Path:
    """The random model saved as a pretrained one, for model.quantize=4bit to load in 4-bit."""
    import transformers

    config = transformers.AutoConfig.for_model(
        args.model_type, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.max_length, pad_token_id=256, eos_token_id=257, bos_token_id=257)
    torch.manual_seed(0)
    path = work / "base"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (seconds): checks the script")
    p.add_argument("--model-type", default="llama")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of tokens/s")
    p.add_argument("--rounds", type=int, default=2, help="each side this many times, in alternating order")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--quantize", choices=["4bit"], default=None, help="add a QLoRA side (bitsandbytes, CUDA)")
    p.add_argument("overrides", nargs="*", help="more accutrain overrides for every run")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.hidden, args.layers, args.heads, args.kv_heads = "cpu", 64, 2, 4, 2
        args.intermediate, args.vocab, args.max_length, args.global_batch = 128, 512, 96, 8
        args.steps, args.warmup, args.rounds, args.lora_r = 3, 1, 1, 4
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--tiny runs on the CPU)")
    import logging
    logging.getLogger("accutrain").setLevel(logging.WARNING)

    budget = args.micro_batch * args.max_length
    sides = {f"micro_batch={args.micro_batch}": [f"micro_batch={args.micro_batch}"],
             f"micro_tokens={budget}": [f"micro_tokens={budget}"]}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_lines(work / "train.txt", args.global_batch * args.steps, 4 * args.max_length, seed=0)
        write_lines(work / "val.txt", 4, args.max_length, seed=1)
        base = [*shape(args), *common(args, work)]
        for round_ in range(args.rounds):
            for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
                results[name].append(run([*base, *sides[name]], work, name.split("=")[0], args))
        qlora = None
        if args.quantize:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                qlora = "not installed (pip install bitsandbytes)"
            else:
                if args.device != "cuda":
                    qlora = "needs a CUDA device"
                else:
                    path = qlora_base(args, work)
                    quantized = [a for a in base if not a.startswith("+model.config.")] + [
                        f"model.name_or_path={path}", "model.quantize=4bit", f"micro_tokens={budget}"]
                    qlora = run(quantized, work, "qlora", args)

    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    params = f"{args.model_type} hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), " \
             f"intermediate {args.intermediate}, vocabulary {args.vocab}"
    print(f"{params}; LoRA r={args.lora_r}, {args.precision}, activation checkpointing; global_batch "
          f"{args.global_batch}, max_length {args.max_length}, {args.steps} steps ({args.warmup} warm-up), "
          f"{args.rounds} round(s), on {device}")
    print(f"{'split':<22}{'input tokens/s':>16}{'pad fraction':>14}{'peak MiB':>11}{'micro-batches':>15}"
          f"{'last loss':>14}")
    for name, rows in results.items():
        print(f"{name:<22}{statistics.median(r['tokens_s'] for r in rows):>16,.0f}"
              f"{statistics.mean(r['pad'] for r in rows):>14.3f}{max(r['peak'] for r in rows):>11,.0f}"
              f"{statistics.mean(r['micro_batches'] for r in rows):>15.1f}{rows[-1]['loss']:>14.6f}")
    if args.quantize:
        if isinstance(qlora, dict):
            print(f"{'QLoRA 4bit + tokens':<22}{qlora['tokens_s']:>16,.0f}{qlora['pad']:>14.3f}{qlora['peak']:>11,.0f}"
                  f"{qlora['micro_batches']:>15.1f}{qlora['loss']:>14.6f}")
        else:
            print(f"QLoRA (model.quantize=4bit): {qlora}")
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))


if __name__ == "__main__":
    main()
