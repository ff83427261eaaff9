"""data.streaming=true: windows cut from a seeded shuffle buffer before micro-batches and ranks — the same windows
under any split or number of devices, each rank its share — every pass visiting each sample once, and a resume
that continues the stream where it stood, bit for bit."""
import json
import signal

import pytest
import torch
from conftest import (
    assert_identical,
    assert_one_line_user_error,
    final_weights,
    read_metrics,
    start,
    train_here,
    train_run,
    wait_for_steps,
)

from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.core.streams import StreamSampler
from accutrain.errors import UserError

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

CHATS = [{"messages": [{"role": "user", "content": f"{i} plus {i % 5}?" + " please" * (i % 4)},
                       {"role": "assistant", "content": f"{i + i % 5}."}]} for i in range(50)]
GPT2 = ["model=hf_causal_lm", "+model.config.model_type=gpt2", "+model.config.n_layer=1", "+model.config.n_head=2",
        "+model.config.n_embd=32", "+model.config.n_positions=128"]


def files(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[:6]))
    return ["data=hf", f"data.train={tmp_path / 'train.jsonl'}", f"data.val={tmp_path / 'val.jsonl'}",
            "data.streaming=true", "data.buffer_size=12", f"data.cache_dir={tmp_path / 'cache'}",
            "data.max_length=64", "trainer.epochs=null", "trainer.progress=false"]


class Numbers:
    """A stream of numbered samples, as core.streams.Source: its position is the next number."""

    def __init__(self, n):
        self.n, self.at = n, 0

    def open(self, state):
        self.at = state or 0

        def samples():
            while self.at < self.n:
                self.at += 1
                yield {"input_ids": torch.full((self.at % 5 + 2,), self.at - 1)}
        return samples()

    def state(self):
        return self.at


def windows(sampler, epoch=0):
    sampler.set_epoch(epoch)
    return [[int(s["input_ids"][0]) for m in w for s in m.items] for w in sampler.windows()]


def plan(micro_batch, accum, devices=1, last="step"):
    return make_plan(micro_batch=micro_batch, accum=accum, devices=devices, global_batch=None, train_size=None,
                     last_window=LastWindow(last), epochs=None, max_steps=100)


def test_windows_come_from_the_seeded_buffer_whatever_the_split_or_the_ranks():
    whole = windows(StreamSampler(plan(16, 1), Numbers(70), seed=3, buffer_size=10))
    assert [len(w) for w in whole] == [16, 16, 16, 16, 6]  # the pass's last window short (trainer.last_window)
    assert sorted(s for w in whole for s in w) == list(range(70))  # each sample once per pass
    assert [s for w in whole for s in w] != list(range(70))  # shuffled, within the buffer's reach
    assert all(max(w) < 16 * (k + 1) + 10 for k, w in enumerate(whole))  # read no further than the buffer reaches
    assert windows(StreamSampler(plan(4, 4), Numbers(70), seed=3, buffer_size=10)) == whole
    ranks = [StreamSampler(plan(4, 2, devices=2), Numbers(70), seed=3, buffer_size=10, rank=r, world=2)
             for r in (0, 1)]
    shares = [windows(s) for s in ranks]
    for w, mine, theirs in zip(whole, *shares):  # each rank its share, together the window
        assert sorted(mine + theirs) == sorted(w) and not set(mine) & set(theirs)
    assert windows(StreamSampler(plan(16, 1), Numbers(70), seed=3, buffer_size=10), epoch=1) != whole  # per pass
    assert windows(StreamSampler(plan(16, 1), Numbers(70), seed=4, buffer_size=10)) != whole  # per seed
    assert [len(w) for w in windows(StreamSampler(plan(16, 1, last="drop"), Numbers(70), 3, 10))] == [16] * 4


def test_the_stream_resumes_where_its_note_says(tmp_path):
    sampler = StreamSampler(plan(8, 1), Numbers(70), seed=3, buffer_size=10)
    whole = windows(sampler)
    sampler = StreamSampler(plan(8, 1), Numbers(70), seed=3, buffer_size=10)
    sampler.set_epoch(0)
    cut = sampler.windows()
    for _ in range(4):
        next(cut)
    note = sampler.state_dict(0, 3)  # where the stream stood before window 3
    torch.save(note, tmp_path / "note.pt")  # what a checkpoint holds, loaded as one is
    again = StreamSampler(plan(8, 1), Numbers(70), seed=3, buffer_size=10)
    again.load_state_dict(torch.load(tmp_path / "note.pt", weights_only=True))
    again.set_epoch(0, start_window=3)
    assert [[int(s["input_ids"][0]) for m in w for s in m.items] for w in again.windows()] == whole[3:]
    fresh = StreamSampler(plan(8, 1), Numbers(70), seed=3, buffer_size=10)
    fresh.set_epoch(0, start_window=3)
    with pytest.raises(UserError) as info:
        next(fresh.windows())
    assert_one_line_user_error(info.value, "resuming a stream at window 3 of pass 1 needs the checkpoint's note")


@pytest.mark.slow
def test_a_streamed_chat_run_takes_the_same_steps_under_any_split_and_devices(tmp_path):
    args = [*GPT2, "model.dropout=0", *files(tmp_path), "optim=sgd", "optim.lr=0.5", "optim.momentum=0",
            "trainer.max_steps=6"]
    big, log = train_here(tmp_path, "big", *args, "micro_batch=16")
    assert "a stream: 6 optimizer steps (trainer.max_steps) on windows of 16" in log
    assert "a pass over the stream ended: 50 records read" in log
    split, _ = train_here(tmp_path, "split", *args, "micro_batch=4", "accum=4")
    for key, value in final_weights(big).items():
        torch.testing.assert_close(final_weights(split)[key], value, rtol=1e-5, atol=1e-6)
    budget, _ = train_here(tmp_path, "budget", *args, "micro_tokens=128", "global_batch=16")
    two, _ = train_here(tmp_path, "two", *args, "devices=2", "micro_batch=4", "accum=2")  # every rank its share
    for run in (budget, two):
        for key, value in final_weights(big).items():
            torch.testing.assert_close(final_weights(run)[key], value, rtol=1e-5, atol=1e-6)
    assert [r["samples"] for r in read_metrics(big)[0]] == [16, 16, 16, 2, 16, 16]  # a pass: 16 + 16 + 16 + 2


@pytest.mark.slow
def test_a_streamed_run_killed_mid_pass_resumes_bit_identical(tmp_path):
    args = [*GPT2, "model.dropout=0.1", *files(tmp_path), "micro_batch=4", "accum=2", "trainer.max_steps=40",
            "trainer.checkpoint_every=1"]
    reference, _ = train_here(tmp_path, "reference", *args)
    proc = start(tmp_path, "killed", *args)
    wait_for_steps(tmp_path / "killed", 3, proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    resumed, out = train_run(tmp_path, "killed", *args, "resume=auto")
    assert "resumed from" in out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    assert [r["loss"] for r in read_metrics(resumed)[0]] == [r["loss"] for r in read_metrics(reference)[0]]
