"""The README's quick start is what CI runs: the two must not drift apart."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands():
    install, run, test = quick_start_commands()
    assert (install, run, test) == ('pip install -e ".[dev]"', "accutrain", "pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and test in ci
