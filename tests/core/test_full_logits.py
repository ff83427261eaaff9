"""The cross-entropy of full logits (model.logits=full, the fallback of soft-capped models): F.cross_entropy's sum and
gradients in float64, chunk by chunk, with the logits' memory taking their gradient when the step gives them up —
never a user's tensor, never one a backward node keeps — so that a micro-batch holds one logits-sized tensor from the
loss through its backward, where F.cross_entropy holds three."""

import pytest
import torch
import torch.nn.functional as F
from conftest import LiveTensors

from accutrain.core.full_ce import logits_given_up, rows_per_chunk
from accutrain.core.summing import class_rows, cross_entropy_sums, summed_cross_entropy


def reference(logits, target, smoothing=0.0, per_sequence=False):
    """F.cross_entropy itself: Σ over tokens, or Σ over samples of each one's mean over its counted tokens."""
    terms = F.cross_entropy(logits, target, reduction="none", ignore_index=-100, label_smoothing=smoothing)
    return (terms.sum(1) / (target != -100).sum(1).clamp(min=1)).sum() if per_sequence else terms.sum()


def targets(batch, length, classes):
    target = torch.randint(classes, (batch, length))
    target[0, :9], target[-1, length - 20:] = -100, -100  # a masked prompt, padding
    target[1] = -100  # a sample without a counted token
    return target


@pytest.mark.parametrize("given_up", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_loss_and_its_gradient_are_cross_entropys(given_up, smoothing, per_sequence, monkeypatch):
    monkeypatch.setattr("accutrain.core.full_ce.rows_per_chunk", lambda rows, classes: 64)  # 210 rows: 4 chunks
    torch.manual_seed(0)
    batch, length, classes = 3, 70, 200
    x = torch.randn(batch, length, classes, dtype=torch.float64, requires_grad=True)
    target = targets(batch, length, classes)
    expected = reference((x * 1.0).transpose(1, 2), target, smoothing, per_sequence)
    (want,) = torch.autograd.grad(expected * 0.37, x)
    logits = (x * 1.0).transpose(1, 2)  # a language model's (batch, length, classes), seen as (batch, classes, length)
    assert class_rows(logits, target) is not None
    with logits_given_up() if given_up else torch.enable_grad():
        got = summed_cross_entropy(logits, target, -100, smoothing, per_sequence)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-10)
    (grad,) = torch.autograd.grad(got * 0.37, x)
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)
    fresh = x.detach().transpose(1, 2)  # given up, the logits now hold their gradient: evaluate fresh ones
    counted = target != -100
    torch.testing.assert_close(cross_entropy_sums(fresh, target), torch.stack([
        reference(fresh, target).double(), ((fresh.argmax(1) == target) & counted).sum().double(),
        counted.sum().double()]))


def test_half_precision_logits_are_reduced_in_float32_and_their_gradient_kept_in_their_dtype():
    torch.manual_seed(1)
    x = torch.randn(2, 40, 300, requires_grad=True)
    target = targets(2, 40, 300)
    half = (x.to(torch.bfloat16) * 1.0).transpose(1, 2)
    expected = reference(half.detach().float(), target)  # before: given up, the logits become their gradient
    with logits_given_up():
        got = summed_cross_entropy(half, target)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    got.backward()
    want = torch.autograd.grad(reference((x.to(torch.bfloat16).float() * 1.0).transpose(1, 2), target), x)[0]
    torch.testing.assert_close(x.grad, want, rtol=2e-2, atol=2e-3)  # bf16's rounding of the gradient


def test_a_users_tensor_and_a_kept_one_are_never_written():
    torch.manual_seed(2)
    target = targets(2, 30, 50)
    leaf = torch.randn(2, 50, 30, requires_grad=True)  # a leaf: the caller's own
    before = leaf.detach().clone()
    with logits_given_up():
        summed_cross_entropy(leaf, target.clone()).backward()  # (batch, classes, length): no rows, F.cross_entropy
        rows_leaf = torch.randn(2, 30, 50, requires_grad=True)
        kept = rows_leaf.detach().clone()
        summed_cross_entropy(rows_leaf.transpose(1, 2), target).backward()
    assert torch.equal(leaf.detach(), before) and torch.equal(rows_leaf.detach(), kept)
    # logits whose last operation keeps its output for its backward (exp, tanh: a soft cap) keep their values, and
    # the gradient through that operation is exact
    for activation in (torch.exp, torch.tanh, lambda t: torch.tanh_(t * 1.0)):
        x = torch.randn(2, 30, 50, dtype=torch.float64, requires_grad=True)
        logits = activation(x)
        values = logits.detach().clone()
        with logits_given_up():
            loss = summed_cross_entropy(logits.transpose(1, 2), target)
        assert torch.equal(logits.detach(), values)
        loss.backward()
        want = torch.autograd.grad(reference(activation(x).transpose(1, 2), target), x)[0]
        torch.testing.assert_close(x.grad, want, rtol=1e-10, atol=1e-12)


