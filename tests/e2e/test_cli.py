"""Through the real `accutrain` console script: what a run writes and shows, plug-ins from the working directory,
one-line errors with exit code 2, Hydra's refusals, --help."""
import csv
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import (
    TINY,
    TINY_DATA,
    WAIT_S,
    assert_one_line_error,
    assert_one_line_user_error,
    final_weights,
    read_metrics,
    run_cli,
    train_here,
    train_run,
)

import accutrain
from accutrain.errors import UserError
from accutrain.train.metrics import summary_lines


def test_the_summary_says_tokens_per_second_when_the_terms_are_tokens():
    lines = summary_lines(10, 100, 80, 2.0, 1.5, None, 512.0, session_tokens=5000, median_per_s=55.0)
    assert lines == ["done: 10 optimizer steps, 100 samples seen in 2.0 s: 40 samples/s (2500 tokens/s) overall, 55 at "
                     "the median step", "last loss 1.5000, peak memory 512 MiB"]
    assert "tokens/s" not in " ".join(summary_lines(10, 100, 80, 2.0, 1.5, None))


def test_the_closing_lines_fit_a_terminal_and_give_the_summary_tables_figures(tmp_path):
    """The speed at the median step and the noise scale are those accutrain-report gives for the run, and no closing
    line is wider than a terminal of 120 columns."""
    run_dir, proc = train_run(tmp_path, "run", *TINY, "micro_batch=8", "accum=4", "trainer.noise_scale=true")
    report = run_cli(str(run_dir), cwd=tmp_path, script="accutrain-report").stdout
    closing = proc.stderr.splitlines()[-4:]
    assert all(len(line) <= 120 for line in closing), closing
    median = re.search(r", (\d+) at the median step$", closing[0]).group(1)
    with open(run_dir / "summary.csv", newline="") as f:
        assert f"{float(next(csv.DictReader(f))['samples_per_s']):.0f}" == median
    noise = re.search(r"noise scale B_simple ≈ (\S+) late in training", closing[2]).group(1)
    assert f"measured noise scale B_simple ≈ {noise} late in training" in report


@pytest.mark.quick
def test_a_run_writes_its_outputs_into_the_run_directory(tmp_path):
    run_dir, proc = train_run(tmp_path, "run", *TINY, "data.size=100", "micro_batch=10", "accum=2",
                              "trainer.max_steps=7", "trainer.eval_every=3")
    log = proc.stderr
    assert "effective batch 20 = micro_batch 10 × accum 2 × devices 1" in log
    assert "5 optimizer steps per epoch (5 windows of 20), 7 in total over 2 epochs" in log
    assert "done: 7 optimizer steps, 140 samples seen in" in log and "tokens/s" not in log  # samples are the terms
    assert (run_dir / "train.log").read_text().count("effective batch 20") == 1
    assert "micro_batch: 10" in (run_dir / "config.yaml").read_text()

    steps, evals = read_metrics(run_dir)
    assert len(steps) == 7
    for key in ("step", "epoch", "loss", "samples", "micro_batches", "lr", "grad_norm", "samples_per_s"):
        assert key in steps[0], key
    assert [r["epoch"] for r in steps] == [1] * 5 + [2] * 2
    assert [e["step"] for e in evals] == [3, 6, 7]  # every 3 steps, and at the end
    assert all(0 <= e["val_acc"] <= 1 and e["val_loss"] > 0 for e in evals)

    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "step", "config"} <= ckpt.keys()
    assert ckpt["step"] == 7 and ckpt["config"]["micro_batch"] == 10


def test_progress_bar_counts_optimizer_steps_and_stays_short_in_a_log(tmp_path):
    run_dir, proc = train_run(tmp_path, "run", *TINY, "trainer.progress=true", "data.size=400", "micro_batch=4", "accum=5",
                        "trainer.epochs=3")
    bar_lines = [line for line in proc.stderr.splitlines() if "step/s" in line or "?step" in line]
    assert 1 <= len(bar_lines) <= 4, proc.stderr  # the first and last states, not one line per refresh
    assert "60/60" in bar_lines[-1]  # 3 epochs × 20 optimizer steps, not 300 micro-batches
    assert sum("60/60" in line for line in bar_lines) == 1, proc.stderr  # the end, said once
    last = read_metrics(run_dir)[0][-1]
    assert f"loss={last['loss']:.4f}," in bar_lines[-1], proc.stderr  # the last step's, not a stale one


