"""loss=moe's maths in process, on tiny random mixtures of experts built from configs (Mixtral, Qwen2-MoE with its
shared expert, Qwen3-MoE, OLMoE): the formula is the model's own balancing loss, the window's two passes give the
loss and the gradient of a hand-written float64 evaluation over the whole window, the per-micro-batch options do
not, the z-loss is per token, and a block packed by documents balances as its documents alone."""
from __future__ import annotations

import pytest
import torch

from accutrain.core.batches import Batch
from accutrain.core.losses.moe import moe
from accutrain.core.options import RouterAux
from accutrain.core.routing import balancing, route, token_rows
from accutrain.errors import UserError

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB = 40
SIZES = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=64, attn_implementation="eager")
ARCHITECTURES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
    "olmoe": dict(num_experts=4),
}


def tiny(model_type: str = "mixtral", dtype=torch.float64, seed: int = 0):
    from accutrain.models.hf import causal_lm

    torch.manual_seed(seed)
    config = {"model_type": model_type, **SIZES, **ARCHITECTURES[model_type]}
    attn = config.pop("attn_implementation")
    model = causal_lm(VOCAB, config=config, dropout=0.0, attn_implementation=attn).to(dtype)
    if dtype == torch.float64:
        model.model.set_experts_implementation("eager")  # torch's grouped matmul takes no float64
    return model


def window(seed: int = 1, lengths=(5, 9, 3, 7, 8, 2, 6, 4, 9, 5)) -> list[dict]:
    """Samples of varying lengths (labels = input_ids)."""
    g = torch.Generator().manual_seed(seed)
    return [dict(input_ids=(ids := torch.randint(0, VOCAB, (n,), generator=g)), labels=ids.clone()) for n in lengths]


