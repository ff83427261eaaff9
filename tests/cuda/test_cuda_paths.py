"""The CUDA paths not covered by tests/cuda/test_cuda_correctness.py, each against a real GPU (`pytest -m cuda`, run by
scripts/gpu_check.sh; they skip without one): precision modes and 16-mixed's overflow, accum_dtype, offload_grads,
micro_batch=auto and the out-of-memory re-split against a real out-of-memory, activation checkpointing, compile,
pinned-memory loading, peak_mem_mb from the CUDA allocator, and one host–device synchronisation per step."""
import warnings

import pytest
import torch
from conftest import TINY_DATA, final_weights, read_metrics, run_of, train_here

from accutrain.core import compiled
from accutrain.core.precision import full_float32, tolerance
from accutrain.dist import World
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train.auto_batch import divisors
from accutrain.train.build import build
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog
from accutrain.train.steplog import StepLog

pytestmark = pytest.mark.cuda
GPU = ["trainer.device=cuda", "trainer.deterministic=true"]
# Exact under accumulation (no BatchNorm, no dropout), big enough for the GPU to matter; a short tail (117 samples).
EXACT = [*TINY_DATA, "model=cnn", "model.channels=[16,32]", "data.size=117", "data.image_size=16", "trainer.epochs=2",
         "optim.weight_decay=1e-3", *GPU]
CUDA = torch.device("cuda")