def test_a_second_backward_fails_rather_than_scaling_twice():
    x = torch.randn(2, 20, 30, requires_grad=True)
    target = torch.randint(30, (2, 20))
    loss = summed_cross_entropy((x * 1.0).transpose(1, 2), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def step_memory(tokens: int, classes: int, how: str) -> tuple[LiveTensors, int]:
    """One micro-batch's forward from hidden states to the loss and its backward, as core/step.py runs it (the
    logits dropped after the loss), under LiveTensors; and the logits' bytes."""
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 16, requires_grad=True)
    head = torch.randn(classes, 16)  # frozen, as a LoRA model's head
    target = torch.randint(classes, (1, tokens))
    with LiveTensors() as seen:
        logits = F.linear(hidden * 1.0, head).unsqueeze(0)  # (1, tokens, classes)
        if how == "F.cross_entropy over rows":  # the Hugging Face models' loss
            loss = F.cross_entropy(logits.view(-1, classes), target.view(-1), reduction="sum")
        elif how == "F.cross_entropy":  # on (batch, classes, length), as accutrain took it before
            loss = F.cross_entropy(logits.transpose(1, 2), target, reduction="sum")
        else:
            with logits_given_up() if how == "given up" else torch.enable_grad():
                loss = summed_cross_entropy(logits.transpose(1, 2), target)
        del logits
        loss.backward()
    return seen, 4 * tokens * classes


def test_a_micro_batch_holds_one_logits_sized_tensor_where_cross_entropy_holds_three(monkeypatch):
    assert rows_per_chunk(2048, 4000) == 262 and rows_per_chunk(4096, 151936) == 128  # 2^20 logits, or a 32nd
    monkeypatch.setattr("accutrain.core.full_ce.rows_per_chunk", lambda rows, classes: rows // 16)  # as at scale
    peaks = {}
    for how in ("F.cross_entropy over rows", "F.cross_entropy", "kept", "given up"):
        seen, logits = step_memory(2048, 4000, how)
        peaks[how] = seen.peak / logits
    assert peaks["F.cross_entropy over rows"] >= 3, peaks  # logits or log-softmax, its gradient, the logits' gradient
    assert peaks["F.cross_entropy"] >= 3, peaks
    assert peaks["kept"] < 2.3, peaks  # the logits and a gradient buffer (+ a chunk's float32 work)
    assert peaks["given up"] < 1.3, peaks  # the logits become their gradient


def test_a_soft_capped_models_logits_take_their_gradient_exactly():
    transformers = pytest.importorskip("transformers")
    from accutrain.core.full_ce import reusable
    from accutrain.core.summing import shift_left

    config = transformers.AutoConfig.for_model(  # Gemma 2: its logits are tanh-capped, so model.logits=full
        "gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=120, final_logit_softcapping=3.0)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    ids = torch.randint(120, (2, 24))
    labels = ids.clone()
    labels[1, 18:] = -100  # padding
    target = shift_left(labels)
    own = F.cross_entropy(model(input_ids=ids).logits.transpose(1, 2), target, reduction="sum")  # float64 throughout
    own.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids).logits.transpose(1, 2)
    with logits_given_up():
        assert reusable(class_rows(logits, labels))  # the cap's last step (× 3.0) keeps nothing
        loss = summed_cross_entropy(logits, target)
    del logits
    torch.testing.assert_close(loss, own.detach(), rtol=1e-12, atol=1e-10)
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12, msg=name)


class TinyLM(torch.nn.Module):
    """Full logits (batch, classes, length) from an embedding and a head: a language model's layout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

    def forward(self, x):
        return self.head(self.embed(x)).transpose(1, 2)


def test_the_step_gives_up_the_logits_only_to_a_loss_that_reads_them_once():
    from accutrain.core.losses.cross_entropy import SummedLoss
    from accutrain.core.step import accumulate

    torch.manual_seed(5)
    batches = [(torch.randint(50, (2, 12)), torch.randint(50, (2, 12))) for _ in range(3)]
    terms = sum(t.numel() for _, t in batches)
    reference = TinyLM()
    sum(F.cross_entropy(reference(x), y, reduction="sum") for x, y in batches).div(terms).backward()

    def grads_after(loss):
        model = TinyLM()
        accumulate(model, batches, terms, torch.device("cpu"), loss=loss)
        return {n: p.grad for n, p in model.named_parameters()}

    seen = []

    def users_loss(logits, target):  # a user's: a cross-entropy of the logits, then the logits read again
        before = logits.detach().clone()
        total = summed_cross_entropy(logits, target)
        seen.append(torch.equal(logits.detach(), before))
        return total + 0.0 * logits.sum()

    assert SummedLoss.reads_logits_once and not getattr(users_loss, "reads_logits_once", False)
    for loss in (SummedLoss(elements=True), users_loss):
        for name, grad in grads_after(loss).items():
            torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, msg=name)
    assert seen == [True, True, True]  # never written under a loss that did not say it reads them once