def test_custom_model_from_the_working_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch.nn as nn\n"
        "def net(num_classes, in_channels, image_size, width=16):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, width), nn.ReLU(),\n"
        "                         nn.Linear(width, num_classes))\n")
    run_dir, proc = train_run(tmp_path, "custom", *TINY_DATA, "model=custom", "model._target_=mymodels.net",
                              "+model.width=5", "trainer.max_steps=2")
    assert final_weights(run_dir)["1.weight"].shape == (5, 64)


@pytest.mark.parametrize("args, fragments", [
    (["micro_batch=0"], ["micro_batch=0", "positive integer"]),
    (["data=imagefolder", "data.root=/nonexistent/images"], ["/nonexistent/images", "train/"]),
])
@pytest.mark.quick
def test_user_errors_end_in_one_line(tmp_path, args, fragments):
    _, proc = train_run(tmp_path, "err", *args, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["micro_batch=abc"], ["micro_batch='abc'", "positive integer"]),
    (["accum=2.5"], ["accum=2.5", "positive integer"]),
    (["global_batch=100", "micro_batch=8"], ["global_batch=100", "micro_batch 8 × devices 1 = 8"]),
    (["global_batch=64", "micro_batch=8", "accum=4"], ["accum=4 contradicts global_batch=64"]),
    (["model=torchvision", "model.name=resnet19"], ["model.name='resnet19'", "resnet18"]),
    (["data=cifar10", "data.root=/nonexistent/cifar"], ["/nonexistent/cifar", "data.download=true"]),
    (["devices=0"], ["devices=0", "positive integer or auto"]),
    (["trainer.device=cuda"], ["trainer.device=cuda", "no CUDA device"]),
])
def test_user_errors_are_one_line(tmp_path, args, fragments):
    if "trainer.device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "err", *args)
    assert_one_line_user_error(info.value, *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["model=resnet19"], ["model=resnet19", "did you mean model=resnet18?", "the options are: char_lm, cnn,"]),
    (["trainer.epochs=abc"], ["trainer.epochs=abc is not valid: expected an integer or null"]),
    (["+trainer.epoch=3"], ["+trainer.epoch=3", "no key 'epoch'", "did you mean trainer.epochs?"]),
])
def test_config_mistakes_hydra_would_catch_are_one_line_and_exit_2(tmp_path, args, fragments):
    _, proc = train_run(tmp_path, "err", *args, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, *fragments)
    assert "_schema" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not (tmp_path / "err").exists()  # refused before anything was written


@pytest.mark.quick
def test_help_lists_the_config_groups_and_version_is_accutrains(tmp_path):
    out = run_cli("--help", cwd=tmp_path).stdout
    for group in ("model:", "data:", "optim:", "sched:", "debug:"):
        assert group in out
    assert "resnet18" in out and "digits" in out
    assert "_schema" not in out and "powered by Hydra" not in out and out.startswith("accutrain 0.1.0")
    assert not (tmp_path / "outputs").exists()  # asking for help writes nothing
    assert run_cli("--version", cwd=tmp_path).stdout.strip() == f"accutrain {accutrain.__version__}"



def test_accutrain_check_help_is_its_own_short_and_flags_first(tmp_path):
    proc = run_cli("--help", cwd=tmp_path, script="accutrain-check")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: accutrain-check [--show-sample[=N]] [key=value ...]")
    assert lines[2].lstrip().startswith("--show-sample[=N]") and any("-h, --help" in line for line in lines[:6])
    assert len(lines) <= 25 and "exit code 0: faithful; 1: not" in proc.stdout.lower()
    assert "sweep" not in proc.stdout and "config groups (" not in proc.stdout  # not accutrain's help renamed
    assert run_cli("-h", cwd=tmp_path, script="accutrain-check").stdout == proc.stdout

VALUE_MISTAKES = [
    (["micro_batch=8", "global_batch=100"], "global_batch=100 is not a multiple of micro_batch 8 × devices 1"),
    (["micro_batch=8", "devices=2", "global_batch=64", "accum=2"], "accum=2 contradicts global_batch=64"),
    (["micro_batch=0"], "micro_batch=0 is not valid"),
    (["trainer.grad_clip=-1"], "trainer.grad_clip=-1.0 is not valid"),
]


