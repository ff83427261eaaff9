"""The same LoRA fine-tune on accutrain, the Hugging Face Trainer with PEFT and TRL's SFTTrainer, sides alternated.

Every side reads the same generated chat records (a jsonl of messages, lengths heavy-tailed, none longer than
max_length) through the same byte tokenizer and chat template (the assistant's turns, each ended by <eos>, marked
for the loss by generation markers), trains the same randomly initialised Llama (built once from its config and
seed, saved, loaded by every side) with LoRA (r 16, alpha 32, no dropout, every linear layer of the blocks) and
AdamW (lr 2e-4, no weight decay, a constant rate, no warm-up), bf16 autocast on CUDA and float32 on the CPU, on the
same windows: global_batch records each, in the order accutrain's seed draws for epoch 0 (the peers read the records
in that order, sequentially). Each side runs at its micro-batch (`--micro side=a,b,…`: each value a row of its own,
the best marked); accutrain cuts by tokens (micro_tokens, `auto` on CUDA), with model.logits=chunked and
data.padding=free; TRL with padding_free where flash-attention is there for it (else padded: its padding-free rows
would attend across documents without it) and Liger Kernel on CUDA where installed (accutrain: model.kernels=liger).

Reported, the median over rounds: input tokens/s (real tokens, padding excluded, from the end of the warm-up steps to
the end of the last), peak memory (torch.cuda.max_memory_allocated; on the CPU with `--process-per-side`, where each
side's every run is a fresh process of this script running nothing else, that process's peak resident set — its
imports, model, data and allocator included, as a user's `top` would see it — and n/a without it, where the sides
share one process and its allocator: no figure there would be one side's own), model FLOPs utilisation =
tokens/s × (4 + 2·[activation checkpointing]) × N / peak FLOPs, N the base model's parameters less the input
embedding (a lookup; LoRA's own are negligible: frozen base, ≈ 2N forward + 2N backward for the activations'
gradients, no weight gradients, +2N to recompute the forward), and the first and last step's loss (the first step
is the same weights on the same window: equal on every side; the last drifts with each side's LoRA initialisation).
`--levers` adds accutrain with one speed lever at a time on top of a plain run (micro_batch, full logits, padded);
`--vision` compares resnet50 (224 px, bf16; channels_last and contiguous) with a hand-written accumulation loop.

    python scripts/compare_lm_peers.py --tiny                         # the CPU, seconds: the harness (tested)
    python scripts/compare_lm_peers.py --shape small --vocab 32000 --global-batch 8 --micro hf=2 \
        --micro accutrain=1024 --levers --only "accutrain micro_tokens" --only HF --only plain \
        --only "chunked logits" --process-per-side --rounds 5
                                                                      # the CPU: full logits' peak beside the Trainer's
    python scripts/compare_lm_peers.py --device cuda --shape 0.5b     # Qwen2-0.5B-like
    python scripts/compare_lm_peers.py --device cuda --shape 1.5b     # Qwen2-1.5B-like
    python scripts/compare_lm_peers.py --device cuda --shape 0.5b --levers
    python scripts/compare_lm_peers.py --device cuda --vision
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lm_finetune import WORDS, run_accutrain  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocab; then max_length, records, global_batch, steps
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=300, max_length=256, records=40,
                 global_batch=8, steps=3, warmup=1),
    "small": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=2048, max_length=512,
                  records=160, global_batch=16, steps=8, warmup=2),
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, max_length=2048,
                 records=64 * 14, global_batch=64, steps=14, warmup=4),
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, max_length=2048,
                 records=64 * 14, global_batch=64, steps=14, warmup=4),
}
MICRO = {"tiny": dict(accutrain="512", hf="4", trl="4"), "small": dict(accutrain="1024,2048", hf="4", trl="4,8"),
         "0.5b": dict(accutrain="auto", hf="4,8", trl="8,16"), "1.5b": dict(accutrain="auto", hf="2,4", trl="4,8")}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16, SXM
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] }}\n{{ eos_token }}{% endgeneration %}{% else %}"
            "{{ message['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LR, SEED = 2e-4, 0


def words(r: random.Random, chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(r.choice(WORDS))
    return " ".join(out)[:max(1, chars)]


def write_chats(path: Path, n: int, max_length: int, seed: int) -> None:
    """`n` conversations of 1–3 turns, their lengths heavy-tailed (Pareto), each rendering in ≤ max_length bytes."""
    r = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": "Be brief."}] if r.random() < 0.3 else []
            for _ in range(r.choice([1, 1, 2, 3])):
                user, answer = (min(max_length, int(scale * r.paretovariate(1.1))) for scale in (20, 12))
                messages += [{"role": "user", "content": words(r, user)},
                             {"role": "assistant", "content": words(r, answer)}]
            while rendered_length(messages) > max_length:  # shorten the longest message, else drop a turn
                longest = max(messages, key=lambda m: len(m["content"]))
                if len(longest["content"]) > 8:
                    longest["content"] = longest["content"][: len(longest["content"]) * 3 // 4]
                else:
                    messages = messages[:-2]
            f.write(json.dumps({"messages": messages}) + "\n")


def rendered_length(messages: list[dict]) -> int:
    """Tokens of the byte tokenizer's rendering under TEMPLATE (one per byte, one <eos> per assistant turn)."""
    return sum(len(f"<|{m['role']}|>\n{m['content']}\n".encode()) + (m["role"] == "assistant") for m in messages)


