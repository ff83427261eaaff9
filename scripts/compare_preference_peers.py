"""loss=dpo and loss=kto beside TRL's DPOTrainer and KTOTrainer: the first window's gradient of each side against a
float64 big batch written here, then tokens per second.

Every side trains the same tiny Llama (built once from its config and seed, float32, no dropout) with the same LoRA
(r 8, alpha 16, on q_proj and v_proj; its B matrices drawn from the seed so the policy is not yet its reference), on
the same plain-text records (a prompt and its completions; the byte tokenizer, an <eos> after each completion) and the
same first window of `--window` records in file order, the same reference (the policy as training starts: its
LoRA B is not zero, so that reference is not the base; TRL keeps it as a second adapter, accutrain here as a frozen
copy), cut into micro-batches of `--micro` (gradient accumulation
over window / micro of them). The float64 big batch: the papers' formulas over the whole window (DPO: −log σ(β h)
averaged over the pairs; KTO: λ (1 − σ(β (±(r − z0)))) averaged, z0 = max(0, the mean over the window's mismatched
pairs of log π/π_ref)), the log-probabilities summed over each side's own completion tokens, in a float64 copy of
the model. KTO's mismatched pairs are each side's: accutrain's are drawn from the seed within the window, TRL's
cycle the completions within each micro-batch — so each side's reference is the big batch of its own pairing.

Reported per side: the relative difference ‖g − g64‖/‖g64‖ of the accumulated first-step LoRA gradient from the
float64 big batch, and from the same side's gradient with the window in one micro-batch (what accumulation alone
changes); the tokens (real, both sequences of a pair, the mismatched ones not counted) per second over `--steps`
optimizer steps of AdamW (lr 1e-4). Peak memory is not reported on the CPU (both sides share one process and its
allocator).

    python scripts/compare_preference_peers.py --tiny       # the CPU, about a minute
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from accutrain.core.batches import BatchFormat  # noqa: E402
from accutrain.core.losses.dpo import dpo  # noqa: E402
from accutrain.core.losses.kto import kto  # noqa: E402
from accutrain.data.tokenizer import fast_byte_tokenizer  # noqa: E402
from accutrain.models.hf import HFCausalLM  # noqa: E402

WORDS = "the cat sat on a mat and dog ran far away big small red blue fox owl hen tree barn".split()
SEED, BETA = 0, 0.5


def records(n: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    r = random.Random(seed)
    phrase = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    pairs = [{"prompt": phrase(2, 6), "chosen": " " + phrase(2, 12), "rejected": " " + phrase(2, 12) + " no"}
             for _ in range(n)]
    feedback = [{"prompt": p["prompt"], "completion": p["chosen"] if i % 3 else p["rejected"], "label": bool(i % 3)}
                for i, p in enumerate(pairs)]
    return pairs, feedback


def policy(seed: int = SEED):
    import peft
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   pad_token_id=256, eos_token_id=257, bos_token_id=None)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def lora_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for n, p in model.named_parameters() if p.requires_grad])


def logp64(model, prompt: list[int], completion: list[int], ref: bool) -> torch.Tensor:
    """Σ log p(completion | prompt) under `model` (float64), or (`ref`) under its frozen initial copy `model.initial`
    — the reference policy: the policy as training starts (TRL keeps it as a second adapter, "ref"; accutrain, with
    a fresh adapter whose B is 0, as the base with the adapter disabled; here, with B drawn, as a frozen copy)."""
    ids = torch.tensor(prompt + completion)[None]
    if ref:
        with torch.no_grad():
            logits = model.initial(input_ids=ids).logits.double()[0]
    else:
        logits = model(input_ids=ids).logits.double()[0]
    logprobs = logits[:-1].log_softmax(-1)
    target = ids[0, 1:]
    return logprobs[torch.arange(len(target)), target][len(prompt) - 1:].sum()


def as64(base):
    model = copy.deepcopy(base).double()
    object.__setattr__(model, "initial", copy.deepcopy(model).requires_grad_(False))  # not a submodule
    return model


def dpo64(base, window: list[tuple[list, list, list]]) -> torch.Tensor:
    model = as64(base)
    losses = []
    for prompt, chosen, rejected in window:
        h = (logp64(model, prompt, chosen, False) - logp64(model, prompt, chosen, True)) - (
            logp64(model, prompt, rejected, False) - logp64(model, prompt, rejected, True))
        losses.append(-F.logsigmoid(BETA * h))
    torch.stack(losses).mean().backward()
    return lora_grads(model)


def kto64(base, window: list[tuple[list, list, bool]], mismatched: list[list[int]], groups: list[range]
          ) -> torch.Tensor:
    """Sample i's mismatched pair is (its prompt, mismatched[i]); z0 is taken over each group of samples (one group:
    the window; several: each micro-batch's own)."""
    model = as64(base)
    z0 = {}
    for group in groups:
        with torch.no_grad():
            kl = torch.stack([logp64(model, window[i][0], mismatched[i], False)
                              - logp64(model, window[i][0], mismatched[i], True) for i in group]).mean()
        z0.update({i: kl.clamp(min=0) for i in group})
    losses = []
    for i, (prompt, completion, good) in enumerate(window):
        r = logp64(model, prompt, completion, False) - logp64(model, prompt, completion, True)
        losses.append(1 - torch.sigmoid(BETA * (r - z0[i])) if good else 1 - torch.sigmoid(BETA * (z0[i] - r)))
    torch.stack(losses).mean().backward()
    return lora_grads(model)


