"""Cross-entropy without the full logits (model.logits=chunked): the loss and gradients of every token loss against
F.cross_entropy in float64, the logits never held whole (a micro-batch's peak memory does not grow with the
vocabulary × tokens), and whole runs ending with the weights of the full logits, accumulated, on 2 ranks and
sharded by FSDP."""

import pytest
import torch
import torch.nn.functional as F
from conftest import LiveTensors, final_weights, read_metrics, train_here

from accutrain.core.chunked_ce import Projection, chunk_size, logits_of
from accutrain.core.losses.cross_entropy import SummedLoss
from accutrain.core.summing import cross_entropy_sums, summed_cross_entropy


def reference_cross_entropy(logits, target, smoothing=0.0, per_sequence=False):
    """F.cross_entropy itself: Σ over tokens, or Σ over samples of each one's mean over its counted tokens."""
    terms = F.cross_entropy(logits, target, reduction="none", ignore_index=-100, label_smoothing=smoothing)
    return (terms.sum(1) / (target != -100).sum(1).clamp(min=1)).sum() if per_sequence else terms.sum()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_chunked_loss_and_gradients_are_cross_entropys(bias, smoothing, per_sequence):
    torch.manual_seed(0)
    batch, length, width, classes = 3, 70, 8, 200  # 210 tokens: chunks of 64, the last one short
    hidden = torch.randn(batch, length, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(classes, width, dtype=torch.float64, requires_grad=True)
    b = torch.randn(classes, dtype=torch.float64, requires_grad=True) if bias else None
    target = torch.randint(classes, (batch, length))
    target[0, :9], target[2, 50:] = -100, -100  # a masked prompt, padding
    target[1] = -100  # a sample without a counted token
    leaves = [t for t in (hidden, weight, b) if t is not None]
    full = reference_cross_entropy(F.linear(hidden, weight, b).transpose(1, 2), target, smoothing, per_sequence)
    chunked = summed_cross_entropy(Projection(hidden, weight, b), target, -100, smoothing, per_sequence)
    torch.testing.assert_close(chunked, full, rtol=1e-12, atol=1e-10)
    for expected, got in zip(torch.autograd.grad(full * 0.37, leaves), torch.autograd.grad(chunked * 0.37, leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    sums = cross_entropy_sums(Projection(hidden, weight, b), target)
    torch.testing.assert_close(sums, cross_entropy_sums(F.linear(hidden, weight, b).transpose(1, 2), target).detach())


def test_the_loss_counts_and_evaluates_a_projection_as_its_logits():
    torch.manual_seed(1)
    projection = Projection(torch.randn(2, 5, 4), torch.randn(11, 4))
    assert projection.shape == (2, 11, 5) and logits_of(projection).shape == (2, 11, 5)
    labels = torch.randint(11, (2, 5))
    loss = SummedLoss(elements=True, shift_labels=True)
    torch.testing.assert_close(loss(projection, labels), loss(projection.logits(), labels))
    torch.testing.assert_close(loss.eval_sums(projection, labels), loss.eval_sums(projection.logits(), labels))
    assert chunk_size(16384, 896, 151936) == 128 and chunk_size(10, 8, 50) == 64


def step_memory(tokens: int, classes: int, chunked: bool) -> LiveTensors:
    width = 16
    torch.manual_seed(0)
    hidden = torch.randn(1, tokens, width, requires_grad=True)
    head = torch.randn(classes, width, requires_grad=True)
    target = torch.randint(classes, (1, tokens))
    with LiveTensors() as seen:
        if chunked:
            summed_cross_entropy(Projection(hidden * 1.0, head), target).backward()
        else:  # the unfused loss: F.cross_entropy's own
            F.cross_entropy(F.linear(hidden * 1.0, head).transpose(1, 2), target, reduction="sum").backward()
    return seen


def test_the_logits_are_never_held_whole_so_the_peak_does_not_grow_with_vocabulary_times_tokens():
    small, large = (512, 1000), (2048, 4000)  # 16 times the logits
    full = [step_memory(*shape, chunked=False) for shape in (small, large)]
    chunked = [step_memory(*shape, chunked=True) for shape in (small, large)]
    logits = 4 * large[0] * large[1]  # float32 bytes of the larger micro-batch's logits
    assert full[1].largest >= logits and full[1].peak > 2 * logits  # logits, softmax and their gradient
    assert full[1].peak > 12 * full[0].peak  # the unfused peak follows vocabulary × tokens
    assert chunked[1].largest < logits / 8  # one chunk's logits at most, never the whole
    assert chunked[1].peak < full[1].peak / 10
    # what grows is the head and the hidden states (their gradients), not their product
    extra = 4 * 16 * (large[0] + large[1] - small[0] - small[1]) * 3 + 4 * 64 * (large[1] - small[1]) * 3
    assert chunked[1].peak - chunked[0].peak < extra


GPT2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=2", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=64", "model.dropout=0"]


def lm(tmp_path, *args):
    path = tmp_path / "lm.txt"
    if not path.exists():
        words = "the cat sat on a mat and dog ran far away big small red blue".split()
        path.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 11))
                                  for i in range(40)))
    return [*GPT2, "data=text", f"data.train={path}", "data.val_fraction=0.1", "data.max_length=64", "optim=sgd",
            "optim.lr=0.3", "optim.momentum=0", "trainer.epochs=2", "trainer.progress=false", *args]


@pytest.mark.slow
@pytest.mark.parametrize("loss", [[], ["loss.normalize=sequences", "loss.label_smoothing=0.1"]])
def test_chunked_runs_end_with_the_weights_of_the_full_logits_accumulated_and_on_two_ranks(tmp_path, loss):
    pytest.importorskip("transformers")
    full, _ = train_here(tmp_path, "full", *lm(tmp_path, "micro_batch=16", "model.logits=full", *loss))
    runs = [train_here(tmp_path, "acc", *lm(tmp_path, "micro_batch=4", "accum=4", *loss))[0]]
    # 2 gloo ranks, each accumulating; and sharded by FSDP: the head gathered from the forward to the loss, and the
    # last window's 4 samples leave a rank a micro-batch of zero rows, which every rank must still forward
    if not loss:
        runs.append(train_here(tmp_path, "two", *lm(tmp_path, "devices=2", "micro_batch=4", "accum=2"))[0])
        runs.append(train_here(tmp_path, "fsdp", *lm(tmp_path, "devices=2", "micro_batch=4", "accum=2",
                                                     "strategy=fsdp"))[0])
    reference = final_weights(full)
    for run in runs:
        for key, value in final_weights(run).items():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)
        assert [r["val_loss"] for r in read_metrics(run)[1]] == pytest.approx(
            [r["val_loss"] for r in read_metrics(full)[1]], rel=1e-5)
