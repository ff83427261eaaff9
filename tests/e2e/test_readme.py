"""The commands of the README and of the manual's pages (docs/*.md) work as printed: every command in their code
blocks (and in their inline code) is split into words by bash, as a user's shell would, and run — those that train
with small sizes appended — except the few listed in SKIPPED, each with its reason. docs/benchmarks.md is the record
of measurements (benchmark scripts of minutes, GPU runs), not a page of the manual: its commands are not run here.
The quick start is also what CI runs."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ONE_THREAD

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The pages whose commands are run: the README first, then the manual's pages by name. Not docs/benchmarks.md: it
# records how each figure was measured — benchmark scripts of minutes (python scripts/bench_*.py) and runs on a GPU
# (accutrain trainer.device=cuda, compiled runs timed there) — which scripts/gpu_check.sh reruns where a GPU is.
NOT_RUN = {"benchmarks.md"}
PAGES = [ROOT / "README.md"] + [page for page in sorted((ROOT / "docs").glob("*.md")) if page.name not in NOT_RUN]

# Commands not run here, by how they begin, and why.
SKIPPED = {
    "pip install": "installs packages: CI runs the dev install, which has every extra "
                   "(test_ci_runs_the_readme_install_and_test_commands)",
    "pytest": "the test suite itself",
    "torchrun --nnodes 2": "needs several machines",
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
PLACEHOLDER = re.compile(r"[<>…]|\bDIR\b")

MYMODELS = """
import torch.nn as nn

class Net(nn.Module):  # the README's `model=custom model._target_=mymodels.Net +model.depth=4`
    def __init__(self, num_classes, in_channels, image_size, depth=2):
        super().__init__()
        width = in_channels * image_size ** 2
        self.body = nn.Sequential(nn.Flatten(), *[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                                  for _ in range(depth)], nn.Linear(width, num_classes))

    def forward(self, x):
        return self.body(x)
"""

MYDATA = """
import torch
from accutrain.data.datasets import Datasets, InMemory

def make(size, seed, val_size=32, **_):  # the README's `data=custom data._target_=mydata.make +data.size=1000`
    g = torch.Generator().manual_seed(seed)
    def split(n):
        x = torch.randn(n, 1, 8, 8, generator=g)
        return InMemory(x, (x.mean(dim=(1, 2, 3)) > 0).long())
    return Datasets(split(size), split(val_size), 2, (1, 8, 8), f"two classes by sign ({size} samples)")
"""

MYLOSSES = """
def cubic(output, target):  # docs/losses.md's `loss=custom loss._target_=mylosses.cubic`: a loss per element
    return (output - target).abs().pow(3)
"""


def pairs(n: int = 40) -> str:
    """`data.train=pairs.jsonl` for the README's tiny GPT-2: "12 plus 7 is " → "19." pairs."""
    return "".join(json.dumps({"prompt": f"{a} plus {b} is ", "response": f"{a + b}."}) + "\n"
                   for a, b in ((i % 13, i % 7) for i in range(n)))