def relative(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g - ref).norm() / ref.norm())


def accutrain_side(kind: str, path: Path, base, args) -> tuple[float, float, torch.Tensor]:
    items, collate = full_items(path)
    fmt = BatchFormat(collate)
    model = HFCausalLM(copy.deepcopy(base))
    loss = dpo(beta=BETA) if kind == "dpo" else kto(beta=BETA, seed=SEED)
    loss.attach(model)
    loss.ref.adapter, loss.ref.copy = None, copy.deepcopy(model).requires_grad_(False).eval()  # the initial policy
    window = items[: args.window]
    batches = [fmt(window[k:k + args.micro]) for k in range(0, len(window), args.micro)]
    loss.accumulate(model, batches, len(window), torch.device("cpu"))
    grads = lora_grads(model.model)
    if kind == "dpo":
        seqs = [(it["chosen.input_ids"][:prompt_len(it)].tolist(), it["chosen.input_ids"][prompt_len(it):].tolist(),
                 it["rejected.input_ids"][prompt_len(it):].tolist()) for it in window]
        reference = dpo64(base, seqs)
    else:  # the window's mismatched pairs, drawn from the seed (core/losses/kto_point.py)
        seqs = [(it["input_ids"][: int(it["prompt.length"])].tolist(),
                 it["input_ids"][int(it["prompt.length"]):].tolist(), bool(it["desirable"])) for it in window]
        key = lambda i: hashlib.blake2b(f"{SEED}:{int(window[i]['labels'])}".encode(), digest_size=8).digest()  # noqa
        order = sorted(range(len(window)), key=key)
        mismatched = [None] * len(window)
        for k, i in enumerate(order):
            mismatched[i] = seqs[order[(k + 1) % len(order)]][1]
        reference = kto64(base, seqs, mismatched, [range(len(window))])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0)
    tokens, start = 0, time.perf_counter()
    for step in range(args.steps):
        chunk = items[step * args.window:(step + 1) * args.window]
        optimizer.zero_grad(set_to_none=True)
        loss.accumulate(model, [fmt(chunk[k:k + args.micro]) for k in range(0, len(chunk), args.micro)], len(chunk),
                        torch.device("cpu"))
        optimizer.step()
        tokens += sum(int(v.numel()) for it in chunk for k, v in it.items() if k.endswith("input_ids"))
    return relative(grads, reference), tokens / (time.perf_counter() - start), grads


def prompt_len(item: dict) -> int:
    return int((item["chosen.labels"] == -100).sum())


