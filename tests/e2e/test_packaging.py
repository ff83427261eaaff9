"""The default job keeps its promise, and a wheel built from the Docker image's context carries its configs and data
and runs from anywhere."""
import os
import subprocess
import sys
import zipfile

import pytest
from conftest import read_metrics, run_cli

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long  # every session runs the quick start before it stops; test_readme runs `accutrain` every time
def test_default_job_reaches_90_percent_on_digits(tmp_path):
    """`accutrain` with no arguments: resnet18 on the shipped digits, no download."""
    proc = run_cli(cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    run_dirs = list((tmp_path / "outputs").glob("*/*"))
    assert len(run_dirs) == 1, proc.stderr
    _, evals = read_metrics(run_dirs[0])
    assert evals[-1]["val_acc"] >= 0.90, evals
    assert "effective batch 32 = micro_batch 32 × accum 1 × devices 1" in proc.stderr


def image_context(into):
    """The files the Dockerfile copies into its WORKDIR (what `docker build` then installs with `pip install .`),
    copied into `into`; the Dockerfile's instructions are checked to be those this reading understands."""
    import shutil

    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert {line[0] for line in lines} <= {"FROM", "WORKDIR", "COPY", "RUN", "CMD"}, lines
    assert ["RUN", "pip", "install", "--no-cache-dir", "."] in lines  # from the copied repository, not PyPI
    for *sources, dest in (line[1:] for line in lines if line[0] == "COPY"):
        for source in sources:
            target = into / dest / source if dest.endswith("/") else into / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    return into


@pytest.mark.slow
def test_wheel_carries_configs_and_runs_from_another_directory(tmp_path):
    """The wheel built from the Docker image's build context (docs/cluster.md's Kubernetes recipe) — the files the
    Dockerfile copies, and only those — installs and trains from any directory."""
    dist = tmp_path / "dist"
    context = image_context(tmp_path / "context")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(context)], check=True, capture_output=True)
    wheel = next(dist.glob("accutrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "accutrain/configs/train.yaml" in names and "accutrain/configs/model/resnet18.yaml" in names
    assert "accutrain/assets/digits.npz" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import accutrain.cli.main as c; from accutrain.config.train "
                            "import config_dir; print(c.__file__, config_dir())"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert str(target) in where and where.count(str(target)) == 2, where  # the wheel's code and configs
    proc = subprocess.run([str(target / "bin" / "accutrain"), "model=mlp", "trainer.max_steps=3",
                           "trainer.progress=false", "hydra.run.dir=run"], cwd=elsewhere, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "done: 3 optimizer steps" in proc.stderr
    assert (elsewhere / "run" / "checkpoints" / "last.pt").exists()
