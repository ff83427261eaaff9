"""loss=dpo (each kind, nll_coef), loss=orpo and loss=kto, exactly: the weights after windows split micro_batch=2 ×
accum=4 (KTO: 1 × 8 too) equal micro_batch=8's, and a window's loss and gradient equal a hand-written float64
implementation of the papers' formulas over the whole window (the RPO NLL over the window's chosen tokens, KTO's
reference point over the window's mismatched pairs). A tiny random Llama built from a config, LoRA (the reference: its
base with the adapter disabled), the byte tokenizer, float32, no dropout, SGD."""
import copy
import hashlib
import json
import random

import pytest
import torch
import torch.nn.functional as F

from accutrain.core.batches import BatchFormat
from accutrain.core.losses.dpo import dpo, orpo
from accutrain.core.losses.kto import kto
from accutrain.data.text import text_data

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORDS = "the cat sat on a mat and dog ran far away big small red blue".split()
SEED = 7


def phrase(r, lo, hi):
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """19 pairs and 19 feedback records (windows of 8, 8 and an uneven 3), plain and conversational."""
    d, r = tmp_path_factory.mktemp("preference"), random.Random(0)
    pairs, feedback = [], []
    for i in range(19):
        prompt, chosen, rejected = phrase(r, 1, 4), " " + phrase(r, 1, 6), " " + phrase(r, 2, 7)
        if i % 5 == 4:  # conversational: rendered with the chat template
            pairs.append({"prompt": [{"role": "user", "content": prompt}],
                          "chosen": [{"role": "assistant", "content": chosen.strip()}],
                          "rejected": [{"role": "assistant", "content": rejected.strip() + " no"}]})
        else:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected + " no"})
        feedback.append({"prompt": prompt, "completion": chosen, "label": i % 3 != 0})
    for name, records in (("pairs", pairs), ("feedback", feedback)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    return d


def data_of(path):
    return text_data(str(path), str(path), 0.1, "bytes", 64, False, "longest", "text", "prompt", "response", "label",
                     0)


def tiny_lora(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=160)
    from accutrain.models.hf import HFCausalLM

    base = transformers.LlamaForCausalLM(cfg)
    model = HFCausalLM(peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                  target_modules=["q_proj", "v_proj"])))
    with torch.no_grad():  # B = 0 would make the policy the reference: move it off
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def trained(model):
    return [p for p in model.parameters() if p.requires_grad]


def train(make_loss, data, micro, steps=3, window=8, lr=0.5, model=None):
    """SGD over windows of `window` samples in order (the last uneven), micro-batches of `micro`."""
    model = model or tiny_lora()
    loss = make_loss()
    loss.attach(model)
    fmt = BatchFormat(data.collate)
    n = len(data.train)
    for start in range(0, min(n, steps * window), window):
        indices = list(range(start, min(start + window, n)))
        batches = [fmt([data.train[i] for i in indices[k:k + micro]]) for k in range(0, len(indices), micro)]
        model.zero_grad(set_to_none=True)
        loss.accumulate(model, batches, len(indices), torch.device("cpu"))
        with torch.no_grad():
            for p in trained(model):
                p -= lr * p.grad
    return model, loss


def distance(a, b):
    return max((x - y).abs().max().item() for x, y in zip(trained(a), trained(b)))


DPO_VARIANTS = {"sigmoid": dict(kind="sigmoid"), "ipo": dict(kind="ipo"), "hinge": dict(kind="hinge", beta=2.0),
                "simpo": dict(kind="simpo", beta=2.0), "rpo": dict(kind="sigmoid", nll_coef=0.7)}


@pytest.mark.parametrize("variant", list(DPO_VARIANTS))
def test_dpo_accumulated_equals_the_big_batch(files, variant):
    data = data_of(files / "pairs.jsonl")
    make = lambda: dpo(**DPO_VARIANTS[variant])
    split, _ = train(make, data, micro=2)
    whole, _ = train(make, data, micro=8)
    assert distance(split, tiny_lora()) > 1e-3  # the steps moved the weights
    assert distance(split, whole) < 1e-5