def lengths(work: Path) -> list[int]:
    """The records in the order accutrain's windows take them (written to ordered.jsonl for the peers, which read
    sequentially), and their rendered lengths."""
    from accutrain.core.windows import epoch_order

    lines = (work / "train.jsonl").read_text().splitlines()
    order = epoch_order(len(lines), SEED, 0).tolist()
    if not (work / "ordered.jsonl").exists():
        (work / "ordered.jsonl").write_text("".join(lines[i] + "\n" for i in order))
    return [rendered_length(json.loads(lines[i])["messages"]) for i in order]


def tokenizer() -> Any:
    from accutrain.data.tokenizer import fast_byte_tokenizer

    tok = fast_byte_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def base_model(args: argparse.Namespace, path: Path) -> int:
    """The random Llama, built from its config after seeding, saved for every side; its N for the FLOPs."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=args.max_length, pad_token_id=256, eos_token_id=257, bos_token_id=257,
        tie_word_embeddings=False)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


def peak_reset(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str) -> Optional[float]:
    """CUDA's peak since peak_reset; None on the CPU, where the sides share one process and its allocator keeps what
    an earlier side freed: no figure there would be one side's own."""
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def accutrain_side(args: argparse.Namespace, work: Path, micro: str, extra: tuple[str, ...] = ()) -> dict:
    """accutrain at `micro`: micro_tokens=<n|auto>, or micro_batch=<n> given as `b<n>`."""
    cut = [f"micro_batch={micro[1:]}"] if micro.startswith("b") else [f"micro_tokens={micro}", "data.padding=free"]
    overrides = ["model=hf_causal_lm", f"model.name_or_path={work / 'base'}", "model.dropout=0",
                 "model.adapter=lora", "model.lora.r=16", "model.lora.alpha=32", "model.lora.dropout=0",
                 f"model.lora.target_modules=[{','.join(TARGETS)}]", *(["model.kernels=liger"] * args.liger),
                 "data=hf", f"data.train={work / 'train.jsonl'}", f"data.val={work / 'val.jsonl'}",
                 f"data.chat_template={work / 'template.jinja'}", f"data.max_length={args.max_length}",
                 "optim=adamw", f"optim.lr={LR}", "optim.weight_decay=0", "sched=constant",
                 f"global_batch={args.global_batch}", *cut, f"seed={SEED}", f"trainer.max_steps={args.steps}",
                 "trainer.epochs=null", "trainer.eval_every=1000000", "trainer.progress=false",
                 f"trainer.device={args.device}", f"trainer.precision={'bf16-mixed' if args.bf16 else '32'}",
                 f"trainer.activation_checkpointing={str(args.checkpointing).lower()}", *args.overrides]
    replaced = {e.split("=")[0] for e in extra}
    overrides = [o for o in overrides if o.split("=")[0] not in replaced] + list(extra)
    peak_reset(args.device)
    steps = run_accutrain(overrides, work, "accutrain")
    timed = steps[args.warmup:]
    seconds = timed[-1]["time"] - steps[args.warmup - 1]["time"]
    return dict(tokens_s=sum(r["input_tokens"] for r in timed) / seconds, peak=peak_mib(args.device),
                first=steps[0]["loss"], last=steps[-1]["loss"], tokens=[r["input_tokens"] for r in steps])


