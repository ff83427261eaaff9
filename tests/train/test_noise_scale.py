"""trainer.noise_scale: McCandlish's unbiased |G|² and tr(Σ) from the window's micro-batch gradients and its own,
against a float64 reference built from per-sample gradients of a linear regression."""
import numpy as np
import pytest
import torch
from torch import nn

from accutrain.core.step import accumulate, grad_norm
from accutrain.dist import World
from accutrain.train.noise_scale import NoiseScale, estimates

ONE = World(rank=0, size=1, local_rank=0)
CPU = torch.device("cpu")


def squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Σ_i (w·x_i + b − y_i)²: the summed loss accumulate() divides by |W|."""
    return (prediction.squeeze(1) - target).square().sum()


def regression(n: int, d: int = 6, seed: int = 0) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(d, 1)
    with torch.no_grad():
        model.weight.copy_(torch.randn(1, d, generator=g))
        model.bias.fill_(0.3)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.linspace(-1, 1, d) + 0.5 * torch.randn(n, generator=g)  # the model is not at the optimum: G ≠ 0
    return model, x, y


def per_sample_grads(model: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """∇ (w·x_i + b − y_i)² = 2 r_i [x_i, 1], in float64."""
    w, b = model.weight.detach().double().numpy()[0], float(model.bias.detach())
    xs, ys = x.double().numpy(), y.double().numpy()
    r = xs @ w + b - ys
    return 2 * r[:, None] * np.hstack([xs, np.ones((len(xs), 1))])


def measure(model: nn.Linear, x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> dict:
    """One window of micro-batches of `sizes` through accumulate(), as the loop runs it: the estimator's record."""
    noise = NoiseScale(list(model.parameters()), ONE, CPU, decay=0.0)
    model.zero_grad(set_to_none=True)
    noise.begin(len(x), 1)
    cuts = np.cumsum([0, *sizes])
    batches = [(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    accumulate(model, batches, len(x), CPU, loss=squared_error, observe=noise.micro_batch_done)
    norm = float(grad_norm(list(model.parameters()), None))
    noise.settle(norm, len(x))
    return noise.record


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [8, 8, 8, 5], [16, 4, 12]])
def test_the_estimates_match_a_float64_reference_from_per_sample_gradients(sizes):
    """The hooks' micro-batch norms and the window's norm, combined, against the same quantities computed in float64
    from each sample's own gradient; micro-batches of unequal size use their harmonic mean. Tolerance: 1e-4
    relative (the model and its gradients are float32)."""
    model, x, y = regression(sum(sizes))
    record = measure(model, x, y, sizes)
    grads = per_sample_grads(model, x, y)
    cuts = np.cumsum([0, *sizes])
    small = np.mean([np.sum(grads[a:b].mean(0) ** 2) for a, b in zip(cuts[:-1], cuts[1:])])
    b_small = len(sizes) / np.sum(1.0 / np.array(sizes))
    big = np.sum(grads.mean(0) ** 2)
    n = len(x)
    trace = (small - big) / (1 / b_small - 1 / n)
    g2 = (n * big - b_small * small) / (n - b_small)
    assert record["noise_trace"] == pytest.approx(trace, rel=1e-4)
    assert record["noise_g2"] == pytest.approx(g2, rel=1e-4)
    assert record["b_simple"] == pytest.approx(trace / g2, rel=1e-4)  # decay 0: the smoothed ratio is this step's


def test_the_estimates_are_unbiased_for_a_known_gradient_noise():
    """Windows drawn with replacement from a population of per-sample gradients whose mean G and covariance Σ are
    known: averaged over 4,000 windows, the estimates land on |G|² and tr(Σ) within 4 standard errors."""
    rng = np.random.default_rng(0)
    population = rng.normal(size=(5000, 5)) * np.array([3.0, 1.0, 0.5, 0.5, 0.2]) + np.array([0.4, -0.3, 0.2, 0, 0])
    true_g2 = np.sum(population.mean(0) ** 2)
    true_trace = np.sum(population.var(0))  # the population's own covariance (ddof 0): sampling with replacement
    g2s, traces = [], []
    for _ in range(4000):
        window = population[rng.integers(0, len(population), 32)]
        small = np.mean([np.sum(window[i:i + 8].mean(0) ** 2) for i in range(0, 32, 8)])
        g2, trace = estimates(small, 8.0, np.sum(window.mean(0) ** 2), 32.0)
        g2s.append(g2)
        traces.append(trace)
    for values, truth in ((g2s, true_g2), (traces, true_trace)):
        assert abs(np.mean(values) - truth) < 4 * np.std(values) / np.sqrt(len(values)), (np.mean(values), truth)


def test_moving_averages_of_numerator_and_denominator():
    model, x, y = regression(32)
    noise = NoiseScale(list(model.parameters()), ONE, CPU, decay=0.5)
    steps = []
    for seed in range(3):  # three windows of other samples
        _, x, y = regression(32, seed=seed)
        noise.begin(32, 1)
        model.zero_grad(set_to_none=True)
        accumulate(model, list(zip(x.split(8), y.split(8))), 32, CPU, loss=squared_error,
                   observe=noise.micro_batch_done)
        noise.settle(float(grad_norm(list(model.parameters()), None)), 32)
        steps.append(noise.record)
    g2 = trace = 0.0
    for record in steps:
        g2, trace = 0.5 * g2 + 0.5 * record["noise_g2"], 0.5 * trace + 0.5 * record["noise_trace"]
    assert steps[-1]["b_simple"] == pytest.approx(trace / g2, rel=1e-12)
    assert noise.state_dict() == dict(g2_avg=pytest.approx(g2, rel=1e-12), trace_avg=pytest.approx(trace, rel=1e-12),
                                      steps=3)


def test_a_window_of_one_micro_batch_or_a_skipped_step_leaves_the_averages():
    model, x, y = regression(8)
    record = measure(model, x, y, [8])
    assert record == dict(noise_g2=None, noise_trace=None, b_simple=None)
    noise = NoiseScale(list(model.parameters()), ONE, CPU)
    noise.begin(8, 1)
    accumulate(model, list(zip(x.split(4), y.split(4))), 8, CPU, loss=squared_error, observe=noise.micro_batch_done)
    noise.settle(1.0, 8, taken=False)
    assert noise.steps == 0 and noise.record["b_simple"] is None


def test_hooks_are_silent_outside_a_window():
    """A backward outside begin()…settle() (accutrain-check, micro_batch=auto's trials) is not counted."""
    model, x, y = regression(8)
    noise = NoiseScale(list(model.parameters()), ONE, CPU)
    squared_error(model(x), y).backward()
    assert noise._norms == [] and noise._sums == []
