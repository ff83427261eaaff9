"""Never lose a run, part 3: checkpoints form a history. A resume from an earlier checkpoint starts a branch (the
later checkpoints are moved aside, kept, and never outrank the live branch); resume=auto takes the newest good
checkpoint of the live branch, last.pt included; corrupt checkpoints never outrank good ones; a checkpoint without
RNG states, another data.seed and another precision are each one line."""
import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    RUN,
    TINY,
    TINY_DATA,
    WAIT_S,
    assert_identical,
    assert_one_line_user_error,
    final_weights,
    read_metrics,
    start,
    train_here,
    train_run,
)

from accutrain.errors import UserError

# debug=fast's 300 samples in windows of 32: 10 optimizer steps an epoch, 20 in all; dropout, so an RNG state not
# restored would show.
TWENTY = [*TINY_DATA, "model=custom", "model._target_=slow.Net", "micro_batch=8", "accum=4", "optim=adamw"]


def loss_lines(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0


@pytest.mark.slow
def test_a_resume_from_an_earlier_checkpoint_starts_a_branch_that_resume_auto_continues(slow):
    """Issue 32, item 3: checkpoints at steps 10, 15, 20; a resume from step 10 with another learning rate,
    SIGKILLed at step 13, then resume=auto: it continues the branch (not the first run's step 20), and ends with the
    weights of the branch never interrupted (step 12 or 13: step k is logged once checkpoint k-1 is on disk). The first run's later checkpoints and records are kept, aside."""
    run = slow / "run"
    train_here(slow, "run", *TWENTY, "trainer.checkpoint_every=5")
    first = {r["step"]: r for r in read_metrics(run)[0]}
    step10 = run / "checkpoints" / "step-00000010.pt"
    branch = [*TWENTY, "optim.lr=0.01", "trainer.checkpoint_every=1"]
    reference, _ = train_here(slow, "reference", *branch, f"resume={step10}")

    proc = start(slow, "run", *branch, f"resume={step10}", "+model.delay=0.03")
    deadline = time.monotonic() + WAIT_S
    while not 13 <= loss_lines(run) < 20:  # the resume trims the first run's 20 records to 10, then steps 11, 12, …
        assert proc.poll() is None and time.monotonic() < deadline, (slow / "run.log").read_text()
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL

    resumed, out = train_run(slow, "run", *branch, "resume=auto")
    found = re.search(r"resumed from (\S+) at optimizer step (\d+)", out.stderr)
    assert found and Path(found[1]).parent == run / "checkpoints" and 12 <= int(found[2]) < 20, out.stderr
    assert_identical(final_weights(resumed), final_weights(reference))
    steps = read_metrics(resumed)[0]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert [r["loss"] for r in steps] == [first[s]["loss"] for s in range(1, 11)] + [
        r["loss"] for r in read_metrics(reference)[0]]  # (the reference logged steps 11–20)
    aside = sorted((run / "checkpoints").glob("abandoned-*"))
    assert len(aside) == 1, sorted(p.name for p in (run / "checkpoints").iterdir())
    assert {"step-00000015.pt", "step-00000020.pt", "last.pt"} <= {p.name for p in aside[0].iterdir()}
    old_end = torch.load(aside[0] / "step-00000020.pt", weights_only=True)
    assert old_end["config"]["optim"]["lr"] != 0.01  # the first run's end, kept aside, is not the branch's
    assert any(not torch.equal(old_end["model"][k], v) for k, v in final_weights(resumed).items())
    kept = [json.loads(line) for line in (aside[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in kept if "loss" in r] == [first[s]["loss"] for s in range(11, 21)]
    top = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert top == ["step-00000018.pt", "step-00000019.pt", "step-00000020.pt"]  # the branch's, rotated as usual


def rewound(run_dir: Path, step: int) -> Path:
    """A finished run made to look killed after optimizer step `step` (checkpoint_every=1): its later checkpoints
    and records dropped; last.pt a file of its own holding step `step` (as where hard links fail)."""
    ckpts = run_dir / "checkpoints"
    for path in ckpts.glob("step-*.pt"):
        if int(path.stem.split("-")[1]) > step:
            path.unlink()
    (ckpts / "last.pt").unlink()
    (ckpts / "last.pt").write_bytes((ckpts / f"step-{step:08d}.pt").read_bytes())
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line).get("step", 0) <= step))
    return ckpts


def corrupt(path: Path) -> None:
    """Another file in its place (a copy gone wrong): last.pt, once its hard link, keeps the good one."""
    path.unlink()
    path.write_bytes(b"PK\x03\x04 not a whole checkpoint")


def test_a_good_last_pt_is_used_when_every_step_checkpoint_is_corrupt(slow):
    """Item 9: resume=auto used to start from scratch here (deleting metrics.jsonl) as soon as every step file failed
    to load; last.pt is a checkpoint of the live branch too."""
    reference, _ = train_here(slow, "reference", *RUN)
    train_here(slow, "run", *RUN, "trainer.keep_checkpoints=20")
    ckpts = rewound(slow / "run", 6)
    history = (slow / "run" / "metrics.jsonl").read_bytes()
    for path in ckpts.glob("step-*.pt"):
        corrupt(path)
    resumed, log = train_here(slow, "run", *RUN, "resume=auto")
    assert f"resumed from {ckpts / 'last.pt'} at optimizer step 6" in log
    assert (resumed / "metrics.jsonl").read_bytes().startswith(history)  # steps 1–6 as they were written
    assert_identical(final_weights(resumed), final_weights(reference))
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000010.pt", "step-00000011.pt",
                                                            "step-00000012.pt"]


