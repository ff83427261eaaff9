"""The commands of the README and of the manual's pages (docs/*.md), as a reader copies them: each command of a
bash block, each `$ ` line of an output block, the indented examples and the inline code that is a whole command;
and the cluster recipes — an sbatch script (an `sh` block), a SkyPilot task and a Kubeflow TrainJob (`yaml`
blocks). tests/e2e/test_readme.py runs the commands, tests/e2e/test_recipes.py the recipes."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The pages whose commands are run: the README first, then the manual's pages by name. Not docs/benchmarks.md: it
# records how each figure was measured — benchmark scripts of minutes (python scripts/bench_*.py) and runs on a GPU
# (accutrain trainer.device=cuda, compiled runs timed there) — which scripts/gpu_check.sh reruns where a GPU is.
NOT_RUN = {"benchmarks.md"}
PAGES = [ROOT / "README.md"] + [page for page in sorted((ROOT / "docs").glob("*.md")) if page.name not in NOT_RUN]
PLACEHOLDER = re.compile(r"[<>…]|\bDIR\b")
# Blocks that hold no command: code to read (python), records (json), what a command prints (text).
NOT_COMMANDS = {"python", "json", "text", "jinja"}  # jinja: a chat template to read (examples/*.jinja)
# An error line as the console prints it: `accutrain: error: …` before the run, `[hh:mm:ss] error: …` in it.
ERROR = re.compile(r"(?:^|: |\] )error: ")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each ``` block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[tuple[str, int, str]]:
    """(command, expected exit code, expected error line or ""): every line of a bash block (comments dropped,
    continuations joined) and every `$ ` line of an output block (with the exit code and error line printed below
    it), in the page's order; then the indented examples, and inline code that is a whole command."""
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
            error = next((line for line in output if ERROR.search(line)), "")
            found.append((command.strip(), int(code.group(1)) if code else (2 if error else 0), error))
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [(line.strip(), 0, "") for line in re.findall(r"^    (accutrain .*)$", outside, flags=re.M)]
    found += [(" ".join(span.split()), 0, "") for span in re.findall(r"`(accutrain[- ][^`]*[=/][^`]*)`", outside)
              if not PLACEHOLDER.search(span)]
    return found


def paged_commands() -> list[tuple[Path, tuple[str, int, str]]]:
    return [(page, found) for page in PAGES for found in commands(page.read_text())]


def all_commands() -> list[tuple[str, int, str]]:
    """commands() of every page in PAGES, in that order (so within a page a command that prepares another, such as
    the checkpoint a `resume=outputs/…` names, still comes first)."""
    return [found for _, found in paged_commands()]


def recipe_kind(language: str, body: str) -> str:
    """`sbatch`, `skypilot` or `trainjob` for a recipe block; "" for a block of commands or of no command."""
    if language == "sh" and body.startswith("#!/bin/bash\n") and "#SBATCH" in body:
        return "sbatch"
    if language == "yaml" and re.search(r"^run: \|$", body, flags=re.M):
        return "skypilot"
    if language == "yaml" and re.search(r"^kind: TrainJob$", body, flags=re.M):
        return "trainjob"
    return ""


def recipes() -> list[tuple[str, str, str]]:
    """(page name, kind, body) of every recipe block of the pages."""
    return [(page.name, recipe_kind(language, body), body) for page in PAGES
            for language, body in fenced_blocks(page.read_text()) if recipe_kind(language, body)]


def unknown_blocks() -> list[str]:
    """Blocks that are neither commands (bash, output blocks), nor a recipe, nor code or records to read: a block
    the docs tests would not run."""
    return [f"{page.name}: ```{language} {body.splitlines()[0] if body else ''}" for page in PAGES
            for language, body in fenced_blocks(page.read_text())
            if language not in ("bash", "", *NOT_COMMANDS) and not recipe_kind(language, body)]


def words(command: str, home: Path) -> list[str]:
    """The arguments bash passes for `command` (quotes removed; a `~` after `key=` left as it is)."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, text=True, check=True,
                         env={"HOME": str(home), "PATH": os.environ["PATH"]}).stdout
    return out.split("\0")[:-1]