def full_items(path: Path) -> tuple[list[dict], object]:
    """Every record as an item, in file order (data.val the same file: the training split is not held out from)."""
    from accutrain.data.preference import PreferenceFields, preference_kind
    from accutrain.data.preference_items import text_preference
    from accutrain.data.records import Tally
    from accutrain.data.text import read_records

    rows = read_records(str(path), "data.train")
    tally = Tally("data.train", str(path), read=len(rows))
    names = PreferenceFields()
    datasets = text_preference([(rows, list(range(len(rows))), tally)] * 2, preference_kind(list(rows[0]), names),
                               names, "bytes", 512, False, "longest", -100, "drop", str(path))
    return [datasets.train[i] for i in range(len(datasets.train))], datasets.collate


def trl_side(kind: str, records_: list[dict], base, args, tmp: Path) -> tuple[float, float, torch.Tensor]:
    import datasets
    import transformers
    import trl

    tok = fast_byte_tokenizer()
    captured: dict = {}

    class Capture(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, a, state, control, model=None, **kw):
            if "g" not in captured:
                captured["g"] = lora_grads(model)

    Config, Trainer = (trl.DPOConfig, trl.DPOTrainer) if kind == "dpo" else (trl.KTOConfig, trl.KTOTrainer)

    class Sequential(Trainer):
        def _get_train_sampler(self, *a, **kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    config = Config(output_dir=str(tmp / f"trl-{kind}"), per_device_train_batch_size=args.micro,
                    gradient_accumulation_steps=args.window // args.micro, learning_rate=1e-4, max_steps=args.steps,
                    beta=BETA, max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                    logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True, seed=SEED,
                    dataloader_drop_last=False, remove_unused_columns=False, max_length=512)
    model = copy.deepcopy(base)
    trainer = Sequential(model=model, args=config, train_dataset=datasets.Dataset.from_list(records_),
                         processing_class=tok, callbacks=[Capture()])
    table = trainer.train_dataset
    window = [table[i] for i in range(args.window)]
    if kind == "dpo":
        reference = dpo64(base, [(w["prompt_ids"], w["chosen_ids"], w["rejected_ids"]) for w in window])
        tokens = sum(2 * len(w["prompt_ids"]) + len(w["chosen_ids"]) + len(w["rejected_ids"]) for w in table)
    else:  # TRL rotates the completions within each micro-batch (its KL_completion_ids)
        seqs = [(w["prompt_ids"], w["completion_ids"], bool(w["label"])) for w in window]
        groups = [range(k, min(k + args.micro, args.window)) for k in range(0, args.window, args.micro)]
        reference = kto64(base, seqs, [w["KL_completion_ids"] for w in window], groups)
        tokens = sum(len(w["prompt_ids"]) + len(w["completion_ids"]) for w in table)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    per_step = tokens * min(1.0, args.steps * args.window / len(table))
    return relative(captured["g"], reference), per_step / seconds, captured["g"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the CPU sizes (the only ones so far)")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--records", type=int, default=24)
    args = parser.parse_args(argv)
    print(f"$ python scripts/compare_preference_peers.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    logging.disable(logging.WARNING)  # the two trainers' logs; switched back on below
    try:
        torch.set_num_threads(1)
        pairs, feedback = records(args.records)
        base = policy()
        rows = []
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for kind, recs in (("dpo", pairs), ("kto", feedback)):
                path = tmp / f"{kind}.jsonl"
                path.write_text("".join(json.dumps(r) + "\n" for r in recs))
                one = argparse.Namespace(**{**vars(args), "micro": args.window})  # the window as one micro-batch
                for side, run in (("accutrain", lambda a: accutrain_side(kind, path, base, a)),
                                  ("TRL", lambda a: trl_side(kind, recs, base, a, tmp))):
                    diff, speed, grads = run(args)
                    whole = run(one)[2]
                    rows.append((kind, side, diff, relative(grads, whole), speed))
    finally:
        logging.disable(logging.NOTSET)
    print(f"window {args.window} = micro_batch {args.micro} × accum {args.window // args.micro}, "
          f"{args.steps} steps, tiny Llama + LoRA, float32, CPU (1 thread)")
    print("| loss | side | first-step gradient vs the float64 big batch | vs its own micro_batch=window step | "
          "tokens/s |")
    print("|---|---|---|---|---|")
    for kind, side, diff, split, speed in rows:
        print(f"| {kind} | {side} | {diff:.2e} | {split:.2e} | {speed:,.0f} |")


if __name__ == "__main__":
    main()
