"""Issue 16, speed: one host–device synchronisation per optimizer step, metrics.jsonl written in batches yet whole at
every checkpoint, peak memory read cheaply, glibc's allocator tuned without changing a bit, and trainer.compile
(exact to float tolerance, at most 2 graphs with a short tail, with AMP, activation checkpointing, DDP's no_sync and
accutrain-check). The compile tests use the aot_eager backend (dynamo and AOT autograd, no code generation): the
same graphs and recompilations as inductor, in seconds on a CPU."""
import dataclasses
import mmap
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as torch_dist
from conftest import (
    TINY,
    TINY_DATA,
    assert_one_line_user_error,
    assert_same_weights,
    final_weights,
    read_metrics,
    run_of,
    train_here,
    train_run,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from accutrain import dist
from accutrain.config.validate import validate
from accutrain.core import compiled
from accutrain.core.step import accumulate
from accutrain.dist import World
from accutrain.parallel.strategy import Strategy
from accutrain.runtime import malloc, session
from accutrain.signals import StopRequest
from accutrain.store.progress import Progress
from accutrain.train import memory
from accutrain.train.build import build
from accutrain.train.check import components_for_check, run_check
from accutrain.train.loop import fit
from accutrain.train.metrics import MetricsLog
from accutrain.train.steplog import StepLog

AOT = ["trainer.compile=true", "trainer.compile_backend=aot_eager"]


# Reads of host data, which never wait for a device: the sampler's indices, the elements counted from the samples'
# (host-side) targets before the first backward (core/terms.py, and loss.count_terms in what it calls).
HOST_FILES, HOST_FUNCTIONS = ("windows.py", "terms.py"), ("count_terms",)


def reads_a_computed_value() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(HOST_FILES) or frame.f_code.co_name in HOST_FUNCTIONS:
            return False
        frame = frame.f_back
    return True


class CountHostReads(TorchDispatchMode):
    """Counts what would make the host wait for the device: .item() and the like (aten._local_scalar_dense) and
    .tolist() (patched in by the test) of a computed value. On the CPU nothing waits; on a GPU each would
    (tests/cuda/test_cuda_paths.py counts them with CUDA's own sync debug mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and reads_a_computed_value():
            self.reads += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("extra", [["trainer.grad_clip=1.0", "trainer.precision=16-mixed"],
                                   ["loss.normalize=elements", "trainer.ema=0.9"]])
def test_one_read_of_the_device_per_optimizer_step_none_per_micro_batch(tmp_path, monkeypatch, extra):
    counter, reads_at_start, per_step = CountHostReads(), [], []
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counter.reads += reads_a_computed_value()
        return tolist(self)

    start, record = StepLog.start, StepLog.__call__

    def start_counting(self):
        reads_at_start.append(counter.reads)
        start(self)

    def record_counted(self, *args):
        record(self, *args)
        per_step.append(counter.reads - reads_at_start[-1])  # from the window's start to its record written

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(StepLog, "start", start_counting)
    monkeypatch.setattr(StepLog, "__call__", record_counted)
    with counter:
        run_dir, _ = train_here(tmp_path, "run", *TINY, "micro_batch=8", "accum=4", "trainer.epochs=1",
                                "trainer.eval_every=1000", *extra)
    records, _ = read_metrics(run_dir)
    assert len(records) == 10 and per_step == [1] * 10, per_step  # settle's one packed read: loss, norm, flags


def test_every_step_up_to_a_checkpoint_is_in_metrics_jsonl_when_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(MetricsLog, "FLUSH_RECORDS", 10**9)  # only checkpoints, evaluations and the end flush
    monkeypatch.setattr(MetricsLog, "FLUSH_S", 1e9)
    seen = []
    save = session.Checkpoints.__call__

    def save_and_look(self, p, best=False):
        records, _ = read_metrics(self.rotation.directory.parent)
        seen.append((p.step, [r["step"] for r in records]))
        return save(self, p, best)

    monkeypatch.setattr(session.Checkpoints, "__call__", save_and_look)
    run_dir, _ = train_here(tmp_path, "run", *TINY, "micro_batch=8", "accum=4", "trainer.checkpoint_every=3",
                            "trainer.eval_every=1000")
    # every 3 steps and at each epoch's end (step 10: trainer.checkpoint_minutes' default); the last: best.pt, step-20
    assert [step for step, _ in seen] == [3, 6, 9, 10, 12, 15, 18, 20, 20]
    assert all(on_disk == list(range(1, step + 1)) for step, on_disk in seen), seen
    records, _ = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 21))


def test_metrics_are_buffered_between_flushes(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.step({"step": 1, "loss": 1.0})
    assert (tmp_path / "m.jsonl").read_text() == ""  # not one write per step
    log.evaluation({"step": 1, "val_acc": 0.5})  # an evaluation writes what is pending, then itself
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 2
    log.step({"step": 2, "loss": 1.0})
    log.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 3


def peak_rss_around_a_block() -> tuple[float, float, float]:
    """(peak before, with and after a 256 MiB block), each read after a reset but the one with the block."""
    size = 256 * 2**20
    memory.reset_peak(torch.device("cpu"))
    base = memory.peak_mb(torch.device("cpu"))
    block = mmap.mmap(-1, size)  # anonymous memory, returned to the OS on close whatever malloc does
    block.write(b"\1" * size)
    high = memory.peak_mb(torch.device("cpu"))
    block.close()
    memory.reset_peak(torch.device("cpu"))
    after = memory.peak_mb(torch.device("cpu"))
    return base, high, after


def test_peak_rss_follows_a_reset():
    base, high, after = peak_rss_around_a_block()
    assert high - base >= 250 and high - after >= 200, (base, high, after)


def test_a_forked_process_resets_and_reads_its_own_peak():
    """A worker forked from the fork server (accutrain.runtime.launch) measures itself, not the server whose /proc files
    it inherited."""
    memory.peak_mb(torch.device("cpu"))  # the /proc files open in this process
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it (never pytest's own exit path)
        try:
            base, high, after = peak_rss_around_a_block()
            os._exit(0 if high - base >= 250 and high - after >= 200 else 3)
        except BaseException:
            os._exit(4)
    assert os.waitpid(pid, 0)[1] >> 8 == 0


# --- glibc's allocator ---------------------------------------------------------------------------------------
FAULTS = """
import ctypes, resource, sys
from accutrain.runtime.malloc import tune_malloc
if sys.argv[1] == "tuned":
    print(tune_malloc(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):  # a micro-batch's activations: allocated, touched, freed
    blocks = [libc.malloc(4 << 20) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in reversed(blocks):
        libc.free(b)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(malloc.glibc_version() is None, reason="glibc only")
def test_tuned_malloc_keeps_freed_blocks_instead_of_faulting_them_in_again():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], capture_output=True, text=True, env=env,
                                      check=True).stdout) for how in ("untuned", "tuned")}
    assert faults["untuned"] > 40 * 4 * 1000 and faults["tuned"] < faults["untuned"] / 10, faults