def peer_side(args: argparse.Namespace, work: Path, micro: int, trl: bool) -> dict:
    """The Hugging Face Trainer (PEFT; a micro-batch padded to its longest) or TRL's SFTTrainer at `micro` records
    per micro-batch; a callback times the optimizer steps as accutrain's metrics do (end of step to end of step)."""
    import transformers
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model

    window_tokens = [sum(args.lengths[i] for i in range(k * args.global_batch, (k + 1) * args.global_batch))
                     for k in range(args.steps)]
    ends: list[float] = []
    losses: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

        def on_log(self, _a: Any, _s: Any, _c: Any, logs: Optional[dict] = None, **__: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    peak_reset(args.device)
    attn = "flash_attention_2" if args.flash else "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32,
                                                              attn_implementation=attn)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    common = dict(output_dir=str(work / "peer"), per_device_train_batch_size=micro,
                  gradient_accumulation_steps=args.global_batch // micro, max_steps=args.steps, learning_rate=LR,
                  weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                  adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, bf16=args.bf16, logging_steps=1,
                  save_strategy="no", report_to=[], seed=SEED, train_sampling_strategy="sequential",
                  dataloader_num_workers=0, use_cpu=args.device == "cpu", disable_tqdm=True,
                  activation_checkpointing=args.checkpointing,
                  activation_checkpointing_kwargs={"use_reentrant": False}, remove_unused_columns=not trl)
    data = load_dataset("json", data_files=str(work / "ordered.jsonl"), split="train")
    tok = tokenizer()
    if trl:
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, max_length=None if args.trl_padding_free else args.max_length,
                           assistant_only_loss=True, padding_free=args.trl_padding_free, packing=False,
                           use_liger_kernel=args.liger, dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tok, peft_config=lora,
                             callbacks=[Clock()])
    else:
        def encode(record: dict) -> dict:
            out = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids, mask = out["input_ids"], out["assistant_masks"]
            return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}

        torch.manual_seed(SEED)
        model = get_peft_model(model, lora)
        data = data.map(encode, remove_columns=data.column_names)
        collate = transformers.DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100)
        trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**common),
                                       train_dataset=data, data_collator=collate, callbacks=[Clock()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log lines: the table says it
    trainer.train()
    seconds = ends[-1] - ends[args.warmup - 1]
    out = dict(tokens_s=sum(window_tokens[args.warmup:]) / seconds, peak=peak_mib(args.device), first=losses[0],
               last=losses[-1], tokens=window_tokens)
    del trainer, model
    return out


def lm_sides(args: argparse.Namespace) -> dict[str, Callable[[Path], dict]]:
    """Each row's name and how to run it."""
    micro = args.micro_of
    trl_how = ("padding-free" if args.trl_padding_free else "padded") + (", Liger" if args.liger else "")
    sides: dict[str, Callable[[Path], dict]] = {}
    for m in micro["accutrain"].split(","):
        sides[f"accutrain micro_tokens={m}"] = lambda w, m=m: accutrain_side(args, w, m)
    for m in micro["hf"].split(","):
        sides[f"HF Trainer+PEFT micro_batch={m}"] = lambda w, m=int(m): peer_side(args, w, m, trl=False)
    for m in micro["trl"].split(","):
        sides[f"TRL SFTTrainer ({trl_how}) micro_batch={m}"] = lambda w, m=int(m): peer_side(args, w, m, trl=True)
    if args.levers:  # one lever at a time over a plain run: micro_batch, full logits, padded, eager, no Liger
        plain = (f"b{micro['hf'].split(',')[0]}", ("model.logits=full", "data.padding=longest", "model.kernels=null"))
        budget = micro["accutrain"].split(",")[0]
        budget = budget if budget != "auto" else str(args.max_length * int(micro["hf"].split(",")[0]))
        levers = {"plain (micro_batch, full logits, padded)": plain,
                  "+ chunked logits": (plain[0], ("data.padding=longest", "model.kernels=null")),
                  f"+ micro_tokens={budget}": (budget, plain[1]),
                  f"+ micro_tokens={budget}, padding-free": (budget, ("model.logits=full", "model.kernels=null")),
                  "+ micro_tokens=auto": ("auto", plain[1]),
                  "+ compile": (plain[0], (*plain[1], "trainer.compile=true"))}
        if args.liger:
            levers["+ Liger kernels"] = (plain[0], ("data.padding=longest",))
        if args.device != "cuda":
            del levers["+ micro_tokens=auto"]
        for name, (m, extra) in levers.items():
            sides[f"accutrain {name}"] = lambda w, m=m, extra=extra: accutrain_side(args, w, m, extra)
    return chosen(args, sides)


def chosen(args: argparse.Namespace, sides: dict[str, Callable[[Path], dict]]) -> dict[str, Callable[[Path], dict]]:
    """The sides --only keeps (all without it)."""
    kept = {k: v for k, v in sides.items() if not args.only or any(text in k for text in args.only)}
    if not kept:
        raise SystemExit(f"--only {' '.join(args.only)}: no side's name contains it; the sides: {', '.join(sides)}")
    return kept


def alternate(sides: dict[str, Callable[[Path], dict]], rounds: int, work: Path,
              argv: Optional[list[str]] = None) -> dict[str, list[dict]]:
    """Every side `rounds` times, the order reversed every other round; with `argv` (--process-per-side) each run in
    a fresh process of this script, whose peak is then its own (on the CPU: the child's peak resident set)."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(rounds):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            results[name].append(sides[name](work) if argv is None else in_a_process(argv, name, work))
    return results


def in_a_process(argv: list[str], side: str, work: Path) -> dict:
    """One side in a child process running nothing else: its result (the last line it prints), with the peak of the
    child's resident set (ru_maxrss, from wait4: this child's alone) where CUDA's allocator gives none."""
    import subprocess

    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--one-side", side, "--work", str(work)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{side}: its process exited with {child.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    if result["peak"] is None:
        result["peak"] = usage.ru_maxrss / 1024  # KiB on Linux
    return result