def chats(n: int = 40) -> str:
    """`data.train=chat.jsonl` for docs/finetune.md: conversations of one or two assistant turns."""
    def conversation(a: int, b: int) -> list[dict]:
        turns = [{"role": "user", "content": f"{a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        more = [{"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes"}] if a % 3 else []
        return turns + more
    return "".join(json.dumps({"messages": conversation(i % 13, i % 7)}) + "\n" for i in range(n))


def reasoning() -> str:
    """`data.train=reasoning.jsonl` for docs/finetune.md: two questions per conversation, each answer with its
    reasoning."""
    records = []
    for a, b in ((12, 7), (3, 4), (25, 16), (9, 9), (41, 2), (8, 30)):
        total = a + b
        records.append({"messages": [
            {"role": "system", "content": "Think, then answer briefly."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "reasoning_content": f"{a} + {b}: {a} + {b - 1} is {total - 1}, one more is {total}.",
             "content": f"{total}."},
            {"role": "user", "content": "And twice that?"},
            {"role": "assistant", "reasoning_content": f"2 × {total} = {total} + {total} = {2 * total}.",
             "content": f"{2 * total}."}]})
    return "".join(json.dumps(r) + "\n" for r in records)


def jinja_block(page: Path) -> str:
    """The first ```jinja block of a page (docs/finetune.md's reasoning.jinja), as printed."""
    return next(body for language, body in fenced_blocks(page.read_text()) if language == "jinja")


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


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each ``` block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[tuple[str, int, str]]:
    """(command, expected exit code, expected error line or ""): every line of a bash block (comments dropped,
    continuations joined) and every `$ ` line of an output block (with the exit code and error line printed below
    it), in the README's order; then the indented examples, and inline code that is a whole command."""
    found = []
    for language, body in fenced_blocks(text):
        if language == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                if line.split("#", 1)[0].strip():
                    found.append((" ".join(line.split("#", 1)[0].split()), 0, ""))
            continue
        for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
            command, *output = re.sub(r"\\\n\s*", " ", chunk).splitlines()
            code = re.search(r"^exit code (\d+)$", chunk, flags=re.M)
            error = next((line for line in output if ": error: " in line), "")
            found.append((command.strip(), int(code.group(1)) if code else (2 if error else 0), error))
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [(line.strip(), 0, "") for line in re.findall(r"^    (accutrain .*)$", outside, flags=re.M)]
    found += [(" ".join(span.split()), 0, "") for span in re.findall(r"`(accutrain[- ][^`]*[=/][^`]*)`", outside)
              if not PLACEHOLDER.search(span)]
    return found


def all_commands() -> list[tuple[str, int, str]]:
    """commands() of every page in PAGES, in that order (so within a page a command that prepares another, such as
    the checkpoint a `resume=outputs/…` names, still comes first)."""
    return [found for _, found in paged_commands()]


def paged_commands() -> list[tuple[Path, tuple[str, int, str]]]:
    return [(page, found) for page in PAGES for found in commands(page.read_text())]


def manual_sweep(page: Path, command: str) -> bool:
    """A sweep (`accutrain -m …`) of a manual page: several runs per command, run by the long tier only (the README's
    own sweeps and every single-run command run every time)."""
    return page.name != "README.md" and command.startswith("accutrain -m ")


def skipped(command: str) -> str:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), "")


def words(command: str, home: Path) -> list[str]:
    """The arguments bash passes for `command` (quotes removed; a `~` after `key=` left as it is)."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True,
                         env={"HOME": str(home), "PATH": os.environ["PATH"]}).stdout
    return out.split("\0")[:-1]


def shortened(argv: list[str], index: int) -> list[str]:
    """A training command with small sizes and its own run (or sweep) directory appended, unless it gives them."""
    if argv[0] != "accutrain":
        return argv
    keys = {a.split("=", 1)[0].lstrip("+") for a in argv[1:]}
    chosen = keys & {"experiment", "debug"}
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
    work.mkdir()
    (work / "mymodels.py").write_text(MYMODELS)
    (work / "mydata.py").write_text(MYDATA)
    (work / "mylosses.py").write_text(MYLOSSES)
    (work / "pairs.jsonl").write_text(pairs())
    (work / "chat.jsonl").write_text(chats())
    (work / "reasoning.jsonl").write_text(reasoning())
    (work / "reasoning.jinja").write_text(jinja_block(ROOT / "docs" / "finetune.md"))
    runs, expected = [], []
    for index, (page, (command, code, error)) in enumerate(paged_commands()):
        if skipped(command) or command in [c for c, _, _ in expected] or manual_sweep(page, command) != sweeps:
            continue
        argv = shortened(words(command, home), index)
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
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for (command, code, error), result in zip(expected, results):
        assert result["exit"] == code, f"{command}: exit {result['exit']}\n{result['stderr'][-3000:]}"
        assert "Traceback" not in result["stderr"], f"{command}:\n{result['stderr'][-3000:]}"
        if error:  # the error line as the README prints it (up to its "…")
            assert error.split("…")[0].rstrip(", ") in result["stderr"], f"{command}:\n{result['stderr']}"
    assert len(results) == len(expected)
    for run in (work / "outputs").glob("readme-*"):  # every single run finished
        assert json.loads((run / "status.json").read_text())["state"] == "completed", run


def quick_start_commands() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands():
    install, run, test = quick_start_commands()
    assert (install, run, test) == ('pip install -e ".[dev]"', "accutrain", "pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and test in ci
