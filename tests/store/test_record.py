"""Never lose a run, part 3 (issue 32, item 6): a command continuing an earlier run that is refused changes nothing on
disk — status.json, config.yaml, Hydra's .hydra/ record, metrics.jsonl, the checkpoints stay byte for byte; one that
has nothing left to train keeps the record as it was (its best included), in a sweep too."""
import csv
import json
from pathlib import Path

import pytest
from conftest import TINY, assert_one_line_error, run_cli, train_run

from accutrain.errors import UserError
from accutrain.store import record, rundir
from accutrain.store.status import add_to_status, read_status, recorded, write_status

QUICK = [*TINY, "data.size=40", "micro_batch=8", "trainer.max_steps=3"]


def files(folder: Path) -> dict[str, bytes]:
    """Every file of a run directory but its log (a refused command's line is appended there)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "train.log"}


@pytest.mark.slow
def test_a_refused_resume_changes_nothing_on_disk(tmp_path):
    """`resume=auto seed=1` on a finished run used to leave status.json `failed` without its plan and best, and the
    refused command in .hydra/overrides.yaml (as did a resume refused because another accutrain holds the run)."""
    run_dir, _ = train_run(tmp_path, "run", *QUICK)
    before = files(run_dir)
    assert {".hydra/overrides.yaml", "config.yaml", "metrics.jsonl", "status.json"} <= before.keys()
    assert {"plan", "best"} <= json.loads(before["status.json"]).keys()
    for refused, says in ((["seed=1"], "resuming needs the same seed"),
                          (["data.seed=5"], "resuming needs the same data.seed"),
                          (["model.hidden=[64]"], "was written for another model")):
        _, proc = train_run(tmp_path, "run", *QUICK, *refused, "resume=auto", check=False)
        assert proc.returncode == 2
        assert_one_line_error(proc, says)
        assert files(run_dir) == before, refused
    with rundir.held(run_dir):  # another accutrain holds the directory: Hydra's .hydra/ used to be rewritten
        _, proc = train_run(tmp_path, "run", *QUICK, "resume=auto", check=False)
    assert_one_line_error(proc, "is in use: another accutrain is running in it")
    assert files(run_dir) == before


@pytest.mark.slow
def test_a_resume_with_nothing_left_to_train_keeps_the_record(tmp_path):
    """A no-op resume used to drop `best` from status.json and record itself in .hydra/."""
    run_dir, _ = train_run(tmp_path, "run", *QUICK)
    before = files(run_dir)
    _, proc = train_run(tmp_path, "run", *QUICK, "resume=auto")
    assert "nothing left to train" in proc.stderr
    assert files(run_dir) == before


@pytest.mark.slow
def test_resuming_a_sweep_keeps_the_finished_jobs_rows(tmp_path):
    """The finished jobs of a resumed sweep have nothing left to train: their summary rows (best, wall time, the
    overrides) stay as they were."""
    sweep = tmp_path / "sweep"
    args = ["-m", *QUICK, "seed=0,1", f"hydra.sweep.dir={sweep}"]
    run_cli(*args, cwd=tmp_path)
    with open(sweep / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(r["best"] and r["wall_s"] for r in rows), rows
    jobs = {job: files(sweep / job) for job in ("0", "1")}
    proc = run_cli(*args, "resume=auto", cwd=tmp_path)
    assert "sweep: 2 runs, 2 completed" in proc.stdout
    with open(sweep / "summary.csv", newline="") as f:
        assert list(csv.DictReader(f)) == rows
    assert {job: files(sweep / job) for job in ("0", "1")} == jobs


def test_recorded_puts_the_earlier_record_back_unless_the_run_took_over(tmp_path):
    """In process: a failure before the session takes the directory over (adds the plan) puts status.json and the
    files given back byte for byte; after it, the failure is the run's own."""
    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    (hydra / "overrides.yaml").write_text("- seed=0\n")
    write_status(tmp_path, "completed")
    add_to_status(tmp_path, plan={"effective": 8}, best={"value": 0.5})
    status = (tmp_path / "status.json").read_bytes()
    kept = record.Changes()
    kept.was(record.hydra_record(tmp_path, ".hydra"))
    (hydra / "overrides.yaml").write_text("- seed=1\n- resume=auto\n")  # what Hydra writes before the job runs
    (hydra / "hydra.yaml").write_text("new\n")
    kept.found(record.hydra_record(tmp_path, ".hydra"))
    with pytest.raises(UserError):
        with recorded(tmp_path, kept) as outcome:
            raise UserError("refused")
    assert outcome.kept and (tmp_path / "status.json").read_bytes() == status
    assert sorted(p.name for p in hydra.iterdir()) == ["overrides.yaml"]
    assert (hydra / "overrides.yaml").read_text() == "- seed=0\n"
    with pytest.raises(UserError):
        with recorded(tmp_path, kept) as outcome:
            add_to_status(tmp_path, plan={"effective": 8})  # the session took over
            raise UserError("diverged")
    assert not outcome.kept and read_status(tmp_path)["state"] == "failed"


def test_nothing_left_to_train_after_an_interrupted_record_marks_it_completed(tmp_path):
    """Killed after its last checkpoint but before it was marked completed: the resume that finds nothing left to
    train marks it completed, keeping its plan and best."""
    write_status(tmp_path, "interrupted")
    add_to_status(tmp_path, plan={"effective": 8}, best={"value": 0.5})
    with recorded(tmp_path) as outcome:
        pass
    status = read_status(tmp_path)
    assert outcome.kept and status["state"] == "completed"
    assert status["plan"] == {"effective": 8} and status["best"] == {"value": 0.5}