def padded(samples: list[dict]) -> Batch:
    """One micro-batch padded to its longest sample (attention mask, labels ignored on padding)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = s["input_ids"], 1, s["labels"]
    return Batch(dict(input_ids=ids, attention_mask=mask), labels)


def split(samples: list[dict], size: int) -> list[Batch]:
    return [padded(samples[i: i + size]) for i in range(0, len(samples), size)]


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def checked(model, mode: str = "window", coef: float = 1.0, z: float = 0.0, ce: float = 1.0, batch=None):
    loss = moe(mode, router_aux_coef=coef, router_z_coef=z, model_defaults=model.loss_defaults)
    loss.ce_weight = ce
    loss.check(model, batch if batch is not None else padded(window()[:2]), "test")
    return loss


def hand_written(model, samples: list[dict], top_k: int) -> torch.Tensor:
    """The big batch's balancing loss written out in float64, token by token: each sample alone through the model
    (no padding anywhere), then f_i = (top-k choices of expert i, all layers) / (layers × tokens), P_i = (its
    probabilities summed likewise) / (layers × tokens), N_E · Σ_i f_i · P_i."""
    per_layer: list[list[torch.Tensor]] = []
    for s in samples:
        _, aux = model(aux=("router_logits",), input_ids=s["input_ids"][None])
        per_layer.append(list(aux["router_logits"]))
    experts = per_layer[0][0].shape[-1]
    chosen = torch.zeros(experts, dtype=torch.float64)
    summed = torch.zeros(experts, dtype=torch.float64)
    rows = 0
    for sample in per_layer:
        for logits in sample:
            p = torch.softmax(logits.double(), -1)
            for t in range(len(p)):
                for i in torch.topk(p[t].detach(), top_k).indices.tolist():
                    chosen[i] += 1
                summed = summed + p[t]
                rows += 1
    return experts * ((chosen / rows) * (summed / rows)).sum()


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_the_formula_is_the_models_own_balancing_loss(model_type):
    model = tiny(model_type, torch.float32).eval()
    batch = padded(window()[:4])
    with torch.no_grad():
        _, aux = batch.forward(lambda **kw: model(aux=("router_logits", "aux_loss"), **kw))
    routed = route(aux["router_logits"], model.routing.top_k, token_rows(batch.inputs))
    ours = balancing(routed.counts, routed.probs, routed.tokens)
    torch.testing.assert_close(ours.float(), aux["aux_loss"].float(), rtol=1e-6, atol=1e-7)
    assert model.routing.experts == 4 and model.routing.top_k == 2 and model.routing.returns_logits
    assert routed.counts.sum() == 2 * routed.tokens * len(aux["router_logits"])  # top-2 of every real token


def close64(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within 1e-6 of the tensor's largest entry: transformers 5.2x's mixtures of experts take the router's
    softmax in float32 (`softmax(..., dtype=torch.float)`) even in a float64 model, so the experts' weights carry
    float32 rounding (measured: 2.5e-8 of the largest entry between splits) — a thousand times below the
    per-micro-batch objective's difference (> 1e-3, the test below)."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_the_window_in_two_passes_is_the_hand_written_float64_balancing_over_the_window(model_type):
    model, samples = tiny(model_type), window()
    loss = checked(model, ce=0.0)  # the balancing alone, coefficient 1
    expected_value = hand_written(model, samples, 2)
    expected_value.backward()
    expected = grads(model)
    for size in (4, 3, 10):  # 4, 4, 2 | 3, 3, 3, 1 | the window whole
        batches = split(samples, size)
        loss.accumulate(model, batches, loss.terms(batches), CPU)
        torch.testing.assert_close(loss.figures()["router_aux_window"], expected_value.detach(), rtol=1e-10, atol=0)
        for got, want in zip(grads(model), expected):
            close64(got, want)


def test_per_micro_batch_balancing_is_not_the_windows_and_equals_it_for_one_micro_batch():
    model, samples = tiny(), window()
    whole = [padded(samples)]
    exact = checked(model, ce=0.0)
    exact.accumulate(model, split(samples, 4), exact.terms(whole), CPU)
    windowed = grads(model)
    for mode in ("micro_batch", "model"):
        per_micro = checked(model, mode, ce=0.0)
        per_micro.accumulate(model, split(samples, 4), per_micro.terms(whole), CPU)
        naive = grads(model)
        relative = torch.linalg.vector_norm(torch.cat([(a - b).flatten() for a, b in zip(naive, windowed)])) / \
            torch.linalg.vector_norm(torch.cat([b.flatten() for b in windowed]))
        assert relative > 1e-3, (mode, relative)
        assert "router_aux" in per_micro.figures()  # the term it optimised, beside the window's
        per_micro.accumulate(model, whole, per_micro.terms(whole), CPU)
        one = grads(model)
        exact.accumulate(model, whole, exact.terms(whole), CPU)
        tight = mode == "micro_batch"  # the model's own sums are float32 (transformers'), ours float64
        for a, b in zip(one, grads(model)):
            torch.testing.assert_close(a, b, rtol=1e-9 if tight else 1e-5, atol=1e-13 if tight else 1e-9)


def test_the_whole_objective_is_the_same_under_any_split_z_loss_included():
    model, samples = tiny(), window()
    loss = checked(model, coef=0.3, z=0.05)
    totals, gradients = [], []
    for size in (10, 4, 3):
        batches = split(samples, size)
        totals.append(loss.accumulate(model, batches, loss.terms(batches), CPU))
        gradients.append(grads(model))
        assert loss.terms(batches) == sum(len(s["input_ids"]) - 1 for s in samples)
    z_alone = checked(model, coef=0.0, z=1.0, ce=0.0)
    z_alone.accumulate(model, split(samples, 3), loss.terms([padded(samples)]), CPU)
    assert float(z_alone.figures()["router_z"]) > 0
    for total, got in zip(totals[1:], gradients[1:]):
        torch.testing.assert_close(total, totals[0], rtol=1e-10, atol=0)
        for a, b in zip(got, gradients[0]):
            close64(a, b)


def test_a_block_packed_by_documents_balances_as_its_documents_alone():
    """data.packing=true: the block's padding (document 0) is no token; its 4-D mask keeps each document to itself,
    so the router sees each document's tokens as alone — the counts and the loss are the documents'."""
    model, samples = tiny(), window(lengths=(5, 9, 3, 7))
    ids = torch.cat([s["input_ids"] for s in samples] + [torch.zeros(4, dtype=torch.int64)])[None]
    documents = torch.cat([torch.full((len(s["input_ids"]),), d + 1) for d, s in enumerate(samples)]
                          + [torch.zeros(4, dtype=torch.int64)])[None]
    labels = ids.clone()
    labels[0, -4:] = -100
    block = Batch(dict(input_ids=ids, document_ids=documents), labels)
    loss = checked(model, ce=0.0, batch=block)
    loss.accumulate(model, [block], 1, CPU)
    packed = float(loss.figures()["router_aux_window"])
    loss.accumulate(model, [padded(samples)], 1, CPU)
    assert packed == pytest.approx(float(loss.figures()["router_aux_window"]), rel=1e-10)
    with pytest.raises(UserError, match="loss.router_aux=model takes the model's own balancing loss"):
        checked(model, "model", batch=block)


def test_figures_say_each_layers_load_and_the_window_is_read_twice():
    model, samples = tiny(), window()
    loss = checked(model)
    reads = []

    class Twice(list):
        def again(self):
            reads.append("again")
            return self

    loss.accumulate(model, Twice(split(samples, 4)), loss.terms([padded(samples)]), CPU)
    figures = {k: float(v) for k, v in loss.figures().items()}
    assert reads == ["again"]
    assert set(figures) == {"router_aux_window", "router_z", "router_load_max_l0", "router_entropy_l0",
                            "router_load_max_l1", "router_entropy_l1"}
    assert 1 <= figures["router_load_max_l0"] <= 4 and 0 < figures["router_entropy_l0"] <= torch.log(torch.tensor(4.))
    assert "expert load" in loss.summary(figures) and "balancing loss over the window" in loss.summary(figures)
    assert list(loss.components()) == ["router balancing"]


def test_a_dense_model_a_router_without_logits_and_one_without_a_loss_of_its_own_are_refused():
    from accutrain.models.hf import causal_lm

    gpt2 = causal_lm(VOCAB, config=dict(model_type="gpt2", n_layer=1, n_head=2, n_embd=16, n_positions=32))
    first = padded(window()[:2])
    with pytest.raises(UserError, match="loss=moe balances the router of a mixture-of-experts model, and this model"):
        moe().check(gpt2, first, "test")  # the loss meets the model when it checks it on the first samples
    llama4 = causal_lm(VOCAB, config=dict(model_type="llama4_text", hidden_size=16, intermediate_size=32,
                                          intermediate_size_mlp=32, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                          num_experts_per_tok=1, max_position_embeddings=64))
    with pytest.raises(UserError, match=r"\(Llama4ForCausalLM\) routes each token to 1 of 4 experts, but its "
                                        r"forward does not return its router logits"):
        moe().check(llama4, first, "test")
    deepseek = causal_lm(VOCAB, config=dict(model_type="deepseek_v3", hidden_size=16, intermediate_size=32,
                                            moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                            first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=8,
                                            q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
                                            head_dim=4, max_position_embeddings=64))
    with pytest.raises(UserError, match=r"loss.router_aux=window: the model \(DeepseekV3ForCausalLM\) computes no "
                                        "balancing loss of its own"):
        moe().check(deepseek, first, "test")
    watched = moe("off", model_defaults=deepseek.loss_defaults)  # its load is still measured
    watched.check(deepseek, first, "test")
    watched.accumulate(deepseek, [first], watched.terms([first]), CPU)
    assert "router_load_max_l0" in watched.figures()

    model = tiny(dtype=torch.float32)
    loss = moe(RouterAux.window, model_defaults=model.loss_defaults)
    loss.check(model, first, "test")
    assert loss.aux_coef == model.routing.coef == pytest.approx(0.001)  # null: the model's own

    class NoAux(torch.nn.Module):
        routing = model.routing

        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    with pytest.raises(UserError, match="its forward takes no aux= keyword"):
        moe().check(NoAux(), first, "test")


def test_cross_entropy_on_a_mixture_of_experts_warns_that_nothing_balances_its_router():
    from accutrain.core.losses.cross_entropy import cross_entropy

    model = tiny(dtype=torch.float32)
    warnings = cross_entropy(model_defaults=model.loss_defaults).attach(model)
    assert len(warnings) == 1 and "loss=cross_entropy does not balance its router" in warnings[0]
    assert "MixtralForCausalLM" in warnings[0] and "loss=moe" in warnings[0]