def test_a_users_own_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert "left to them" in malloc.tune_malloc()


@pytest.mark.skipif(malloc.glibc_version() is None, reason="glibc only")
def test_tuning_malloc_changes_no_bit_of_the_weights(tmp_path):
    args = [*TINY, "micro_batch=4", "accum=4", "trainer.epochs=1"]
    tuned, log = train_here(tmp_path, "tuned", *args)  # this process: tuned by its first run, if not before
    untuned, proc = train_run(tmp_path, "untuned", *args, "trainer.tune_malloc=false")  # a fresh process: untuned
    assert "mmap and trim thresholds raised to 1 GiB" in log and "glibc" not in proc.stderr + proc.stdout
    for key, value in final_weights(tuned).items():
        assert torch.equal(value, final_weights(untuned)[key]), key


# --- trainer.compile -----------------------------------------------------------------------------------------
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()  # every test compiles from nothing: graphs counted, recompile limits untouched
    yield
    torch._dynamo.reset()


def test_compiled_accumulation_is_the_big_batch_with_at_most_two_graphs(tmp_path, fresh_dynamo):
    short_tail = [*TINY, "data.size=117", "trainer.epochs=2"]  # windows of 32, 32, 32 and 21 = 8 + 8 + 5
    accumulated, log = train_here(tmp_path, "accum4", *short_tail, *AOT, "micro_batch=8", "accum=4")
    assert compiled.WATCH.graphs == 2, log  # full micro-batches, then one dynamic graph from the tail of 5 on
    assert "torch.compile: 2 graph(s) compiled so far" in log
    torch._dynamo.reset()  # a run is a process: nothing compiled before it
    big, log = train_here(tmp_path, "accum1", *short_tail, *AOT, "micro_batch=32", "accum=1")
    assert compiled.WATCH.graphs == 2, log
    eager, _ = train_here(tmp_path, "eager", *short_tail, "micro_batch=8", "accum=4")
    assert_same_weights(final_weights(accumulated), final_weights(big))
    assert_same_weights(final_weights(accumulated), final_weights(eager))


