"""CUDA correctness: races, state leaks and hangs of the GPU paths (issue 19), shown on the CPU where they can be (a
recorded asynchronous copy, a 1-rank or 2-rank gloo group, a simulated out-of-memory) and `cuda`-marked where only
a GPU can show them (`pytest -m cuda`; they skip without one)."""
import datetime
import os
import queue
import socket
import sys

import pytest
import torch
import torch.distributed as torch_dist
from conftest import (
    OOM,
    OOM_MODEL,
    TINY,
    TINY_DATA,
    assert_one_line_error,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    run_cli,
    run_of,
    train_here,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accutrain import dist
from accutrain.config.targets import instantiate
from accutrain.core import grad_buffers
from accutrain.core import loss as core_loss
from accutrain.core.grad_buffers import GradBuffers
from accutrain.core.losses.cross_entropy import make_loss
from accutrain.core.options import Normalize
from accutrain.core.precision import make_precision
from accutrain.core.step import accumulate
from accutrain.dist import World
from accutrain.errors import UserError
from accutrain.models import norms
from accutrain.runtime import launch, workers
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train import auto_batch, check
from accutrain.train import build as build_module
from accutrain.train.build import build
from accutrain.train.check import components_for_check, run_check
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog

CPU = torch.device("cpu")

# Two BatchNorm layers (2-D: a trial step of 1 sample runs) and dropout; a training forward runs out of memory above
# `limit` samples, and a backward above `backward_limit` once it reaches the body (the head's gradients are then
# already in .grad, the BatchNorm statistics updated) — except in float64 on the CPU, where accutrain-check's
# fallback reference goes.
BN_MODEL = '''
import torch
import torch.nn as nn


class Tight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, limit):
        ctx.oom = x.shape[0] > limit and x.dtype != torch.float64
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.oom:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, in backward)")
        return grad, None


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, image_size, limit=10**9, backward_limit=10**9, dropout=0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                  nn.Dropout(dropout))
        self.head = nn.Sequential(nn.Linear(4 * image_size ** 2, 16), nn.ReLU(), nn.Linear(16, num_classes))
        self.limit, self.backward_limit = limit, backward_limit

    def forward(self, x):
        if self.training and x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: {x.shape[0]} > {self.limit})")
        return self.head(Tight.apply(self.body(x), self.backward_limit))
'''
BN = [*TINY_DATA, "model=custom", "model._target_=bnmodel.Net"]


@pytest.fixture
def bn_model(tmp_path, monkeypatch):
    (tmp_path / "bnmodel.py").write_text(BN_MODEL)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "bnmodel", raising=False)  # not another test's module of that name
    return tmp_path


@pytest.fixture
def oom_model(tmp_path, monkeypatch):
    (tmp_path / "oommodel.py").write_text(OOM_MODEL)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "oommodel", raising=False)
    return tmp_path


@pytest.fixture
def one_rank_group(tmp_path):
    """A real 1-rank gloo process group: SyncBatchNorm then tries its collectives (and refuses the CPU)."""
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    yield
    dist.leave_process_group()


@pytest.fixture
def ddp_takes_syncbatchnorm_on_the_cpu(monkeypatch):
    """DDP refuses SyncBatchNorm on the CPU at construction; these tests build the components, never train."""
    monkeypatch.setattr(DistributedDataParallel, "_passing_sync_batchnorm_handle", lambda self, module: None)


def cfg_of(*overrides):
    return run_of(*overrides)


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --- 1. offload_grads: the asynchronous copy back to the device --------------------------------------------------
class AsyncCopies:
    """Tensor.to(..., non_blocking=True) as CUDA runs it from pinned memory: queued, reading its source when the
    stream gets there; an event (grad_buffers.copies_done) waits for what was queued before it."""

    def __init__(self, monkeypatch):
        self.pending = []
        real_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            out = real_to(tensor, *args, **{**kwargs, "non_blocking": False})
            if kwargs.get("non_blocking") and out.data_ptr() != tensor.data_ptr():
                out.fill_(float("nan"))  # not copied yet
                self.pending.append((tensor, out))
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(grad_buffers, "copies_done", lambda device: self)

    def run_stream(self) -> None:
        for source, out in self.pending:
            out.copy_(source)
        self.pending.clear()

    synchronize = run_stream  # the event's wait: everything queued before it has run