def lm_table(args: argparse.Namespace, results: dict[str, list[dict]], n: int) -> list[dict]:
    flops = (4 + 2 * args.checkpointing) * n
    rows = []
    for name, runs in results.items():
        tokens_s = statistics.median(r["tokens_s"] for r in runs)
        peaks = [r["peak"] for r in runs if r["peak"] is not None]
        rows.append(dict(side=name, tokens_s=tokens_s, peak=max(peaks) if peaks else None,
                         least=min(peaks) if peaks else None,
                         mfu=tokens_s * flops / (args.peak_tflops * 1e12) if args.peak_tflops else None,
                         first=runs[-1]["first"], last=runs[-1]["last"], tokens=runs[-1]["tokens"]))
    for family in ("accutrain micro_tokens", "HF Trainer", "TRL"):
        best = max((r for r in rows if r["side"].startswith(family)), key=lambda r: r["tokens_s"], default=None)
        if best is not None and sum(r["side"].startswith(family) for r in rows) > 1:
            best["side"] += " *"
    width = max(len(r["side"]) for r in rows) + 2
    peak_name = "peak RSS MiB" if args.device == "cpu" else "peak MiB"
    print(f"{'side':<{width}}{'input tokens/s':>15}{peak_name:>17}{'MFU':>8}{'first loss':>12}{'last loss':>12}")
    for r in rows:
        peak = "n/a" if r["peak"] is None else f"{r['peak']:,.0f}" if round(r["least"]) == round(r["peak"]) else \
            f"{r['least']:,.0f}–{r['peak']:,.0f}"  # the rounds' range
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{r['side']:<{width}}{r['tokens_s']:>15,.0f}{peak:>17}{mfu:>8}{r['first']:>12.6f}{r['last']:>12.6f}")
    if any(r["tokens"] != rows[0]["tokens"] for r in rows if not r["side"].startswith("accutrain +")):
        print("note: the sides' real tokens per window differ (not the same windows):",
              {r["side"]: r["tokens"] for r in rows})
    print(f"MFU = input tokens/s × {flops // n}·N / {args.peak_tflops or 'n/a'} TFLOPS, N = {n:,} base parameters "
          f"less the input embedding ({4}·N per token for a frozen base with LoRA"
          f"{', +2·N to recompute the forward (activation checkpointing)' if args.checkpointing else ''})")
    return rows