def test_orpo_accumulated_equals_the_big_batch(files):
    data = data_of(files / "pairs.jsonl")
    split, _ = train(lambda: orpo(beta=0.5), data, micro=2)
    whole, _ = train(lambda: orpo(beta=0.5), data, micro=8)
    assert distance(split, whole) < 1e-5


@pytest.mark.parametrize("micro", [2, 1])
def test_kto_accumulated_equals_the_big_batch_micro_batch_one_included(files, micro):
    data = data_of(files / "feedback.jsonl")
    make = lambda: kto(beta=0.5, desirable_weight=1.0, undesirable_weight=1.33, seed=SEED)
    split, loss = train(make, data, micro=micro)
    whole, _ = train(make, data, micro=8)
    assert float(loss.figures()["kl"]) > 0  # the reference point is in play
    assert distance(split, whole) < 1e-5


def test_kto_reference_point_per_micro_batch_is_not_the_big_batch(files):
    data = data_of(files / "feedback.jsonl")
    make = lambda: kto(beta=2.0, reference_point="micro_batch", seed=SEED)
    split, _ = train(make, data, micro=2, lr=2.0)
    whole, _ = train(make, data, micro=8, lr=2.0)
    assert distance(split, whole) > 1e-4


# --- the papers' formulas, by hand, in float64, over one whole window -----------------------------------------------
def logp64(model, ids, labels):
    """Σ log p of the completion tokens of one unpadded sequence under a float64 model."""
    logits = model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None]).double()[0]  # (V, L)
    logprobs = logits.log_softmax(0)
    return sum(logprobs[labels[t], t - 1] for t in range(1, len(ids)) if labels[t] != -100)


def window_items(data, n=8):
    return [data.train[i] for i in range(n)]


def as64(model):
    copy64 = copy.deepcopy(model).double()
    for p in copy64.parameters():
        p.grad = None
    return copy64


def reference64(model64, ids, labels):
    with torch.no_grad(), model64.model.disable_adapter():
        return logp64(model64, ids, labels)


def accumulated_grads(make_loss, data, micro, items):
    model = tiny_lora()
    loss = make_loss()
    loss.attach(model)
    fmt = BatchFormat(data.collate)
    batches = [fmt(items[k:k + micro]) for k in range(0, len(items), micro)]
    total = loss.accumulate(model, batches, len(items), torch.device("cpu"))
    return float(total) / len(items), [p.grad.double() for p in trained(model)]


def dpo64(items, beta, nll_coef, per_micro_batch=None):
    model = as64(tiny_lora())
    terms, chosen_nll, chosen_tokens = [], [], 0
    for it in items:
        c_ids, c_lab = it["chosen.input_ids"], it["chosen.labels"]
        r_ids, r_lab = it["rejected.input_ids"], it["rejected.labels"]
        pc, pr = logp64(model, c_ids, c_lab), logp64(model, r_ids, r_lab)
        h = (pc - reference64(model, c_ids, c_lab)) - (pr - reference64(model, r_ids, r_lab))
        terms.append(-F.logsigmoid(beta * h))
        chosen_nll.append(-pc)
        chosen_tokens += int((c_lab[1:] != -100).sum())
    loss = sum(terms) / len(items)
    if per_micro_batch is None:
        loss = loss + nll_coef * sum(chosen_nll) / chosen_tokens  # the window's chosen tokens
    else:  # each micro-batch's NLL over its own tokens, averaged (what a per-micro-batch RPO does)
        parts = []
        for k in range(0, len(items), per_micro_batch):
            tokens = sum(int((it["chosen.labels"][1:] != -100).sum()) for it in items[k:k + per_micro_batch])
            parts.append(sum(chosen_nll[k:k + per_micro_batch]) / tokens)
        loss = loss + nll_coef * sum(parts) / len(parts)
    grads = torch.autograd.grad(loss, trained(model))
    return float(loss), list(grads)