def test_value_mistakes_are_refused_before_pytorch_is_imported_and_leave_no_run_directory(tmp_path):
    """The command line's one owner of checking answers every value mistake, the batch arithmetic included, from the
    composed config alone: no PyTorch import (seconds), no run directory."""
    code = ("import json, sys\nfrom accutrain.cli import command\nfrom accutrain.errors import UserError\nout = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        command.check(argv)\n        out.append(None)\n"
            "    except UserError as e:\n        out.append(str(e))\n"
            "print(json.dumps([out, 'torch' in sys.modules]))")
    commands = [[*argv, f"hydra.run.dir={tmp_path / str(i)}"] for i, (argv, _) in enumerate(VALUE_MISTAKES)]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                          cwd=tmp_path)
    errors, torch_imported = json.loads(proc.stdout.strip().splitlines()[-1])
    for (argv, fragment), error in zip(VALUE_MISTAKES, errors):
        assert error is not None and fragment in error, (argv, error)
    assert not torch_imported
    assert not [p.name for p in tmp_path.iterdir() if p.name.isdigit()]  # no run directory was made


def test_a_batch_arithmetic_mistake_is_one_line_from_the_command_line(tmp_path):
    proc = run_cli("micro_batch=8", "global_batch=100", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
                   check=False)
    assert_one_line_error(proc, "global_batch=100 is not a multiple of micro_batch 8 × devices 1 = 8")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()


def test_a_single_run_checks_its_values_once_and_composes_twice(tmp_path):
    """The command line owns the checking: launch trusts the values and ranks it checked (one validate, not three);
    Hydra composes the config once to run it, and not a third time to read its mode."""
    code = ("import sys\nfrom accutrain.cli import main as cli\nfrom accutrain.config import validate as module\n"
            "from hydra._internal.hydra import Hydra\ncalls, composed = [], []\n"
            "module.validate = lambda cfg, real=module.validate: (calls.append(1), real(cfg))[1]\n"
            "Hydra.compose_config = lambda *a, real=Hydra.compose_config, **k: (composed.append(1), real(*a, **k))[1]\n"
            "sys.argv = ['accutrain', *sys.argv[1:]]\ncli.main()\nprint('validated', len(calls), 'composed', "
            "len(composed))")
    proc = subprocess.run([sys.executable, "-c", code, *TINY, "trainer.max_steps=1", "trainer.progress=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "validated 1 composed 2"


@pytest.mark.slow
@pytest.mark.parametrize("imported", ["hydra", "torch"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, imported):
    """Issue 32: Ctrl-C while the command imports Hydra and PyTorch or composes the config printed the traceback of
    whatever it landed in (64 lines), or a confused config error from a library interrupted halfway. The signal comes
    once `imported` has been imported (Python's -X importtime lines say when), whatever the machine's load."""
    import os
    import signal

    from conftest import ONE_THREAD, cli_command

    proc = subprocess.Popen([*cli_command(), *TINY, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **ONE_THREAD, "PYTHONPROFILEIMPORTTIME": "1"})
    for line in proc.stdout:
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip() == imported:
            break
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=WAIT_S)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    said = [line for line in output.splitlines() if not line.startswith("import time:")]
    assert said == ["accutrain: interrupted while starting: nothing was trained"], output


SLOW_DATA = """
import pathlib, time

def make(**arguments):
    pathlib.Path("building").touch()
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["launching 2 worker processes", "building"])
def test_ctrl_c_while_the_workers_start_is_one_line_and_leaves_nothing(tmp_path, when):
    """Issue 44: Ctrl-C (to the whole process group, as a terminal sends it) while devices=2's workers start — the
    fork server forking them, a rank making its data — printed a worker's traceback (one forked for a command that
    was gone), was lost (the ranks ignored it until they trained) or hung (a rank's KeyboardInterrupt ended it with
    exit code 0, its peer waiting for it). Now one line, exit 130, nothing of the run left (it had not taken its
    directory over) and no process of the command's."""
    import os
    import signal
    import time

    from conftest import ONE_THREAD, WAIT_S, cli_command

    (tmp_path / "slowdata.py").write_text(SLOW_DATA)
    data = ["data=custom", "data._target_=slowdata.make"] if when == "building" else []
    proc = subprocess.Popen([*cli_command(), *TINY, "devices=2", *data, f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **ONE_THREAD}, start_new_session=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if ("run directory" if when == "building" else when) in line:
            break
    deadline = time.monotonic() + WAIT_S
    while when == "building" and not (tmp_path / "building").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    output = "".join(lines) + proc.communicate(timeout=WAIT_S)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "Traceback" not in output and output.strip().endswith(
        "error: interrupted: stopped at once, without a checkpoint"), output
    assert not (tmp_path / "run").exists()
    while time.monotonic() < deadline:  # the workers and the fork server die with the command
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a process of the command outlived it")
