"""`accutrain resume=auto hydra.run.dir=DIR` with only the run directory (accutrain.cli.recorded): the run goes on as
it was started, an override on the resume line is applied and named, and a change its checkpoints cannot take is one
line, before PyTorch is imported."""
import json
import subprocess
import sys

import pytest
from conftest import (
    COMMAND_S,
    RUN,
    assert_identical,
    assert_one_line_error,
    final_weights,
    killed_at_step,
    read_metrics,
    run_cli,
    train_here,
)


@pytest.mark.slow
def test_a_resume_with_only_the_run_directory_continues_the_run_as_started(slow):
    tmp_path = slow
    run_dir = killed_at_step(tmp_path, "run", 5, *RUN)
    proc = run_cli("resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    notice = next(line for line in proc.stderr.splitlines() if "notice: resume=auto" in line)
    assert f"continues {run_dir} as it was started ({' '.join(RUN)}, from {run_dir}/.hydra/overrides.yaml)" in notice
    uninterrupted, _ = train_here(tmp_path, "uninterrupted", *RUN)
    assert_identical(final_weights(run_dir), final_weights(uninterrupted))  # the same run, bit for bit

    more = run_cli("resume=auto", f"hydra.run.dir={run_dir}", "trainer.epochs=4", cwd=tmp_path)
    assert "changed on this command line: trainer.epochs=4 (was trainer.epochs=3)" in more.stderr
    steps, _ = read_metrics(run_dir)
    assert steps[-1]["step"] == 16 and steps[-1]["epoch"] == 4  # 4 windows per epoch (117 samples), a 4th epoch
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run started with overrides: debug=fast, micro_batch 8 × accum 4, optim=adamw, seed 3."""
    tmp_path = tmp_path_factory.mktemp("recorded")
    run_cli("debug=fast", "micro_batch=8", "accum=4", "optim=adamw", "seed=3", "trainer.max_steps=2",
            f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    return tmp_path / "run"


CHECK_ALONE = """
import sys
from accutrain.cli.command import check
from accutrain.errors import UserError, one_line
try:
    check(sys.argv[1:])
except UserError as e:
    print(one_line(e))
print("torch imported" if "torch" in sys.modules else "torch not imported")
"""


@pytest.mark.xdist_group("test_recorded-finished_run")  # one worker builds the module's finished_run once
@pytest.mark.parametrize("change, says", [
    ("model=cnn", "was trained with model=mlp; this command line gives model=cnn: resuming needs the same model"),
    ("optim=sgd", "was trained with optim=adamw; this command line gives optim=sgd: resuming needs the same optim"),
    ("seed=0", "was trained with seed=3; this command line gives seed=0: resuming needs the same seed"),
    ("micro_batch=16", "was trained with effective batch 32 (micro_batch 8 × accum 4 × devices 1); micro_batch=16 "
                       "makes it 64: resuming needs the same effective batch"),
    ("accum=2", "effective batch 32 (micro_batch 8 × accum 4 × devices 1); accum=2 makes it 16"),
])
def test_a_change_the_checkpoints_cannot_take_is_one_line_before_pytorch(finished_run, change, says):
    resume = ["resume=auto", f"hydra.run.dir={finished_run}", change]
    alone = subprocess.run([sys.executable, "-c", CHECK_ALONE, *resume], capture_output=True, text=True, check=True)
    assert says in alone.stdout and "drop " + change in alone.stdout, alone.stdout
    assert alone.stdout.strip().endswith("torch not imported")  # answered in the command line's check, at once
    proc = run_cli(*resume, cwd=finished_run.parent, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, says, "or choose a new hydra.run.dir")


@pytest.mark.xdist_group("test_recorded-finished_run")  # one worker builds the module's finished_run once
def test_a_change_that_keeps_the_windows_resumes(finished_run):
    """micro_batch=16 accum=2: the same effective batch, cut otherwise; nothing is left to train after 2 steps."""
    proc = run_cli("resume=auto", f"hydra.run.dir={finished_run}", "micro_batch=16", "accum=2", cwd=finished_run.parent)
    assert "changed on this command line: micro_batch=16 (was micro_batch=8), accum=2 (was accum=4)" in proc.stderr


@pytest.mark.slow
def test_a_run_of_a_torchrun_world_is_resumed_on_as_many_ranks(tmp_path):
    """The effective batch a run trained with is its status.json's plan: under torchrun, devices left at 1 meant the
    world's 2 ranks. One process is refused with the remedy; devices=2 resumes it."""
    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                    "accutrain", "debug=fast", "trainer.max_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                   capture_output=True, text=True, check=True, timeout=COMMAND_S)
    alone = run_cli("resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert alone.returncode == 2
    assert_one_line_error(alone, "was trained with effective batch 64 (micro_batch 32 × accum 1 × devices 2); this "
                                 "command makes it 32", "devices=2")
    spawned = run_cli("resume=auto", f"hydra.run.dir={run_dir}", "devices=2", "trainer.max_steps=3", cwd=tmp_path)
    assert "resumed from" in spawned.stderr and read_metrics(run_dir)[0][-1]["step"] == 3


def test_a_run_killed_before_its_plan_is_refused_not_filled_with_the_default_run(tmp_path):
    """SIGKILL after the directory's mark, before Hydra's record (.hydra/overrides.yaml): resume=auto with only the
    directory has no run to continue, and says what to type instead of training the default config there."""
    from accutrain.store import mark

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mark.write_new(run_dir, "run")  # what the killed command left: its mark alone
    before = sorted(p.name for p in run_dir.iterdir())
    proc = run_cli("resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"resume=auto: {run_dir} holds no run plan (.hydra/overrides.yaml",
                          f"start that run again with its own overrides, accutrain <overrides> hydra.run.dir={run_dir}")
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written, nothing trained
