"""The commands of the README and of the manual's pages (docs/*.md) work as printed: every command in their code
blocks (and in their inline code) is split into words by bash, as a user's shell would, and run — those that train
with small sizes appended — except the few listed in SKIPPED, each with its reason, from a folder holding a copy of
the repository's examples/ (the files the pages name). torchrun's commands and the cluster recipes run in
tests/e2e/test_recipes.py, with a simulated scheduler. docs/benchmarks.md is the record of measurements (benchmark
scripts of minutes, GPU runs), not a page of the manual: its commands are not run here. The quick start is also what
CI runs."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import COMMAND_S, ONE_THREAD
from docs_blocks import ROOT, all_commands, fenced_blocks, paged_commands, unknown_blocks, words

README = (ROOT / "README.md").read_text()

# Commands not run here, by how they begin, and why.
SKIPPED = {
    "pip install": "installs packages: CI runs the dev install, which has every extra "
                   "(test_ci_runs_the_readme_install_and_test_commands)",
    "pytest": "the test suite itself",
    "torchrun --nnodes 2": "needs several machines",
    "torchrun --standalone": "starts its own processes: tests/e2e/test_recipes.py runs it",
    "docker build": "builds an image (needs Docker and the network): tests/e2e/test_packaging.py builds and runs "
                    "accutrain from the files the Dockerfile copies",
    "accutrain data=cifar10": "downloads CIFAR-10: needs the internet",
    "accutrain -m hydra/launcher=slurm_gpu": "needs a SLURM cluster with GPUs",
    "accutrain -m hydra/launcher=slurm_multi": "needs a SLURM cluster with GPUs: tests/parallel/test_scheduler.py "
                                               "forms such worlds from SLURM's variables and submitit's local jobs",
    "accutrain -m hydra/launcher=joblib": "a pool of worker processes, each importing PyTorch anew: "
                                          "tests/report/test_sweeps.py::test_joblib_launcher_runs_jobs_in_parallel_and_"
                                          "writes_the_summary runs this launcher through the command line",
    "accutrain devices=8": "eight worker processes, a GPU machine's commands: tests/parallel/test_fsdp.py runs "
                           "strategy=fsdp "
                           "(sync=last, sharded checkpoints) with devices=2",
    "accutrain -m devices=1,2": "spawns worker processes again, as `accutrain devices=2 micro_batch=8 accum=2` above "
                                "(tests/parallel/test_ddp.py compares devices=2 with devices=1)",
    "python scripts/bench_memory.py": "a benchmark of minutes (its figures are in docs/memory.md)",
    "accutrain model=hf_causal_lm model.name_or_path=gpt2": "downloads GPT-2: needs the internet",
    "accutrain model=hf_seq_cls model.name_or_path=distilbert": "downloads DistilBERT: needs the internet",
    "accutrain model=hf_encoder model.name_or_path=BAAI": "downloads an embedding model: needs the internet (and a "
                                                          "GPU); tests/train/test_embeddings.py trains a tiny one",
    "tensorboard --logdir": "a web server: tests/report/test_trackers.py reads the event files with TensorBoard's "
                            "reader",
    "mlflow ui": "a web server: tests/report/test_trackers.py reads the runs back with MlflowClient",
}
# Appended to a command that trains, unless it chooses these itself: a few seconds in all, not the real run.
SHORT = ["trainer.max_steps=2", "trainer.progress=false"]
SMALL_MODEL = ["model=mlp", "model.hidden=[16]"]
SMALL_DATA = ["data=synthetic", "data.size=64", "data.val_size=16", "data.image_size=8", "data.channels=1"]
# An Optuna search runs this many trials here, whatever the command asks: each trial is one more run of the same code.
TRIALS = "hydra.sweeper.n_trials=3"

# Runs every command in one Python process (each as its console script would: accutrain.cli.main.main with sys.argv),
# so that the imports are paid once; records each one's exit code and what it printed on stderr.
DRIVER = """
import contextlib, io, json, os, shutil, sys, time
from accutrain.cli import main as cli, report as report_cli

def main(commands, out):
    entry = {"accutrain": cli.main, "accutrain-check": cli.check_main, "accutrain-report": report_cli.main}
    results = []
    for argv in commands:
        if argv[0] == "copy":
            os.makedirs(os.path.dirname(argv[2]), exist_ok=True)
            shutil.copy(argv[1], argv[2])
            continue
        sys.argv, err, start = list(argv), io.StringIO(), time.process_time()
        try:
            with contextlib.redirect_stderr(err):
                entry[argv[0]]()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        cpu = time.process_time() - start
        sys.stderr.write(f"=== exit {code}, {cpu:.1f} s CPU here: {' '.join(argv)}\\n{err.getvalue()[-3000:]}\\n")
        results.append({"exit": code, "stderr": err.getvalue()})
    with open(out, "w") as f:
        json.dump(results, f)