def vision_shape(args: argparse.Namespace) -> tuple[str, int, int, int, int, int]:
    """model, image size, micro-batch, accum, steps, warm-up steps."""
    return ("resnet18", 32, 4, 2, 10, 3) if args.tiny else ("resnet50", 224, args.vision_micro, 4, 24, 4)


def vision_sides(args: argparse.Namespace) -> dict[str, Callable[[Path], dict]]:
    """resnet50 (224 px; `--tiny`: resnet18 at 32 px) on accutrain's synthetic images: accutrain against a
    hand-written accumulation loop over the same data, model, micro-batch × accum, SGD and precision."""
    import torchvision

    from accutrain.data.datasets import synthetic

    name, size, micro, accum, steps, warmup = vision_shape(args)
    n = micro * accum * steps
    data = ["data=synthetic", f"data.size={n}", "data.val_size=8", f"data.image_size={size}", "data.num_classes=1000"]
    precision = "bf16-mixed" if args.bf16 else "32"

    def accutrain_run(channels_last: bool) -> Callable[[Path], dict]:
        def go(work: Path) -> dict:
            peak_reset(args.device)
            steps_ = run_accutrain([f"model={name}", "model.small_input=false",  # torchvision's stem, as by hand
                                    *data, f"micro_batch={micro}", f"accum={accum}", "optim=sgd",
                                    "sched=constant", f"trainer.max_steps={steps}", "trainer.epochs=null",
                                    "trainer.eval_every=1000000", "trainer.progress=false",
                                    f"trainer.device={args.device}", f"trainer.precision={precision}",
                                    f"trainer.channels_last={channels_last}", f"seed={SEED}", *args.overrides],
                                   work, "vision")
            return dict(images_s=micro * accum * (steps - warmup) / (steps_[-1]["time"] - steps_[warmup - 1]["time"]),
                        peak=peak_mib(args.device))
        return go

    def hand_loop(channels_last: bool) -> Callable[[Path], dict]:
        def go(_: Path) -> dict:
            peak_reset(args.device)
            torch.manual_seed(SEED)
            train = synthetic(n, 8, size, 1000, 3, 1.0, SEED).train
            loader = torch.utils.data.DataLoader(train, batch_size=micro, shuffle=True, drop_last=True,
                                                 num_workers=min(4, (os.cpu_count() or 2) - 1),
                                                 pin_memory=args.device == "cuda", persistent_workers=True)
            model = getattr(torchvision.models, name)(num_classes=1000).to(args.device)
            memory = torch.channels_last if channels_last else torch.contiguous_format
            model = model.to(memory_format=memory)
            decay = [p for p in model.parameters() if p.ndim > 1]
            rest = [p for p in model.parameters() if p.ndim <= 1]
            opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": rest, "weight_decay": 0.0}],
                                  lr=0.05, momentum=0.9)
            ends, it = [], iter(loader)
            for _step in range(steps):
                for _ in range(accum):
                    x, y = next(it)
                    x = x.to(args.device, non_blocking=True).to(memory_format=memory)
                    y = y.to(args.device, non_blocking=True)
                    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.bf16):
                        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / (micro * accum)
                    loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                ends.append(time.perf_counter())
            return dict(images_s=micro * accum * (steps - warmup) / (ends[-1] - ends[warmup - 1]),
                        peak=peak_mib(args.device))
        return go

    return chosen(args, {"accutrain, channels_last": accutrain_run(True), "hand loop, channels_last": hand_loop(True),
                         "accutrain, contiguous": accutrain_run(False), "hand loop, contiguous": hand_loop(False)})