def test_corrupt_checkpoints_never_outrank_the_new_ones(tmp_path):
    """Item 9: every checkpoint corrupt, last.pt too: resume=auto starts from scratch, and the corrupt ones (steps
    4–6) are moved aside with the records of the run that wrote them — they used to stay on top of the rotation,
    so each new checkpoint was pruned as soon as it was written."""
    args = [*TINY, "data.size=40", "micro_batch=8", "trainer.checkpoint_every=1"]
    run_dir, _ = train_here(tmp_path, "run", *args, "trainer.max_steps=6")
    ckpts = run_dir / "checkpoints"
    for path in [*ckpts.glob("step-*.pt"), ckpts / "last.pt"]:
        corrupt(path)
    _, log = train_here(tmp_path, "run", *args, "trainer.max_steps=3", "resume=auto")
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000001.pt", "step-00000002.pt",
                                                            "step-00000003.pt"]
    assert "starting from scratch" in log and "moved to" in log
    assert torch.load(ckpts / "last.pt", weights_only=True)["step"] == 3
    aside = next(ckpts.glob("abandoned-*"))
    assert {"step-00000004.pt", "step-00000005.pt", "step-00000006.pt", "last.pt"} <= {p.name for p in aside.iterdir()}
    assert [r["step"] for r in map(json.loads, (aside / "metrics.jsonl").read_text().splitlines()) if "loss" in r] == [
        1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3]


QUICK = [*TINY, "data.size=40", "micro_batch=8"]


def test_a_checkpoint_without_rng_states_resumes_saying_so(tmp_path):
    """From the issue's tracebacks: `rng` missing was a KeyError; the data order needs no RNG state, so the run
    resumes, saying in one line that dropout and augmentation draw new numbers."""
    run_dir, _ = train_here(tmp_path, "run", *QUICK, "trainer.max_steps=2")
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    del state["rng"]
    torch.save(state, tmp_path / "no-rng.pt")
    resumed, log = train_here(tmp_path, "resumed", *QUICK, "trainer.max_steps=4", f"resume={tmp_path / 'no-rng.pt'}")
    assert "no-rng.pt holds no RNG states: dropout and augmentation draw new random numbers" in log
    assert [r["step"] for r in read_metrics(resumed)[0]] == [3, 4]
    del state["plan"]
    torch.save(state, tmp_path / "no-plan.pt")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "refused", *QUICK, f"resume={tmp_path / 'no-plan.pt'}")
    assert_one_line_user_error(info.value, "no-plan.pt is not a whole accutrain checkpoint: it holds no plan")


def test_another_data_seed_is_refused_and_another_precision_said(tmp_path):
    """From the issue's silent list: data.seed decides the data (here the generated samples), so a resume with
    another continued on other data; another precision is allowed and now named."""
    run_dir, _ = train_here(tmp_path, "run", *QUICK, "trainer.max_steps=2")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "refused", *QUICK, "data.seed=5", f"resume={run_dir}")
    assert_one_line_user_error(info.value, "was trained with data.seed=0; this run has data.seed=5",
                               "resuming needs the same data.seed (data.seed=0)")
    _, log = train_here(tmp_path, "bf16", *QUICK, "trainer.max_steps=3", "trainer.precision=bf16-mixed",
                        f"resume={run_dir}")
    assert "resuming with trainer.precision=bf16-mixed" in log and "was trained with trainer.precision=32" in log


def test_a_resume_with_another_learning_rate_follows_it_from_its_place_in_the_schedule(tmp_path):
    """Loading the optimizer and scheduler states used to bring back the checkpoint's learning rate and weight decay
    silently: the branch of item 3 (`optim.lr=0.01`) trained with the old rate, and config.yaml said otherwise."""
    args = [*QUICK, "trainer.max_steps=4", "sched=cosine"]
    whole, _ = train_here(tmp_path, "whole", *args)
    run_dir, _ = train_here(tmp_path, "run", *args, "trainer.checkpoint_every=2")
    _, log = train_here(tmp_path, "branch", *args, "optim.lr=0.5", "optim.weight_decay=0.01",
                        f"resume={run_dir / 'checkpoints' / 'step-00000002.pt'}")
    assert "resuming with optimizer settings other than those" in log
    assert "(weight_decay 0.0005 → 0.01, lr 0.05 → 0.5): this run's config applies from here" in log
    lrs = {r["step"]: r["lr"] for r in read_metrics(whole)[0]}
    branch = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "branch")[0]}
    assert branch == {s: pytest.approx(lrs[s] * 10) for s in (3, 4)}  # the same place in the cosine, 10 × the rate


def test_overwrite_deletes_the_abandoned_branches_too(tmp_path):
    """trainer.overwrite=true deletes what the earlier run wrote: the branches a resume moved aside are its too."""
    from accutrain.store import mark, rundir

    mark.write_new(tmp_path, "run")  # an earlier accutrain run's directory
    aside = tmp_path / "checkpoints" / "abandoned-20261125-101500"
    aside.mkdir(parents=True)
    (aside / "step-00000020.pt").write_bytes(b"old")
    (tmp_path / "checkpoints" / "mine.txt").write_text("a file of the user's own stays")
    assert "checkpoints/abandoned-20261125-101500/" in rundir.clear(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["mine.txt"]