def test_offloaded_gradients_are_not_overwritten_before_their_copy_has_read_them(monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    unused = nn.Parameter(torch.ones(2))
    xs = [torch.randn(3, 6) for _ in range(4)]
    window_1 = [sum(torch.autograd.grad(net(x).sum(), p)[0] for x in xs[:2]) for p in net.parameters()]
    buffers = GradBuffers([*net.parameters(), unused], None, offload=True)
    copies = AsyncCopies(monkeypatch)
    for x in xs[:2]:
        net(x).sum().backward()
    buffers.release()  # the copies back to the device are queued, not done
    handed_back = [p.grad for p in net.parameters()]  # what the optimizer step (queued after them) reads
    net.zero_grad(set_to_none=True)
    net(xs[2]).sum().backward()  # the next window's first micro-batch writes the same pinned buffers
    copies.run_stream()  # the stream reaches the copies only now
    for got, want in zip(handed_back, window_1):
        torch.testing.assert_close(got, want)
    assert unused.grad is None  # no gradient in the window: none handed back, as without buffers


def test_abandoned_window_leaves_nothing_in_the_buffers():
    net = nn.Linear(4, 2)
    buffers = GradBuffers(list(net.parameters()), torch.float32, offload=False)
    net(torch.ones(2, 4)).sum().backward()
    buffers.clear()  # an out-of-memory abandoned that window
    x = torch.randn(3, 4)
    net(x).sum().backward()
    buffers.release()
    torch.testing.assert_close(net.weight.grad, torch.autograd.grad(net(x).sum(), net.weight)[0])


@pytest.mark.cuda
def test_offload_release_survives_a_busy_stream():
    net = nn.Linear(2048, 2048, bias=False).cuda()
    x = torch.randn(256, 2048, device="cuda")
    expected = torch.autograd.grad(net(x).sum(), net.weight)[0]
    buffers = GradBuffers([net.weight], None, offload=True)
    assert buffers.buffers[net.weight].is_pinned()
    net(x).sum().backward()
    torch.cuda._sleep(200_000_000)  # the stream is busy: the copy back queues behind this
    buffers.release()
    handed_back = net.weight.grad
    net.zero_grad(set_to_none=True)
    net(x).sum().backward()  # the next window writes the pinned buffer while the copy may still be queued
    torch.cuda.synchronize()
    torch.testing.assert_close(handed_back, expected)


# --- 2. micro_batch=auto with gradient buffers ----------------------------------------------------------------
BF16_FP32 = [*OOM, "trainer.precision=bf16-true", "trainer.accum_dtype=float32", "optim=adamw"]


def test_auto_search_with_gradient_buffers_leaves_the_first_step_exact(oom_model):
    auto, log = train_here(oom_model, "runs/auto", *BF16_FP32, "micro_batch=auto", "global_batch=32",
                           "trainer.memory_budget_mb=1000000", "trainer.max_steps=1")
    assert "16: does not fit" in log and "micro_batch 8 × accum 4" in log
    plain, _ = train_here(oom_model, "plain", *BF16_FP32, "micro_batch=8", "accum=4", "trainer.max_steps=1")
    assert_same_weights(final_weights(auto), final_weights(plain))  # the trials' gradients went nowhere


def test_the_trial_step_holds_the_buffers_and_allocates_the_optimizer_state(oom_model, monkeypatch):
    seen = {"state": [], "released": 0}
    real_step, real_release = torch.optim.AdamW.step, GradBuffers.release

    def step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        seen["state"].append(len(self.state))
        return out

    def release(self):
        seen["released"] += 1
        return real_release(self)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(GradBuffers, "release", release)
    c = build(run_of(*BF16_FP32, "micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1000000"),
              World(), CPU)
    trials = len(seen["state"])  # 1, 2, 4, 8 fit; 16 runs out of memory in forward, before any step
    assert trials == 4 and seen["released"] == trials
    assert all(n == len(list(c.model.parameters())) for n in seen["state"])  # Adam's moments were allocated
    assert not c.optimizer.state and all(p.grad is None for p in c.model.parameters())


# --- 3, 6, 7. SyncBatchNorm: the check, the frozen layers, the search ------------------------------------------
def test_check_runs_on_a_syncbatchnorm_model_in_one_rank_alone(bn_model, one_rank_group):
    cfg = cfg_of(*BN, "micro_batch=8", "accum=2")
    plain = run_check(build(cfg, World(), CPU))
    c = build(cfg, World(), CPU)
    nn.SyncBatchNorm.convert_sync_batchnorm(c.model)  # as a run with devices > 1 has it
    before = state_of(c.model)
    result = run_check(c)  # no collective with ranks that are not in it, and no "expected input on GPU"
    assert result.overall == pytest.approx(plain.overall, rel=1e-6) and result.causes == plain.causes
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in c.model.modules()) == 2  # put back
    assert_same_state(state_of(c.model), before)