if __name__ == "__main__":  # not again in the worker processes that devices=2 spawns
    main(json.load(open(sys.argv[1])), sys.argv[2])
"""


def manual_sweep(page: Path, command: str) -> bool:
    """A sweep (`accutrain -m …`) of a manual page, or a report of the sweeps it wrote: several runs per command, run
    by the long tier only (the README's own sweeps and every single-run command run every time)."""
    return page.name != "README.md" and command.startswith(("accutrain -m ", "accutrain-report multirun/"))


def skipped(command: str) -> str:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), "")


def shortened(argv: list[str], index: int, written: set[str]) -> list[str]:
    """A training command with small sizes and its own run (or sweep) directory appended, unless it gives them — or,
    for `resume=auto` in a run directory an earlier command wrote (`written`), the sizes that run recorded."""
    if argv[0] != "accutrain":
        return argv
    keys = {a.split("=", 1)[0].lstrip("+") for a in argv[1:]}
    continued = "resume=auto" in argv and any(f"hydra.run.dir={d}" in argv for d in written)
    chosen = keys & {"experiment", "debug"} or continued
    extra = list(SHORT)
    if not chosen and "model" not in keys:
        extra += SMALL_MODEL
    if not chosen and "data" not in keys:
        extra += SMALL_DATA
    multirun = "-m" in argv
    if multirun and any("optuna" in a for a in argv):
        extra.append(TRIALS)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if key not in keys:
        extra.append(f"{key}={'multirun' if multirun else 'outputs'}/readme-{index}")
    return [*argv, *extra]


def test_the_readme_lists_its_commands_and_skips_only_those_named():
    found = [c for c, _, _ in all_commands()]
    assert "accutrain data=imagefolder data.root=~/pets data.image_size=128" in found
    assert "accutrain model=resnet18 micro_batch=8 accum=4" in found
    assert "accutrain-check micro_batch=8 accum=4" in found
    assert {start for start in SKIPPED} <= {start for c in found for start in SKIPPED if c.startswith(start)}


def test_every_block_is_commands_a_recipe_or_something_to_read():
    """A block in a language the docs tests do not run (an sh or yaml block that is no recipe they know) would be
    a command nobody runs."""
    assert not unknown_blocks()


def table_cells(row: str) -> list[str]:
    """The cells of a table row (`|` inside code spans and `\\|` do not separate), with what lies outside the outer
    bars as cells too: a row must begin and end with one."""
    parts = re.split(r"(?<!\\)\|", re.sub(r"`[^`]*`", "code", row.strip()))
    return parts[1:] if parts[-1].strip() else parts[1:-1]


def test_the_walk_throughs_chat_template_is_the_example_file():
    """docs/finetune.md prints examples/reasoning.jinja, the template its reasoning example runs with, as it is."""
    printed = [body for language, body in fenced_blocks((ROOT / "docs" / "finetune.md").read_text())
               if language == "jinja"]
    assert printed == [(ROOT / "examples" / "reasoning.jinja").read_text()]


