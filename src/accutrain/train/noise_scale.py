"""`trainer.noise_scale`: the gradient noise scale B_simple = tr(Σ) / |G|² of McCandlish et al. 2018 ("An
Empirical Model of Large-Batch Training", Appendix A), measured from what accumulation already computes.

For a gradient G_B averaged over B samples drawn from the data, E|G_B|² = |G|² + tr(Σ)/B, with G the true gradient
and Σ the per-sample gradients' covariance. A window holds two such estimates: each micro-batch's own gradient g_j
(n_j samples, on any rank) and the window's gradient G_W (N = Σ n_j samples, every rank). Averaged over the M
micro-batches, E[mean_j |g_j|²] = |G|² + tr(Σ) · h with h = mean_j 1/n_j, so with B_small = 1/h (the harmonic mean
of the micro-batches' sizes: micro_batch itself unless a micro-batch is short) and B_big = N the unbiased estimates
are

    tr(Σ) = (mean_j |g_j|² − |G_W|²) / (1/B_small − 1/B_big)
    |G|²  = (B_big |G_W|² − B_small mean_j |g_j|²) / (B_big − B_small)

and B_simple = tr(Σ)/|G|². Each estimate is noisy (|G|² may come out negative), so, as McCandlish recommends, the
ratio is of separate moving averages of the two (their bias corrections, equal, cancel in the ratio).

Where g_j comes from: a hook on every parameter (`Tensor.register_hook`) sees the gradient a backward brings, before
it joins .grad (and before DDP's reducer, which acts after the accumulation, or accutrain's gradient buffers): each
micro-batch's own, local gradient, inside no_sync and on the synchronising micro-batch alike. That backward
carried the summed loss × world/|W| (× the GradScaler's scale with 16-mixed), which is divided out. |G_W| is the
norm the loop measures anyway (before clipping, after DDP's average: the global gradient). With several ranks one
all-reduce sums the three micro-batch figures (Σ|g_j|², Σ 1/n_j, M). FSDP is refused: its hooks would see sharded,
already reduced gradients, not a micro-batch's own.

What varies with the split by construction: B_small and the micro-batch figures (which samples share a micro-batch
and how many); the window-level ones (N, |G_W|²) are the same under any split of the window. The same micro-batches
(micro_batch=8 accum=4 on one rank, micro_batch=8 accum=2 on two) give the same B_simple up to the order of float
sums. A window of one micro-batch (nothing to compare) or whose step was skipped leaves the averages as they were.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from accutrain import dist
from accutrain.dist import World


def estimates(small_sq: float, b_small: float, big_sq: float, b_big: float) -> tuple[float, float]:
    """(|G|², tr Σ): McCandlish's unbiased estimates from the mean squared norm `small_sq` of gradients over
    `b_small` samples (the harmonic mean of their sizes) and the squared norm `big_sq` of one over `b_big`."""
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    return g2, trace


class NoiseScale:
    """The estimator: per-parameter hooks collect each micro-batch's squared gradient norm while armed (begin() to
    settle()); settle() combines them with the window's norm, moves the averages and keeps the step's `record`."""

    def __init__(self, params: list[nn.Parameter], world: World, device: torch.device, decay: float = 0.95,
                 loss_scale: Callable[[], Optional[torch.Tensor]] = lambda: None) -> None:
        self.world, self.device, self.decay, self.loss_scale = world, device, decay, loss_scale
        self.g2_avg, self.trace_avg, self.steps = 0.0, 0.0, 0  # the moving averages (unnormalised) and their count
        self.record: dict[str, Optional[float]] = {}
        self.effective: Optional[int] = None  # the effective batch of the latest window
        self.armed = False
        self._norms: list[torch.Tensor] = []  # the current backward's per-parameter norms
        self._sums: list[torch.Tensor] = []  # Σ|g_j|² per micro-batch of this window, on the device
        self._inv_n, self._count, self._scale, self._weight = 0.0, 0, None, 1.0
        self._hooks = [p.register_hook(self._hook) for p in params]

    def _hook(self, grad: torch.Tensor) -> None:
        if self.armed:
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.promote_types(grad.dtype, torch.float32)))

    def begin(self, terms: int, world: int) -> None:
        """A window of `terms` samples begins (or begins again after an out-of-memory): each micro-batch backpropagates
        its summed loss × world/terms."""
        self.armed, self._weight = True, world / terms
        self._norms, self._sums, self._inv_n, self._count, self._scale = [], [], 0.0, 0, None

    def micro_batch_done(self, n: int) -> None:
        """The backward of a micro-batch of `n` samples ended (0: a stand-in, which is not counted)."""
        norms, self._norms = self._norms, []
        if n == 0 or not norms:
            return
        if self._scale is None:
            self._scale = self.loss_scale()  # 16-mixed: the scale this window's backward passes used
        # |g_j|² with g_j the micro-batch's mean gradient: the backward carried weight × Σ_i ∇loss_i
        self._sums.append(torch.stack(norms).double().square().sum() / (self._weight * n) ** 2)
        self._inv_n += 1.0 / n
        self._count += 1

    def settle(self, window_norm: float, samples: int, taken: bool = True, effective: Optional[int] = None) -> None:
        """The window's gradient norm (global, before clipping) over its `samples` (of a planned `effective` batch):
        estimate, average, keep `record` (every rank calls it; with several ranks it all-reduces once)."""
        self.armed, self.effective = False, effective if effective is not None else samples
        device = self.device
        small = torch.stack(self._sums).sum() if self._sums else torch.zeros((), dtype=torch.float64, device=device)
        if self._scale is not None:
            small = small / self._scale.double().square()
        figures = torch.stack([small, torch.tensor(self._inv_n, dtype=torch.float64, device=device),
                               torch.tensor(float(self._count), dtype=torch.float64, device=device)])
        if self.world.size > 1:
            figures = dist.all_reduce_sum(figures, self.world)
        small_sum, inv_n, count = figures.tolist()
        self._sums = []
        g2 = trace = None
        if taken and count >= 2 and math.isfinite(small_sum) and math.isfinite(window_norm):
            g2, trace = estimates(small_sum / count, count / inv_n, window_norm ** 2, float(samples))
            self.g2_avg = self.decay * self.g2_avg + (1 - self.decay) * g2
            self.trace_avg = self.decay * self.trace_avg + (1 - self.decay) * trace
            self.steps += 1
        self.record = dict(noise_g2=g2, noise_trace=trace, b_simple=self.b_simple())

    def b_simple(self) -> Optional[float]:
        """tr(Σ)/|G|² of the moving averages; None before the first estimate or while the averaged |G|² is not
        positive."""
        if self.steps == 0 or self.g2_avg <= 0:
            return None
        return self.trace_avg / self.g2_avg

    def state_dict(self) -> dict[str, Any]:
        return dict(g2_avg=self.g2_avg, trace_avg=self.trace_avg, steps=self.steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.g2_avg, self.trace_avg, self.steps = state["g2_avg"], state["trace_avg"], state["steps"]

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