def close(a, b, tol):
    return max((x - y).abs().max().item() for x, y in zip(a, b)) < tol


def test_dpo_with_nll_is_the_float64_formula_over_the_window(files):
    data = data_of(files / "pairs.jsonl")
    items = window_items(data)
    value, grads = accumulated_grads(lambda: dpo(kind="sigmoid", beta=0.5, nll_coef=0.7), data, 2, items)
    value64, grads64 = dpo64(items, 0.5, 0.7)
    assert abs(value - value64) < 1e-5 and close(grads, grads64, 1e-6)
    _, per_micro = dpo64(items, 0.5, 0.7, per_micro_batch=2)
    assert not close(per_micro, grads64, 1e-4)  # the test tells the window's NLL from a micro-batch's


def order(seed, index):
    return hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()


def kto64(items, beta, wd, wu, point_per=None):
    model = as64(tiny_lora())
    parts = []
    for it in items:
        k, n = int(it["prompt.length"]), len(it["input_ids"])
        parts.append((int(it["labels"]), it["input_ids"][:k], it["input_ids"][k:n], bool(it["desirable"])))

    def ratio(prompt, completion, grad):
        ids = torch.cat([prompt, completion])
        labels = torch.cat([torch.full((len(prompt),), -100), completion])
        with torch.set_grad_enabled(grad):
            return logp64(model, ids, labels) - reference64(model, ids, labels)

    def z0(group):
        ranked = sorted(group, key=lambda s: order(SEED, s[0]))
        kls = [ratio(s[1], ranked[(j + 1) % len(ranked)][2], False) for j, s in enumerate(ranked)]
        return max(0.0, float(sum(kls) / len(kls)))

    groups = [parts] if point_per is None else [parts[k:k + point_per] for k in range(0, len(parts), point_per)]
    total = 0
    for group in groups:
        z = z0(group)
        for _, prompt, completion, good in group:
            r = ratio(prompt, completion, True)
            total = total + (wd * (1 - torch.sigmoid(beta * (r - z))) if good else
                             wu * (1 - torch.sigmoid(beta * (z - r))))
    loss = total / len(parts)
    return float(loss), list(torch.autograd.grad(loss, trained(model)))


def test_kto_is_the_float64_formula_with_the_reference_point_over_the_window(files):
    data = data_of(files / "feedback.jsonl")
    items = window_items(data)
    make = lambda: kto(beta=0.5, desirable_weight=1.0, undesirable_weight=1.33, seed=SEED)
    value, grads = accumulated_grads(make, data, 2, items)
    value64, grads64 = kto64(items, 0.5, 1.0, 1.33)
    assert abs(value - value64) < 1e-6 and close(grads, grads64, 1e-6)
    value_mb, per_micro = kto64(items, 0.5, 1.0, 1.33, point_per=4)
    assert abs(value_mb - value64) > 1e-4 or not close(per_micro, grads64, 1e-4)  # z0 per group tells apart


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_the_chunked_head_takes_the_full_logits_gradient(files, kind):
    """model.logits=chunked (the default): the hidden states and the head, the log-probabilities a chunk at a time;
    the surrogate's backward through the chunked cross-entropy is the full logits' gradient."""
    data = data_of(files / ("pairs.jsonl" if kind == "dpo" else "feedback.jsonl"))
    make = (lambda: dpo(beta=0.5, nll_coef=0.7)) if kind == "dpo" else (lambda: kto(beta=0.5, seed=SEED))
    items, fmt, grads = window_items(data), BatchFormat(data.collate), []
    for logits in ("full", "chunked"):
        model = tiny_lora()
        model.logits = logits
        loss = make()
        loss.attach(model)
        loss.accumulate(model, [fmt(items[k:k + 2]) for k in range(0, 8, 2)], 8, torch.device("cpu"))
        grads.append([p.grad.double() for p in trained(model)])
    assert close(grads[0], grads[1], 1e-6)