def test_the_pages_tables_are_whole():
    """Every row of every table of the README and docs/*.md has its header's number of cells (a row that swallowed
    the paragraph after it has one more)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for table in re.findall(r"(?:^\|.*\n)+", text, flags=re.M):
            header, *rows = table.splitlines()
            broken += [f"{page.name}: {row}" for row in rows if len(table_cells(row)) != len(table_cells(header))]
    assert not broken, "\n".join(broken)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_pages_links_lead_somewhere():
    """Every relative link of the README and of docs/*.md names a file that exists (an image too), and its #anchor a
    heading of that page."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+:", target):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", linked.read_text(), flags=re.S | re.M),
                                      flags=re.M)
                if fragment not in {anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.slow
@pytest.mark.parametrize("sweeps", [False, pytest.param(True, marks=pytest.mark.long)], ids=["commands", "manual-sweeps"])
def test_every_readme_command_works_as_printed(tmp_path, sweeps):
    """Every command but the manual's sweeps, or (the long tier) those sweeps."""
    from conftest import make_image_folder

    home = tmp_path / "home"
    make_image_folder(home / "pets")  # `data.root=~/pets`
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")  # the pages' files, where they say they are
    runs, expected, written = [], [], set()
    for index, (page, (command, code, error)) in enumerate(paged_commands()):
        if skipped(command) or command in [c for c, _, _ in expected] or manual_sweep(page, command) != sweeps:
            continue
        argv = shortened(words(command, home), index, written)
        written |= {a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")}
        assert argv[0] in ("accutrain", "accutrain-check", "accutrain-report"), command
        named = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=outputs/")), None)
        if named:  # the checkpoint the README names: the one `accutrain trainer.checkpoint_every=200` wrote
            source = next(i for c, i in runs if "trainer.checkpoint_every=200" in c)
            runs.append((["copy", f"outputs/readme-{source}/checkpoints/last.pt", named], None))
        runs.append((argv, index))
        expected.append((command, code, error))
    (tmp_path / "commands.json").write_text(json.dumps([argv for argv, _ in runs]))
    env = {**os.environ, **ONE_THREAD, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "commands.json"), str(tmp_path / "out.json")],
                          cwd=work, env=env, capture_output=True, text=True,
                          timeout=2 * COMMAND_S)  # every command of the pages, one after the other
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for (command, code, error), result in zip(expected, results):
        assert result["exit"] == code, f"{command}: exit {result['exit']}\n{result['stderr'][-3000:]}"
        assert "Traceback" not in result["stderr"], f"{command}:\n{result['stderr'][-3000:]}"
        if error:  # the error line as the README prints it (up to its "…"; a log line's time aside)
            line = re.sub(r"^\[[\d:]+\] ", "", error).split("…")[0].rstrip(", ")
            assert line in result["stderr"], f"{command}:\n{result['stderr']}"
    assert len(results) == len(expected)
    succeeded = {index for (_, index), (_, code, _) in zip([r for r in runs if r[1] is not None], expected) if not code}
    for run in (work / "outputs").glob("readme-*"):  # every single run that should succeed finished
        if int(run.name.split("-")[1]) in succeeded:
            assert json.loads((run / "status.json").read_text())["state"] == "completed", run


def quick_start_commands() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands():
    install, run, test, quick = quick_start_commands()
    assert (install, run, test, quick) == ('pip install -e ".[dev]"', "accutrain", "pytest", "pytest -m quick")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and test in ci and quick not in ci  # CI runs the full default tier


# What the quick tier must hold (README's quick start): a test of each, by its node id.
QUICK = {
    "cross-entropy": "tests/train/test_exact.py::test_accumulated_runs_equal_the_big_batch_run",
    "cross-entropy per token": "tests/train/test_faithful.py::test_element_normalised_accumulation_equals_the_big_batch",
    "a per-term loss": "tests/train/test_exact_losses.py::test_each_loss_accumulated_equals_the_big_batch[mse]",
    "the contrastive window": "tests/train/test_contrastive.py::test_window_loss_accumulated_equals_the_big_batch[extra0]",
    "a mixture of experts": "tests/models/test_moe.py::test_the_window_takes_the_big_batchs_steps[accum]",
    "the triplet window": "tests/core/test_triplet.py::test_micro_batches_give_the_window_gradient_and_per_micro_batch_negatives_do_not",
    "a family of the user's": "tests/train/test_plugin_family.py::test_a_class_implementing_the_protocol_is_a_family_with_its_traits",
    "two devices": "tests/parallel/test_ddp.py::test_two_ranks_equal_one_device_and_the_big_batch",
    "the formula": "tests/core/test_step.py::test_accumulated_gradient_equals_big_batch_on_a_short_tail",
    "the windows": "tests/core/test_windows.py::test_same_windows_whatever_the_split",
    "the command line": "tests/e2e/test_cli.py::test_a_run_writes_its_outputs_into_the_run_directory",
    "accutrain-check": "tests/train/test_faithful.py::test_check_verdicts_and_exit_codes[args0-True]",
    "resume": "tests/train/test_resume.py::test_killed_and_resumed_run_ends_bit_identical[SIGKILL]",
}


def test_the_quick_tier_covers_the_guarantee():
    """`pytest -m quick` selects a test of each part of the guarantee (the `quick` mark on existing tests)."""
    files = sorted({node.split("::")[0] for node in QUICK.values()})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "quick", "-n", "0",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True,
                          timeout=COMMAND_S)
    selected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    missing = {what: node for what, node in QUICK.items() if node not in selected}
    assert not missing, f"{missing}\n{proc.stdout[-2000:]}"