def vision(args: argparse.Namespace, work: Path, child_argv: Optional[list[str]]) -> list[dict]:
    """The vision sides alternated; their table."""
    name, size, micro, accum, steps, warmup = vision_shape(args)
    dtype = "bf16" if args.bf16 else "float32"
    results = alternate(vision_sides(args), args.rounds, work, child_argv)
    print(f"{name} at {size} px, micro_batch {micro} × accum {accum}, {dtype}, SGD, {steps} steps ({warmup} "
          f"warm-up), {args.rounds} round(s)")
    rate = {side: statistics.median(r["images_s"] for r in runs) for side, runs in results.items()}
    rows = []
    print(f"{'side':<28}{'images/s':>10}{'× hand loop':>13}{'peak MiB':>10}   (× the hand loop of the same format)")
    for side, runs in results.items():
        hand = rate.get("hand loop, " + side.split(", ")[1], math.nan)
        peak = max((r["peak"] for r in runs if r["peak"] is not None), default=None)
        rows.append(dict(side=side, images_s=rate[side], vs_hand=rate[side] / hand, peak=peak))
        print(f"{side:<28}{rate[side]:>10,.1f}{rate[side] / hand:>13.3f}"
              f"{'n/a' if peak is None else f'{peak:,.0f}':>10}")
    return rows


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU, a few seconds a side (tested)")
    p.add_argument("--shape", default=None, choices=list(SHAPES), help="default: 0.5b on CUDA, small on the CPU")
    p.add_argument("--micro", action="append", default=[], metavar="SIDE=A,B",
                   help="accutrain=<micro_tokens|auto,…>, hf=<micro_batch,…>, trl=<micro_batch,…>: each a row")
    p.add_argument("--rounds", type=int, default=None, help="each side this many times, alternated (tiny 1, else 2)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (the shape's default)")
    p.add_argument("--checkpointing", choices=["on", "off"], default=None,
                   help="activation checkpointing on every side (default: on for CUDA, off on the CPU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak (default by its name)")
    p.add_argument("--levers", action="store_true", help="add accutrain with one speed lever at a time")
    p.add_argument("--vision", action="store_true", help="resnet50 against a hand-written loop instead")
    p.add_argument("--vision-micro", type=int, default=128)
    p.add_argument("--vocab", type=int, default=None, help="the model's vocabulary (the shape's default)")
    p.add_argument("--global-batch", type=int, default=None, help="records per optimizer step (the shape's default)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="keep the sides whose name contains TEXT (repeatable)")
    p.add_argument("--process-per-side", action="store_true",
                   help="each side's every run in a fresh process: its peak is its own (on the CPU: the process's "
                        "peak resident set)")
    p.add_argument("--one-side", default=None, help=argparse.SUPPRESS)  # a child of --process-per-side
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="more accutrain overrides for every accutrain run")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.shape = "cpu", "tiny"
    args.shape = args.shape or ("0.5b" if args.device == "cuda" else "small")
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rounds = args.rounds or (1 if args.tiny else 2)
    args.checkpointing = (args.checkpointing or ("on" if args.device == "cuda" else "off")) == "on"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--tiny runs on the CPU)")
    args.bf16 = args.device == "cuda"
    cuda = args.device == "cuda"
    args.liger = cuda and _importable("liger_kernel")
    args.flash = cuda and _importable("flash_attn")
    args.trl_padding_free = args.flash
    if any("=" not in m or m.split("=")[0] not in ("accutrain", "hf", "trl") for m in args.micro):
        p.error(f"--micro {' '.join(args.micro)}: expected accutrain=…, hf=… or trl=…, each a list of values")
    args.micro_of = micro = {**MICRO[args.shape], **dict(m.split("=", 1) for m in args.micro)}
    if args.device != "cuda" and "auto" in micro["accutrain"].split(","):
        p.error("--micro accutrain=auto: micro_tokens=auto needs trainer.memory_budget_mb on the CPU; give a number")
    for side in ("hf", "trl"):
        if not all(m.isdigit() and int(m) > 0 and args.global_batch % int(m) == 0 for m in micro[side].split(",")):
            p.error(f"--micro {side}={micro[side]}: each must be a positive divisor of the global batch "
                    f"{args.global_batch}")
    if args.peak_tflops is None and cuda:
        args.peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
    return args


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def main(argv: Optional[list[str]] = None) -> list[dict]:
    """Run the comparison `argv` asks for; print its table and command; return its rows."""
    args = parse(argv)
    logging.getLogger("accutrain").setLevel(logging.WARNING)
    for noisy in ("transformers", "trl", "peft", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    if args.one_side:  # a child of --process-per-side: one side, its result as the last line
        work = Path(args.work)
        if args.device == "cpu":  # accutrain restarts the kernel's peak RSS each window (its per-step figure), which
            from accutrain.train import memory  # would leave wait4 the last window's: kept whole, as the peers' is

            memory._PEAK_RSS.reset = lambda: False
            memory._PEAK_RSS.rusage_follows = False  # and no probe of the reset
        if not args.vision:
            args.lengths = lengths(work)
        result = (vision_sides(args) if args.vision else lm_sides(args))[args.one_side](work)
        print(json.dumps(result))
        return [result]
    # each side's process gets the same arguments (argv, or the command line's)
    child_argv = (sys.argv[1:] if argv is None else list(argv)) if args.process_per_side else None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.vision:
            rows = vision(args, work, child_argv)
        else:
            args.records = max(args.records, args.global_batch * args.steps)
            write_chats(work / "train.jsonl", args.records, args.max_length, seed=SEED)
            write_chats(work / "val.jsonl", 2, args.max_length, seed=SEED + 1)
            (work / "template.jinja").write_text(TEMPLATE)
            args.lengths = lengths(work)
            n = base_model(args, work / "base")
            results = alternate(lm_sides(args), args.rounds, work, child_argv)
            print(f"llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
                  f"intermediate {args.intermediate}, vocabulary {args.vocab} ({n:,} parameters less the input "
                  f"embedding); LoRA r=16 on {len(TARGETS)} projections, {'bf16' if args.bf16 else 'float32'}, "
                  f"activation checkpointing {'on' if args.checkpointing else 'off'}; {args.records} chat records "
                  f"(≤ {args.max_length} tokens, mean {statistics.mean(args.lengths):.0f}), global_batch "
                  f"{args.global_batch}, {args.steps} steps ({args.warmup} warm-up), {args.rounds} round(s), on "
                  f"{device}")
            rows = lm_table(args, results, n)
    print("command: python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None
                                                                               else argv)]))
    return rows


if __name__ == "__main__":
    main()