def test_check_takes_syncbatchnorm_statistics_over_every_devices_micro_batch(bn_model):
    args = [*BN, "devices=2", "micro_batch=8", "accum=1"]
    synced = run_check(components_for_check(run_of(*args, "batchnorm.sync=true")))
    assert synced.faithful  # SyncBatchNorm over 2 × 8 = the window: exact
    assert not run_check(components_for_check(run_of(*args))).faithful


def test_frozen_batchnorm_stays_frozen_under_sync_batchnorm(bn_model, one_rank_group,
                                                            ddp_takes_syncbatchnorm_on_the_cpu):
    c = build(run_of(*BN, "micro_batch=8", "accum=2", "batchnorm.convert=frozen", "batchnorm.sync=true"),
              World(0, 2, 0), CPU)
    c.model.train()
    layers = norms.batchnorm_layers(c.model)
    assert len(layers) == 2 and not any(bn.training for _, bn in layers)
    assert not any(isinstance(bn, nn.SyncBatchNorm) for _, bn in layers)  # eval mode: nothing to synchronise


def test_the_search_runs_before_syncbatchnorm(bn_model, one_rank_group, ddp_takes_syncbatchnorm_on_the_cpu,
                                              monkeypatch):
    seen = []
    real = build_module.auto_micro_batch

    def spy(cfg, model, *args, **kwargs):
        seen.append(any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()))
        return real(cfg, model, *args, **kwargs)

    monkeypatch.setattr(build_module, "auto_micro_batch", spy)
    c = build(run_of(*BN, "micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1000000",
                     "batchnorm.sync=true", "+model.limit=4"), World(0, 2, 0), CPU)
    assert seen == [False] and c.plan.micro_batch == 4  # no trial ran a collective
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in c.model.modules()) == 2


# --- 4. the check leaves the run as it was, also when its reference runs out of memory ---------------------------
def test_a_check_whose_reference_runs_out_of_memory_leaves_the_model_untouched(bn_model, monkeypatch):
    c = build(run_of(*BN, "micro_batch=8", "accum=4", "+model.backward_limit=8"), World(), CPU)
    before = state_of(c.model)
    copied = []
    for kind in (torch.Tensor, nn.Parameter):
        real = kind.__deepcopy__
        monkeypatch.setattr(kind, "__deepcopy__", lambda t, memo, real=real: copied.append(t) or real(t, memo))
    result = run_check(c)
    assert "the CPU in float64" in result.lines()[0]
    assert not copied  # the fallback copy is made from CPU copies: nothing is duplicated on the device
    assert all(p.grad is None for p in c.model.parameters())
    assert_same_state(state_of(c.model), before)  # BatchNorm statistics included


def test_the_first_window_starts_from_zero_gradients(tmp_path):
    def one_step(dirty):
        c = build(run_of(*TINY, "data.size=64", "micro_batch=8", "accum=4", "trainer.max_steps=1"), World(), CPU)
        if dirty:  # what a check that failed halfway could leave
            for p in c.model.parameters():
                p.grad = torch.full_like(p, 100.0)
        metrics = MetricsLog(tmp_path / f"{dirty}.jsonl")
        with StopRequest() as stop:
            fit(c, metrics, Progress(), lambda *a, **k: None, stop)
        metrics.close()
        return state_of(c.model)

    assert_same_state(one_step(True), one_step(False))


@pytest.mark.cuda
def test_the_check_fallback_takes_no_device_memory(bn_model, monkeypatch):
    c = build(run_of(*BN, "micro_batch=8", "accum=4", "+model.backward_limit=8", "trainer.device=cuda"),
              World(), torch.device("cuda"))
    grown = []
    real_copy = check.cpu_copy

    def measured(model, dtype):
        torch.cuda.synchronize()
        now = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = real_copy(model, dtype)
        grown.append(torch.cuda.max_memory_allocated() - now)
        return out

    monkeypatch.setattr(check, "cpu_copy", measured)
    before = state_of(c.model)
    assert "the CPU in float64" in run_check(c).lines()[0]
    assert grown and grown[0] == 0
    assert_same_state(state_of(c.model), before)


