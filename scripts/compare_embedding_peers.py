"""Embedding training beside sentence-transformers, the same work: one window of (query, passage, hard negative)
triples through the same randomly initialised BERT (mean pooling, cosine similarity × 20, one direction — the
defaults of sentence-transformers' MultipleNegativesRankingLoss), its gradient taken four ways:

    accutrain        loss=contrastive (gradient caching: two passes, the window's negatives exact), micro-batches of m
    st_cached        sentence-transformers' CachedMultipleNegativesRankingLoss, mini_batch_size m
    st_plain         sentence-transformers' MultipleNegativesRankingLoss on each micro-batch of m, accumulated
    accutrain_naive  loss.window=false: each micro-batch's own loss, accumulated (for comparison)

and compared with a float64 reference of the whole window in one differentiable pass (written here, from the
model's token states: no code of either side). Each method runs in a process of its own, the methods alternated,
`--repeats` times: the gradient's distance from the reference (relative L2), the time of one window (median), and
the process's peak resident memory over the window (Linux's high-water mark, reset as the window begins) and how far
above its resident set before the window it went; on a GPU, CUDA's peak over the window too.

    python scripts/compare_embedding_peers.py --window 64 --micro 8 --repeats 3
    python scripts/compare_embedding_peers.py --device cuda --layers 12 --hidden 768 --window 4096 --micro 128
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
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

METHODS = ("accutrain", "st_cached", "st_plain", "accutrain_naive")
TOPICS = ["cat", "dog", "car", "tree", "boat", "moon", "rain", "bread", "chess", "piano", "river", "glass"]
SCALE = 20.0


def triples(n: int) -> tuple[list[str], list[str], list[str]]:
    queries, passages, negatives = [], [], []
    for i in range(n):
        topic, other = TOPICS[i % len(TOPICS)], TOPICS[(i * 5 + 3) % len(TOPICS)]
        queries.append(f"what is a {topic}, query {i}?")
        passages.append(f"a {topic} is a thing" + " and more" * (i % 5) + f", passage {i}")
        negatives.append(f"a {other} is a thing, passage {i}")
    return queries, passages, negatives


def make_model(directory: Path, layers: int, hidden: int) -> None:
    """A randomly initialised BERT (no dropout) and accutrain's byte tokenizer, saved where both sides load them."""
    import transformers

    from accutrain.data.tokenizer import fast_byte_tokenizer

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "bert", vocab_size=259, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64),
        intermediate_size=4 * hidden, max_position_embeddings=512, pad_token_id=256, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    transformers.AutoModel.from_config(config).save_pretrained(directory)
    tokenizer = fast_byte_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(directory)


def gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def reference(directory: Path, texts: tuple[list[str], ...]) -> torch.Tensor:
    """∇ of the window's mean loss in float64, one differentiable pass: each query against every passage and every
    negative of the window (cosine × 20), mean token states pooled over the real tokens."""
    import transformers

    from accutrain.data.tokenizer import ByteTokenizer

    model = transformers.AutoModel.from_pretrained(directory, dtype=torch.float64)
    model.pooler = None
    ids = ByteTokenizer()

    def embed(batch: list[str]) -> torch.Tensor:
        rows = ids(batch)["input_ids"]
        width = max(len(r) for r in rows)
        x = torch.tensor([r + [256] * (width - len(r)) for r in rows])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        states = model(input_ids=x, attention_mask=mask).last_hidden_state
        return F.normalize((states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)

    q, p, n = (embed(t) for t in texts)
    scores = SCALE * q @ torch.cat([p, n]).T
    F.cross_entropy(scores, torch.arange(len(q))).backward()
    return gradient(model)


def prepare(method: str, directory: Path, texts: tuple[list[str], ...], micro: int, device: str
            ) -> tuple[Any, Any]:
    """(the window's forward and backward by `method`, in float32; the model's gradient after it): the model
    loaded and the texts tokenized beforehand, so that the window alone is timed."""
    q, p, n = texts
    if method.startswith("accutrain"):
        from accutrain.core.batches import Batch, PadCollate
        from accutrain.core.gradcache import accumulate_window_loss
        from accutrain.core.losses.contrastive import ContrastiveLoss
        from accutrain.data.tokenizer import ByteTokenizer
        from accutrain.models.hf_encoder import encoder

        model = encoder(name_or_path=str(directory), pooling="mean", normalize=True).to(device)
        tok, collate = ByteTokenizer(), PadCollate({"anchor.input_ids": 256, "positive.input_ids": 256,
                                                    "negative.0.input_ids": 256})
        items = []
        for a, b, c in zip(*(tok(t)["input_ids"] for t in texts)):
            item = {}
            for role, row in (("anchor", a), ("positive", b), ("negative.0", c)):
                item[f"{role}.input_ids"] = torch.tensor(row)
                item[f"{role}.attention_mask"] = torch.ones(len(row), dtype=torch.long)
            item["labels"] = torch.zeros(2, dtype=torch.long)
            items.append(item)
        batches = []
        for start in range(0, len(items), micro):
            data = collate(items[start: start + micro])
            batches.append(Batch({k: v for k, v in data.items() if k != "labels"}, data["labels"]))
        loss = ContrastiveLoss(1 / SCALE, symmetric=False, window=method == "accutrain")
        return (lambda: accumulate_window_loss(model, batches, len(items), torch.device(device), loss),
                lambda: gradient(model.model))
    from sentence_transformers import SentenceTransformer, losses

    model = SentenceTransformer(str(directory), device=device)
    features = [model.preprocess(t) for t in texts]
    features = [{k: v.to(device) for k, v in f.items() if isinstance(v, torch.Tensor)} for f in features]
    labels = torch.zeros(len(q), device=device)
    cached = losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=micro)
    plain = losses.MultipleNegativesRankingLoss(model, scale=SCALE)

    def window() -> None:
        if method == "st_cached":
            cached(features, labels).backward()
            return
        for start in range(0, len(q), micro):  # the plain loss on each micro-batch, accumulated: its negatives
            part = [{k: v[start: start + micro] for k, v in f.items()} for f in features]  # are the micro-batch's
            (plain(part, labels[start: start + micro]) * len(part[0]["input_ids"]) / len(q)).backward()
    return window, lambda: gradient(model[0].auto_model)


def child(args: argparse.Namespace) -> None:
    """One method, one window, in this process: what it reports to the parent."""
    texts = triples(args.window)
    torch.set_num_threads(args.threads)
    window, grads = prepare(args.method, Path(args.model), texts, args.micro, args.device)
    reset_peak_rss()
    before = current_rss()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    window()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_rss()
    got = grads()
    expected = torch.load(args.reference, weights_only=True)
    Path(args.out).write_text(json.dumps(dict(
        distance=float((got.cpu() - expected).norm() / expected.norm()), seconds=seconds, peak_mb=peak,
        above_mb=peak - before, cuda_mb=torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None)))


def current_rss() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> None:
    """Linux: the resident high-water mark (VmHWM) starts again from the present (what the setup peaked at is not the
    window's)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> float:
    """The resident high-water mark since reset_peak_rss (MiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.method:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        directory, expected = Path(tmp) / "model", Path(tmp) / "reference.pt"
        make_model(directory, args.layers, args.hidden)
        torch.save(reference(directory, triples(args.window)), expected)
        results: dict[str, list[dict]] = {m: [] for m in args.methods.split(",")}
        for _ in range(args.repeats):
            for method in results:  # alternated: every method meets the machine in the same states
                out = Path(tmp) / f"{method}.json"
                subprocess.run([sys.executable, __file__, "--method", method, "--model", str(directory),
                                "--reference", str(expected), "--out", str(out), "--window", str(args.window),
                                "--micro", str(args.micro), "--device", args.device, "--threads", str(args.threads)],
                               check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                results[method].append(json.loads(out.read_text()))
    print(f"window {args.window} triples (query, passage, hard negative), micro-batches of {args.micro}; BERT "
          f"{args.layers} layers × {args.hidden}, {args.device}, {args.threads} thread(s); median of {args.repeats}")
    cuda = args.device == "cuda"
    print(f"{'method':<16} {'distance from float64':>22} {'seconds/window':>15} {'peak MiB':>9} {'above MiB':>10}"
          + (f" {'CUDA peak MiB':>14}" if cuda else ""))
    for method, runs in results.items():
        keys = ("distance", "seconds", "peak_mb", "above_mb") + (("cuda_mb",) if cuda else ())
        med = {key: statistics.median(r[key] for r in runs) for key in keys}
        print(f"{method:<16} {med['distance']:>22.2e} {med['seconds']:>15.3f} {med['peak_mb']:>9.0f} "
              f"{med['above_mb']:>10.0f}" + (f" {med['cuda_mb']:>14.0f}" if cuda else ""))
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))


if __name__ == "__main__":
    main()