def close(a, b, rtol):
    for key in a:
        torch.testing.assert_close(a[key].float().cpu(), b[key].float().cpu(), rtol=rtol, atol=rtol * 0.1,
                                   msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_precision_keeps_the_accumulation_equivalence_on_cuda(tmp_path, precision):
    acc, _ = train_here(tmp_path, "acc", *EXACT, f"trainer.precision={precision}", "micro_batch=8", "accum=4")
    big, _ = train_here(tmp_path, "big", *EXACT, f"trainer.precision={precision}", "micro_batch=32")
    close(final_weights(acc), final_weights(big), tolerance(precision) * (4 if precision == "bf16-true" else 1))


def test_16_mixed_overflow_skips_the_step_and_halves_the_scale_on_cuda(tmp_path, compose):
    r = build(run_of(*EXACT, "micro_batch=8", "accum=2", "trainer.epochs=4", "trainer.precision=16-mixed"),
              World(), CUDA)  # 32 steps of 16 samples
    r.precision.scaler._init_scale = 2.0 ** 32  # fp16 gradients overflow until the scale has come down (< 2^16)
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    with StopRequest() as stop:
        fit(r, metrics, Progress(), lambda *a, **k: None, stop)
    metrics.close()
    records, _ = read_metrics(tmp_path)
    skipped = [rec for rec in records if rec.get("skipped") == "amp_overflow"]
    assert records[0]["skipped"] == "amp_overflow" and 1 <= len(skipped) < len(records), len(skipped)
    scales = [rec["amp_scale"] for rec in records]
    assert scales[0] == 2.0 ** 31 and scales == sorted(scales, reverse=True)


def test_float32_buffers_for_bf16_weights_on_cuda(tmp_path):
    # That the buffers sum more exactly than bf16 .grad is test_memory's (on this GPU too); here the run uses them.
    args = [*EXACT, "trainer.precision=bf16-true", "micro_batch=4", "accum=8"]
    buffered, log = train_here(tmp_path, "buffered", *args, "trainer.accum_dtype=float32")
    assert "gradients accumulate in float32 buffers" in log
    fp32, _ = train_here(tmp_path, "fp32", *EXACT, "micro_batch=32")
    close(final_weights(buffered), final_weights(fp32), tolerance("bf16-true"))


def test_offloaded_gradients_give_the_same_weights_on_cuda(tmp_path):
    offloaded, log = train_here(tmp_path, "offloaded", *EXACT, "micro_batch=8", "accum=4", "trainer.offload_grads=true")
    assert "pinned CPU memory" in log
    on_gpu, _ = train_here(tmp_path, "on_gpu", *EXACT, "micro_batch=8", "accum=4")
    close(final_weights(offloaded), final_weights(on_gpu), 1e-5)


def fill_gpu_but(free_mb: int) -> torch.Tensor:
    """Hold all but `free_mb` MiB of the GPU, so that a real out-of-memory comes early."""
    torch.cuda.empty_cache()  # blocks this process's allocator keeps would be free to it, yet not counted free
    free, _ = torch.cuda.mem_get_info()
    assert free > (free_mb + 1024) * 2**20, f"only {free / 2**20:.0f} MiB of the GPU free before holding"
    hold = torch.empty(free - free_mb * 2**20, dtype=torch.uint8, device=CUDA)
    assert torch.cuda.mem_get_info()[0] < (free_mb + 256) * 2**20
    return hold


def test_micro_batch_auto_finds_the_largest_that_really_fits(tmp_path, compose):
    big = [*TINY_DATA, "model=resnet18", "data.image_size=64", "data.size=256", *GPU, "global_batch=256",
           "micro_batch=auto", "trainer.max_steps=1"]
    hold = fill_gpu_but(1500)
    try:
        r = build(run_of(*big), World(), CUDA, cache_dir=tmp_path)
        chosen = r.plan.micro_batch
        larger = [d for d in divisors(256) if d > chosen]
        run_dir, log = train_here(tmp_path, "chosen", *big[:-3], f"micro_batch={chosen}", "accum=1",
                                  "trainer.max_steps=1", f"global_batch={chosen}")  # a real step fits
        assert "out of memory" not in log
        if larger:  # the next candidate really does not fit
            with pytest.raises(torch.OutOfMemoryError):
                rb = build(run_of(*big[:-3], f"micro_batch={larger[0]}", "trainer.max_steps=1"), World(), CUDA)
                x = torch.randn(larger[0], 3, 64, 64, device=CUDA)
                rb.model(x).sum().backward()
                rb.optimizer.step()
    finally:
        del hold
        torch.cuda.empty_cache()


def test_the_out_of_memory_resplit_on_cuda_gives_the_same_weights(tmp_path):
    """A window of 64 that does not fit is re-split (into 32s, and 16s if those do not fit either; on an H100 both
    happened): the weights must be the big batch's — the abandoned attempts' partial gradients dropped — as close
    to the 32 × 2 run as another exact split (4 × 16) is: float32 sums over 128² pixels in other orders, and
    cuDNN's algorithms under memory pressure, differ by ~1e-4."""
    args = [*TINY_DATA, "model=resnet18", "data.image_size=128", "data.size=64", *GPU, "trainer.max_steps=2",
            "batchnorm.convert=group"]
    with full_float32():  # TF32 convolutions (cuDNN's default) would differ by more than the re-split's rounding
        halves, _ = train_here(tmp_path, "halves", *args, "micro_batch=32", "accum=2")
        quarters, _ = train_here(tmp_path, "quarters", *args, "micro_batch=4", "accum=16")
        # What micro-batches of 4 took, and 10 %: weights, gradients, momentum and 4 samples' activations fit, 64
        # samples' do not (cuDNN picks algorithms with less workspace when memory is short: 2× was found to fit 64)
        hold = fill_gpu_but(int(1.1 * read_metrics(quarters)[0][-1]["peak_mem_mb"]))
        try:
            resplit, log = train_here(tmp_path, "resplit", *args, "micro_batch=64", "accum=1")
        finally:
            del hold
            torch.cuda.empty_cache()
    assert "out of memory with micro-batches of 64" in log

    def gap(a, b):
        return max((a[k] - b[k]).abs().max().item() for k in a)

    halves, quarters, resplit = final_weights(halves), final_weights(quarters), final_weights(resplit)
    assert gap(resplit, halves) <= 2 * gap(quarters, halves) + 1e-6, (gap(resplit, halves), gap(quarters, halves))


def test_activation_checkpointing_on_cuda_saves_memory_and_changes_nothing(tmp_path):
    args = [*TINY_DATA, "model=resnet18", "batchnorm.convert=group", "data.image_size=64", "data.size=64", *GPU,
            "micro_batch=32", "accum=2", "trainer.max_steps=2"]
    plain, _ = train_here(tmp_path, "plain", *args)
    ckpt, log = train_here(tmp_path, "ckpt", *args, "trainer.activation_checkpointing=true")
    assert "activation checkpointing" in log
    assert read_metrics(ckpt)[0][-1]["peak_mem_mb"] < read_metrics(plain)[0][-1]["peak_mem_mb"]
    close(final_weights(ckpt), final_weights(plain), 1e-5)


@pytest.mark.parametrize("extra", [[], ["trainer.precision=16-mixed"], ["trainer.activation_checkpointing=true"]])
def test_compile_on_cuda_is_exact_with_at_most_two_graphs(tmp_path, extra):
    torch._dynamo.reset()
    args = [*EXACT, "trainer.compile=true", *extra]
    acc, log = train_here(tmp_path, "acc", *args, "micro_batch=8", "accum=4")
    assert 1 <= compiled.WATCH.graphs <= 2 and "s compiling" in log
    torch._dynamo.reset()
    big, _ = train_here(tmp_path, "big", *args, "micro_batch=32")
    precision = next((e.split("=")[1] for e in extra if "precision" in e), "32")
    close(final_weights(acc), final_weights(big), tolerance(precision))


def test_batches_arrive_in_pinned_memory_and_train_as_on_the_cpu(tmp_path, compose):
    r = build(run_of(*EXACT, "micro_batch=8", "accum=4"), World(), CUDA)
    assert r.loader.pin_memory
    _, batch = next(iter(r.loader))
    assert batch.inputs.is_pinned() and batch.target.is_pinned()
    with full_float32():  # cuDNN's convolutions default to TF32, which the CPU has not
        gpu, _ = train_here(tmp_path, "gpu", *EXACT, "micro_batch=8", "accum=4")
    cpu, _ = train_here(tmp_path, "cpu", *[a for a in EXACT if a not in GPU], "micro_batch=8", "accum=4",
                        "trainer.device=cpu")
    close(final_weights(gpu), final_weights(cpu), 1e-3)  # other kernels' summation orders; a late copy is O(1)


def test_peak_mem_mb_is_the_cuda_allocators_peak(tmp_path):
    args = [*TINY_DATA, "model=resnet18", "data.image_size=64", "data.size=512", *GPU, "trainer.max_steps=3"]
    peak = {}
    for split in ("8 8", "8 1", "64 1"):
        micro, accum = split.split()
        run_dir, _ = train_here(tmp_path, split.replace(" ", "x"), *args, f"micro_batch={micro}", f"accum={accum}")
        peak[split] = read_metrics(run_dir)[0][-1]["peak_mem_mb"]
        assert 0 < peak[split] <= torch.cuda.get_device_properties(0).total_memory / 2**20
    assert peak["8 8"] <= 1.1 * peak["8 1"] < peak["64 1"], peak


def test_one_synchronisation_per_optimizer_step_on_cuda(tmp_path, monkeypatch):
    per_step, start, record = [], StepLog.start, StepLog.__call__
    caught: list = []

    def start_counting(self):
        per_step.append(len(caught))
        start(self)

    def record_counted(self, *args):
        record(self, *args)
        per_step[-1] = len(caught) - per_step[-1]

    monkeypatch.setattr(StepLog, "start", start_counting)
    monkeypatch.setattr(StepLog, "__call__", record_counted)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_here(tmp_path, "run", *EXACT, "micro_batch=8", "accum=4", "trainer.grad_clip=1.0",
                       "trainer.eval_every=1000", "trainer.epochs=1")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert per_step == [1] * 4, per_step