# --- 5. trainer.deterministic ------------------------------------------------------------------------------------
def test_deterministic_sets_cuda_settings_before_the_run_and_restores_them(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen = {}
    real = launch.train_rank

    def spy(world, cfg, run_dir, device):
        seen.update(cublas=os.environ.get("CUBLAS_WORKSPACE_CONFIG"), cudnn=torch.backends.cudnn.deterministic,
                    benchmark=torch.backends.cudnn.benchmark, algorithms=torch.are_deterministic_algorithms_enabled(),
                    warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
        return real(world, cfg, run_dir, device)

    monkeypatch.setattr(launch, "train_rank", spy)
    train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=1", "trainer.deterministic=true")
    assert seen == dict(cublas=":4096:8", cudnn=True, benchmark=False, algorithms=True, warn_only=True)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.cuda
@pytest.mark.parametrize("model", [[*TINY_DATA, "model=cnn", "model.channels=[8,16]", "model.dropout=0.2"],
                                   ["data=sequences", "data.size=150", "data.val_size=20", "data.max_length=16",
                                    "model=char_lm", "model.hidden=32", "loss.normalize=elements"]])
def test_deterministic_resume_on_cuda_is_bit_identical(tmp_path, model):
    args = [*model, "micro_batch=8", "accum=2", "trainer.epochs=2", "trainer.device=cuda", "trainer.progress=false",
            "trainer.deterministic=true", "trainer.checkpoint_every=3", "trainer.keep_checkpoints=50",
            "optim=adamw"]
    reference, _ = train_here(tmp_path, "reference", *args)
    resumed, log = train_here(tmp_path, "resumed", *args,
                              f"resume={reference / 'checkpoints' / 'step-00000006.pt'}")
    assert "at optimizer step 6" in log
    a, b = final_weights(reference), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 8. micro_batch=auto's cache across ranks ---------------------------------------------------------------------
@pytest.mark.parametrize("rank0_cached, here_cached", [(None, 4), (4, None)])
def test_every_rank_follows_rank_zeros_cache_answer(tmp_path, monkeypatch, rank0_cached, here_cached):
    """Rank 1 of 2, whose node-local run directory answers otherwise than rank 0's (the collectives recorded)."""
    joined = []
    monkeypatch.setattr(auto_batch, "read_cache", lambda path, key: here_cached)
    monkeypatch.setattr(dist, "broadcast_from_main", lambda obj, world: rank0_cached)
    monkeypatch.setattr(dist, "all_reduce_min", lambda t, world: joined.append(int(t)) or t)
    cfg = cfg_of(*TINY, "data.size=64", "micro_batch=auto", "global_batch=32", "trainer.memory_budget_mb=1000000")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    found = auto_batch.auto_micro_batch(cfg, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        make_precision("32", CPU), instantiate("data", cfg.data), CPU, World(1, 2, 1),
                                        make_loss(Normalize.samples, -100), tmp_path)
    if rank0_cached is None:  # rank 0 searches: so does this rank, and it joins the all-reduce of the answers
        assert found == 16 and joined == [16]
    else:  # rank 0 takes its cached answer: so does this rank, and nobody searches
        assert found == 4 and joined == []


# --- 9. TF32 inside the check ------------------------------------------------------------------------------------
def tf32_settings():
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        return b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision
    return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32


def test_check_turns_tf32_off_inside_and_restores_it(monkeypatch):
    inside = []
    monkeypatch.setattr(core_loss, "accumulate",  # the accumulated window and the reference both run through it
                        lambda *a, **k: (inside.append(tf32_settings()), accumulate(*a, **k))[1])
    before = tf32_settings()
    result = run_check(components_for_check(run_of(*TINY, "micro_batch=8", "accum=4")))
    assert result.faithful and len(inside) == 2
    assert set(inside) == {("ieee", "ieee", "ieee") if len(before) == 3 else (False, False)}
    assert tf32_settings() == before


def tf32_as(on):
    """What tf32_settings() reads inside trainer.tf32=on (True, False)."""
    three = hasattr(torch.backends.cudnn, "conv")
    return ("tf32" if on else "ieee",) * 3 if three else (on, on)


@pytest.mark.parametrize("tf32", [True, False, None])
def test_tf32_is_set_for_the_run_and_restored(tmp_path, monkeypatch, tf32):
    seen, real = [], launch.train_rank

    def spy(world, cfg, run_dir, device):
        seen.append(tf32_settings())
        return real(world, cfg, run_dir, device)

    monkeypatch.setattr(launch, "train_rank", spy)
    before = tf32_settings()
    value = "null" if tf32 is None else str(tf32).lower()
    _, log = train_here(tmp_path, "run", *TINY, "data.size=40", "trainer.max_steps=1", f"trainer.tf32={value}")
    assert seen == [before if tf32 is None else tf32_as(tf32)] and tf32_settings() == before
    assert ("changes nothing on the CPU (TF32 is a CUDA format)" in log) == (tf32 is not None)


def test_a_spawned_worker_sets_tf32_in_its_own_process(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")  # the worker sets them: restored afterwards
    threads, before = torch.get_num_threads(), tf32_settings()
    results = queue.SimpleQueue()
    job = workers._Job(1, 0, queue.SimpleQueue(), results, None, threads, lambda world: tf32_settings(), tf32=False)
    workers._worker(0, job)
    assert results.get() == tf32_as(False) and tf32_settings() == before


def test_tf32_takes_a_boolean_or_null(tmp_path):
    assert_one_line_error(run_cli("trainer.tf32=fast", cwd=tmp_path, check=False), "trainer.tf32")


@pytest.mark.cuda
def test_check_calls_a_faithful_conv_net_faithful_with_tf32_on(monkeypatch):
    b = torch.backends
    if hasattr(b.cudnn, "conv"):
        for setting in (b.cuda.matmul, b.cudnn.conv):
            monkeypatch.setattr(setting, "fp32_precision", "tf32")
    else:
        monkeypatch.setattr(b.cuda.matmul, "allow_tf32", True)
        monkeypatch.setattr(b.cudnn, "allow_tf32", True)
    before = tf32_settings()
    result = run_check(components_for_check(run_of(*TINY_DATA, "model=cnn", "model.channels=[32,64]",
                                                   "micro_batch=8", "accum=4", "trainer.device=cuda")))
    assert result.faithful, "\n".join(result.lines())
    assert tf32_settings() == before


# --- 10. process groups, LOCAL_RANK, the patient wait, the re-split's note --------------------------------------
def test_process_group_binds_the_device_and_a_patient_group(monkeypatch):
    monkeypatch.setattr(dist, "_patient_group", None)
    calls = []
    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_dist, "init_process_group", lambda *a, **k: calls.append(("init", a, k)))
    monkeypatch.setattr(torch_dist, "new_group", lambda **k: calls.append(("group", k)) or "patient")
    monkeypatch.setattr(torch_dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    dist.init_process_group(World(0, 2, 0), torch.device("cuda", 0), 3600)
    dist.wait_for_main(World(0, 2, 0))
    assert calls[0] == ("init", ("nccl",), dict(rank=0, world_size=2, device_id=torch.device("cuda", 0)))
    assert calls[1] == ("group", dict(backend="gloo", timeout=datetime.timedelta(seconds=3600)))
    assert calls[2] == ("group", dict(backend="gloo"))  # the stop votes' host-side group (beside NCCL's)
    assert calls[3] == ("barrier", "patient")


@pytest.mark.parametrize("fails", [False, True])
def test_torchrun_rank_leaves_its_process_group(tmp_path, monkeypatch, fails):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(key, "0")
    monkeypatch.setenv("WORLD_SIZE", "1")

    def rank(world, cfg, run_dir, device):
        torch_dist.init_process_group("gloo", rank=0, world_size=1)
        if fails:
            raise RuntimeError("boom")

    monkeypatch.setattr(launch, "train_rank", rank)
    try:
        launch.train(cfg_of(*TINY), tmp_path)
    except RuntimeError:
        assert fails
    assert not torch_dist.is_initialized()




def test_dist_timeout_must_be_positive(tmp_path):
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *TINY, "trainer.dist_timeout_s=0")
    assert_one_line_user_error(info.value, "trainer.dist_timeout_s=0")


def test_the_resplit_says_what_ran_twice(bn_model):
    run_dir, log = train_here(bn_model, "run", *BN, "data.size=64", "micro_batch=32", "accum=1",
                              "trainer.max_steps=1", "+model.limit=16", "+model.dropout=0.1")
    assert "re-split into 2 micro-batches" in log
    assert "BatchNorm's running statistics take those samples in twice" in log and "dropout draws new masks" in log


# --- 11. the GRU with a zero-sample micro-batch on cuDNN ----------------------------------------------------------
@pytest.mark.cuda
def test_gru_takes_a_zero_sample_micro_batch_on_cudnn():
    from accutrain.models.factories import char_lm

    torch.manual_seed(0)
    model = char_lm(vocab_size=12, num_classes=12, embedding=8, hidden=16).cuda()
    tokens = torch.randint(1, 12, (5, 9))
    targets = torch.randint(0, 12, (5, 9))
    empty = (tokens[:0], targets[:0])
    assert torch.backends.cudnn.enabled
    accumulate(model, [(tokens, targets), empty], 45, torch.device("cuda"))  # a rank's short-window share
    with_empty = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    accumulate(model, [(tokens, targets)], 45, torch.device("cuda"))
    for n, p in model.named_parameters():
        torch.testing.assert_close(with_empty[n], p.grad, msg=n)