def test_a_compile_that_compiles_nothing_is_said(tmp_path, fresh_dynamo):
    """Seen on PyTorch 2.11: nn.Module.compile of a torch.nn-only model ran eagerly, silently. accutrain's own
    compile traces such a model (the test above: debug=fast's mlp is an nn.Sequential of torch layers); if dynamo
    still skips, the log says so after the first step."""
    with torch.compiler.set_stance("force_eager"):  # dynamo skips every frame, as it did there
        _, log = train_here(tmp_path, "eager", *TINY, "data.size=40", "trainer.max_steps=2", *AOT)
    assert compiled.WATCH.graphs == 0 and "torch.compile compiled nothing in the first optimizer step" in log


def test_a_second_run_in_one_process_reuses_the_graphs_and_says_nothing(tmp_path, fresh_dynamo):
    """A Hydra multirun's jobs share one process: the second compiles nothing new (dynamo reuses the first's graphs for
    the same code) and still runs compiled, so no warning."""
    train_here(tmp_path, "first", *TINY, "data.size=40", "trainer.max_steps=2", *AOT)
    _, log = train_here(tmp_path, "second", *TINY, "data.size=40", "trainer.max_steps=2", *AOT)
    assert compiled.WATCH.graphs == 0 and compiled.WATCH.runs_graphs
    assert "compiled nothing" not in log


def test_micro_batches_of_one_or_no_sample_compile_nothing(fresh_dynamo):
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    compiled.compile_model(model, None, "aot_eager")
    batches = [(torch.randn(n, 1, 8, 8), torch.randint(0, 10, (n,))) for n in (8, 8, 5, 1, 0, 3, 1)]
    accumulate(model, batches, 26, torch.device("cpu"))
    assert compiled.WATCH.graphs == 2


def test_compile_with_activation_checkpointing_and_autocast_matches_eager(tmp_path, fresh_dynamo):
    args = [*TINY_DATA, "model=cnn", "model.channels=[4,8]", "micro_batch=8", "accum=2", "trainer.max_steps=4",
            "trainer.activation_checkpointing=true", "trainer.precision=bf16-mixed"]
    compiled_run, log = train_here(tmp_path, "compiled", *args, *AOT)
    assert "activation checkpointing" in log and compiled.WATCH.graphs == 1
    eager_run, _ = train_here(tmp_path, "eager", *args)
    for key, value in final_weights(compiled_run).items():
        torch.testing.assert_close(value, final_weights(eager_run)[key], rtol=5e-2, atol=5e-3, msg=key)


def test_accutrain_check_runs_on_a_compiled_model(compose, fresh_dynamo):
    result = run_check(components_for_check(run_of(*TINY, *AOT, "micro_batch=4", "accum=4")))
    assert result.faithful, result.lines()


def test_ddp_around_the_compiled_model_still_reduces_once_per_step(tmp_path, compose, fresh_dynamo):
    """DDP wraps the model compiled in place (as build does with devices > 1), here in a real 1-rank gloo group:
    no_sync keeps the gradient all-reduce to the window's last micro-batch."""
    if torch_dist.is_initialized():  # a group another test of this worker process left behind
        torch_dist.destroy_process_group()
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    try:
        c = build(run_of(*TINY, *AOT, "data.size=117", "trainer.epochs=1", "micro_batch=8", "accum=4"), World(),
                  torch.device("cpu"))
        strategy = Strategy(World(0, 2), torch.device("cpu"))  # wraps as with 2 devices; the group has 1 rank
        c = dataclasses.replace(c, wrapped=strategy.wrap(c.model), strategy=strategy)
        assert isinstance(c.wrapped, DistributedDataParallel)
        metrics = MetricsLog(tmp_path / "metrics.jsonl")
        with StopRequest() as stop:
            fit(c, metrics, Progress(), lambda *a, **k: None, stop)
        metrics.close()
    finally:
        dist.leave_process_group()
    records, _ = read_metrics(tmp_path)
    assert [r["grad_syncs"] for r in records] == [1] * 4  # windows of 4, 4, 4 and 3 micro-batches
    assert compiled.WATCH.graphs == 2


@pytest.mark.parametrize("overrides, fragments", [
    (["trainer.compile_mode=fastest"], ["trainer.compile_mode=fastest", "max-autotune"]),
    (["trainer.compile_mode=max-autotune"], ["trainer.compile_mode=max-autotune cannot be combined with "
                                             "trainer.compile=false", "does nothing without trainer.compile=true"]),
    (["trainer.compile=true", "trainer.compile_backend=nope"], ["trainer.compile_backend=nope", "inductor"]),
    ([*AOT, "trainer.compile_mode=max-autotune"], ["inductor backend"]),
    ([*AOT, "strategy=fsdp", "devices=2"], ["strategy=fsdp cannot be combined with trainer.compile=true"]),
])
def test_impossible_compile_settings_are_one_line(compose, overrides, fragments):
    with pytest.raises(Exception) as e:
        validate(compose(*TINY, *overrides))
    assert_one_line_user_error(e.value, *fragments)
