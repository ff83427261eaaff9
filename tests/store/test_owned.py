"""Never lose a run, part 4 (issue 44): a directory is accutrain's when it carries accutrain's mark (.accutrain, a run
id written when accutrain creates it), not when a file with a common name is there. Every write, overwrite and
deletion checks it: a run's and a sweep's files, trainer.overwrite=true, checkpoint rotation, abandoned branches,
the summaries; runs made before the mark existed are recognised by their record and marked when taken over."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, assert_one_line_error, assert_one_line_user_error, run_cli, train_here, train_run

from accutrain.cli.command import check
from accutrain.errors import UserError
from accutrain.store import mark, owned, rundir
from accutrain.store.rotation import Rotation

QUICK = [*TINY, "data.size=40", "micro_batch=8", "trainer.max_steps=2", "trainer.progress=false"]


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, dot-files included."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def users_folder(folder: Path) -> Path:
    """A project folder with files of the user's under the names accutrain writes, a status.json of another tool
    among them (shaped as accutrain's)."""
    folder.mkdir(parents=True)
    (folder / "summary.md").write_text("# my own summary\n")
    (folder / "summary.csv").write_text("model,score\nmine,0.9\n")
    (folder / "status.json").write_text(json.dumps({"state": "completed", "started": "2026-01-01T00:00:00",
                                                    "host": "laptop", "pid": 1, "tool": "another"}))
    (folder / "config.yaml").write_text("lr: 0.1  # my own\n")
    (folder / "loss.png").write_bytes(b"\x89PNG my own plot")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("sweep", [False, True])
def test_a_users_folder_is_refused_with_and_without_overwrite_and_left_byte_identical(tmp_path, sweep):
    """`hydra.sweep.dir=.` replaced the user's summary.md and summary.csv, exit 0; `hydra.run.dir=.
    trainer.overwrite=true` took another tool's status.json for an earlier run and deleted it with config.yaml and
    loss.png. Now one line, exit 2, every byte as it was — with and without trainer.overwrite=true."""
    project = users_folder(tmp_path / "project")
    before = files(project)
    args = ["-m", *QUICK, "seed=0,1", "hydra.sweep.dir=."] if sweep else [*QUICK, "hydra.run.dir=."]
    kind, key = ("sweep", "hydra.sweep.dir") if sweep else ("run", "hydra.run.dir")
    for extra in ([], ["trainer.overwrite=true"]):
        proc = run_cli(*args, *extra, cwd=project, check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert_one_line_error(proc, f". ({key}) is not an accutrain {kind} directory: it holds files of its own "
                                    "(config.yaml, loss.png, status.json, summary.csv, summary.md) and no .accutrain")
        assert files(project) == before and sorted(p.name for p in project.iterdir()) == sorted(before)


def test_another_tools_status_json_is_no_accutrain_run_and_overwrite_deletes_nothing(tmp_path):
    project = users_folder(tmp_path / "project")
    before = files(project)
    assert mark.owner(project) is None
    with pytest.raises(UserError) as info:
        owned.refuse_foreign(project, "hydra.run.dir")
    assert_one_line_user_error(info.value, "is not an accutrain run directory")
    with pytest.raises(UserError) as info:  # trainer.overwrite=true's deletion checks the mark itself
        rundir.clear(project)
    assert_one_line_user_error(info.value, "refusing to delete an earlier run's files (trainer.overwrite=true)",
                               "no .accutrain mark")
    with pytest.raises(UserError, match="holds summary.md, summary.csv, loss.png of its own"):  # accutrain-report
        (project / "run").mkdir()
        (project / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
        from accutrain.report.summary import write_report

        write_report(project)
    (project / "run" / "metrics.jsonl").unlink()
    (project / "run").rmdir()
    assert files(project) == before


def test_a_report_into_a_folder_of_runs_marks_it_and_may_write_there_again(tmp_path):
    """accutrain-report DIR on a folder holding runs (multirun/, say): written, the folder marked as a report's, so
    that the next report replaces its own summary and nothing else."""
    from accutrain.report.summary import write_report

    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5, "samples": 8}\n')
    write_report(tmp_path / "runs")
    assert mark.read(tmp_path / "runs")["accutrain"] == "report"
    write_report(tmp_path / "runs")  # its own summary.md, replaced
    with pytest.raises(UserError, match="is an accutrain report directory, not a run directory"):
        owned.refuse_foreign(tmp_path / "runs", "hydra.run.dir")


def test_rotation_and_branches_delete_only_in_a_marked_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    mark.write_new(run_dir, "run")
    rotation = Rotation(run_dir / "checkpoints", keep=1)
    rotation.save({"step": 1}, 1)
    rotation.save({"step": 2}, 2)
    assert [p.name for p in rotation.steps()] == ["step-00000002.pt"]  # rotated
    (run_dir / mark.MARK_FILE).unlink()  # no longer accutrain's (or never was)
    rotation.save({"step": 3}, 3)
    assert [p.name for p in rotation.steps()] == ["step-00000003.pt", "step-00000002.pt"]  # kept, said in one warning
    with pytest.raises(UserError, match="refusing to set a branch's later checkpoints aside in .*: it is not an "
                                        "accutrain run directory"):
        rotation.set_aside(1)
    assert len(rotation.steps()) == 2


def test_a_run_in_process_into_a_folder_of_its_own_is_refused(tmp_path):
    """accutrain.runtime.launch.train: the run directory is accutrain's (marked, or new or empty and marked), or
    refused before anything is written."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError, match="the run directory.* is not an accutrain run directory"):
        train_here(tmp_path, "project", *QUICK)
    assert files(tmp_path / "project") == {"notes.txt": b"mine\n"}
    run_dir, _ = train_here(tmp_path, "new", *QUICK)
    assert mark.read(run_dir)["accutrain"] == "run" and torch.load(run_dir / "checkpoints" / "last.pt")["step"] == 2


@pytest.mark.slow
def test_a_run_made_before_the_mark_is_recognised_and_marked_when_resumed(tmp_path):
    """A run directory without the mark but with accutrain's record of its job (Hydra's .hydra/config.yaml) is an
    earlier accutrain run: a refused resume leaves it as it was, unmarked; a resume marks it."""
    run_dir, _ = train_run(tmp_path, "old", *QUICK)
    (run_dir / mark.MARK_FILE).unlink()  # as a run of an earlier accutrain left it
    assert mark.owner(run_dir) == "run"
    before = files(run_dir)
    with pytest.raises(UserError, match="holds an earlier run"):
        check([*QUICK, f"hydra.run.dir={run_dir}"])
    _, proc = train_run(tmp_path, "old", *QUICK, "seed=1", "resume=auto", check=False)  # refused after the claim
    assert_one_line_error(proc, "resuming needs the same seed")
    assert {k: v for k, v in files(run_dir).items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}
    train_run(tmp_path, "old", *QUICK, "trainer.max_steps=3", "resume=auto")
    assert mark.read(run_dir)["accutrain"] == "run"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
