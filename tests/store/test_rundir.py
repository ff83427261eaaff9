"""Never lose a run, part 2: a run directory an earlier run used is refused (or continued, or replaced as asked)
before anything in it is touched; unwritable directories and full disks are one line at start; a checkpoint that
cannot be written mid-run keeps the previous one and the run goes on."""
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    COMMAND_S,
    ONE_THREAD,
    TINY,
    assert_one_line_error,
    captured_log,
    cli_command,
    read_metrics,
    run_cli,
    train_here,
    train_run,
)

from accutrain.cli.command import check
from accutrain.errors import UserError
from accutrain.store import checkpoint, mark, rundir
from accutrain.store.rotation import Rotation

QUICK = [*TINY, "data.size=40", "micro_batch=8", "trainer.max_steps=3", "trainer.checkpoint_every=1"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_used_run_directory_is_refused_and_left_untouched(tmp_path):
    """Item 1: the same command again (and a typo with resume=auto) changes nothing in the earlier run's directory:
    not its checkpoints, metrics.jsonl or status.json, nor Hydra's record of its overrides or its train.log."""
    run_dir, _ = train_run(tmp_path, "base", *QUICK)
    before = snapshot(run_dir)
    assert json.loads(before["status.json"])["state"] == "completed"
    _, again = train_run(tmp_path, "base", *QUICK, check=False)
    assert again.returncode == 2
    assert_one_line_error(again, f"{run_dir} (hydra.run.dir) holds an earlier run (status completed, 3 optimizer steps",
                          "resume=auto to continue it", "trainer.overwrite=true", "a new hydra.run.dir")
    with pytest.raises(UserError, match="micro_batch=0 is not valid"):  # a typo, even with resume=auto
        check([*QUICK, "resume=auto", "micro_batch=0", f"hydra.run.dir={run_dir}"])
    assert snapshot(run_dir) == before


def used_run(tmp_path: Path, name: str = "used") -> Path:
    """A run directory as a killed run leaves it: accutrain's mark, a step in metrics.jsonl, a checkpoint,
    status.json."""
    run_dir = tmp_path / name
    (run_dir / "checkpoints").mkdir(parents=True)
    mark.write_new(run_dir, "run")
    (run_dir / "checkpoints" / "step-00000007.pt").write_bytes(b"PK\x03\x04")
    (run_dir / "metrics.jsonl").write_text('{"plan": {}}\n{"step": 7, "loss": 0.5}\n')
    (run_dir / "status.json").write_text(json.dumps({"state": "interrupted", "pid": -1}))
    (run_dir / "train.log").write_text("the earlier run's log\n")
    (run_dir / "notes.txt").write_text("the user's own file\n")
    return run_dir


def test_resume_auto_continues_a_used_directory_and_overwrite_replaces_it(tmp_path, compose):
    run_dir = used_run(tmp_path)
    argv = [*QUICK, f"hydra.run.dir={run_dir}"]
    with pytest.raises(UserError, match="holds an earlier run .status interrupted, 1 optimizer step in "
                                        "metrics.jsonl, checkpoints up to step-00000007.pt"):
        check(argv)
    check([*argv, "resume=auto"])
    check([*argv, "trainer.overwrite=true"])
    same = {**snapshot(used_run(tmp_path, "same")), ".accutrain": (run_dir / ".accutrain").read_bytes()}
    assert snapshot(run_dir) == same  # checking touched nothing

    with captured_log() as log:
        rundir.prepare(run_dir, None, True)  # trainer.overwrite=true
    assert "trainer.overwrite=true: deleted the earlier run's checkpoints/step-00000007.pt, metrics.jsonl, " \
           "status.json" in log.getvalue()
    assert sorted(snapshot(run_dir)) == [".accutrain", "notes.txt", "train.log"]
    assert not (run_dir / "train.log").read_text()
    assert rundir.earlier_run(run_dir) is None


def test_a_run_that_failed_before_its_first_step_leaves_nothing_to_protect(tmp_path):
    run_dir = tmp_path / "failed"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps({"state": "failed", "error": "no such data"}))
    assert rundir.earlier_run(run_dir) is None
    (run_dir / "status.json").write_text(json.dumps({"state": "completed"}))
    assert rundir.earlier_run(run_dir).startswith("status completed")


def test_a_sweep_into_a_used_sweep_directory_is_refused_unless_resumed(tmp_path):
    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        used_run(sweep, job)
    mark.write_new(sweep, "sweep")
    argv = ["-m", *QUICK, "micro_batch=4,8,16", f"hydra.sweep.dir={sweep}"]
    with pytest.raises(UserError, match=r"holds the runs of an earlier sweep \(jobs 0, 1\): add resume=auto"):
        check(argv)
    check([*argv, "resume=auto"])


def test_an_unwritable_checkpoints_folder_or_log_is_found_before_training(tmp_path):
    """Item 2: found when the command is checked, not at the first checkpoint write after all the training; and
    Hydra's train.log that cannot be opened is refused before Hydra opens it (the command line's one line and exit
    code 2 are proven by test_a_read_only_run_directory_is_one_line)."""
    for name in ("ckpt", "log"):  # earlier accutrain runs' directories, failed at start
        (tmp_path / name).mkdir()
        mark.write_new(tmp_path / name, "run")
        (tmp_path / name / "status.json").write_text(json.dumps({"state": "failed", "error": "no data"}))
    (tmp_path / "ckpt" / "checkpoints").write_text("a file in the way")
    with pytest.raises(UserError, match=f"cannot write checkpoints into {tmp_path / 'ckpt' / 'checkpoints'}: it is "
                                        "a file, not a directory"):
        check([*QUICK, f"hydra.run.dir={tmp_path / 'ckpt'}"])
    (tmp_path / "log" / "train.log").mkdir()  # an existing run directory whose log cannot be written
    with pytest.raises(UserError, match=f"cannot write the log file {tmp_path / 'log' / 'train.log'}: Is a directory"):
        check([*QUICK, f"hydra.run.dir={tmp_path / 'log'}"])


def test_a_read_only_run_directory_is_one_line(tmp_path):
    """Item 2: Hydra would open train.log there first and print a 32-line logging traceback. Read-only for real:
    permission bits for a user, a read-only bind mount (in a mount namespace of its own) for root."""
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    command = [*cli_command(), *QUICK, f"hydra.run.dir={run_dir}"]
    if os.geteuid() != 0:
        run_dir.chmod(0o555)
    elif subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-m", "sh", "-c", f'mount --bind "{run_dir}" "{run_dir}" && '
                   f'mount -o remount,bind,ro "{run_dir}" "{run_dir}" && exec "$0" "$@"', *command]
    else:
        pytest.skip("root without mount namespaces: no way to make a directory read-only here")
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=COMMAND_S,
                          env={**os.environ, **ONE_THREAD})
    assert proc.returncode == 2
    assert_one_line_error(proc, f"cannot write the run's files into {run_dir}:")
    assert len((proc.stdout + proc.stderr).strip().splitlines()) == 1


def test_a_full_disk_is_found_at_start(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=f"cannot write the run's files into {tmp_path}: No space left on device"):
        rundir.check_writable(tmp_path)
    assert not any(tmp_path.iterdir())  # the probe is gone


def failing_save(monkeypatch, fail_at: set[int], error: int = errno.ENOSPC) -> list[int]:
    """torch.save fails (after writing part of the file) on the given calls, counted from 1."""
    real, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(len(calls) + 1)
        if calls[-1] in fail_at:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(error, os.strerror(error))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return calls


def test_a_checkpoint_write_failing_mid_run_keeps_the_previous_one_and_training_goes_on(tmp_path, monkeypatch):
    failing_save(monkeypatch, fail_at={2})
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 50_000})())
    run_dir, log = train_here(tmp_path, "run", *QUICK, "trainer.keep_checkpoints=5")
    errors = [line for line in log.splitlines() if "could not write" in line]
    assert errors == [f"could not write the checkpoint of optimizer step 2 into {run_dir / 'checkpoints'} (No space "
                      "left on device); the newest on disk is step-00000001.pt: training goes on, the next "
                      "checkpoint tries again"]
    assert f"the disk holding {run_dir / 'checkpoints'} has 0.0477 MiB free" in log  # said at start
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not checkpoint.NAMED_FILE.match(p.name)) == [
        "best.pt", "last.pt", "step-00000001.pt", "step-00000003.pt"]  # no temporary file left (epoch*-step*.pt: names)
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3]


def test_the_last_checkpoint_failing_ends_the_run_in_one_line(tmp_path, monkeypatch):
    failing_save(monkeypatch, fail_at={4}, error=errno.EIO)  # calls: step 1, step 2, best.pt at 3, step 3
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "run", *QUICK)
    assert str(info.value).startswith("could not write the checkpoint of optimizer step 3")
    assert "(Input/output error); the newest on disk is step-00000002.pt: the run's last steps are not saved" in str(
        info.value)
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"] == 2


def test_best_pt_failing_is_one_error_line_and_the_run_ends_saved(tmp_path, monkeypatch):
    failing_save(monkeypatch, fail_at={3})  # best.pt at optimizer step 3
    run_dir, log = train_here(tmp_path, "run", *QUICK)
    checkpoints = run_dir / "checkpoints"
    assert f"could not write best.pt of optimizer step 3 into {checkpoints} (No space left on device)" in log
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"] == 3


def test_last_pt_failing_leaves_no_temporary_file(tmp_path, monkeypatch):
    rotation = Rotation(tmp_path, keep=3)
    rotation.save({"step": 1}, 1)
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == "last.pt":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        rotation.save({"step": 2}, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step-00000001.pt", "step-00000002.pt"]
    assert torch.load(tmp_path / "last.pt", weights_only=True) == {"step": 1}


@pytest.mark.slow
def test_a_directory_another_run_holds_is_refused_and_left_alone(tmp_path):
    """While a run holds its directory (from before it looks for an earlier run there to its end), a second
    `resume=auto` into it is refused in one line (exit 2) and writes nothing of its own: two resumes started at the
    same moment used to both pass the check before either recorded itself running, and both trained."""
    run_dir, _ = train_run(tmp_path, "run", *TINY, "trainer.max_steps=4", "trainer.checkpoint_every=2")
    before = {name: (run_dir / name).read_bytes() for name in ("status.json", "metrics.jsonl")}
    with rundir.held(run_dir):  # as the run that got there first holds it
        proc = run_cli(*TINY, "trainer.max_steps=8", "resume=auto", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                       check=False)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, f"{run_dir} (hydra.run.dir) is in use: another accutrain is running in it")
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    _, proc = train_run(tmp_path, "run", *TINY, "trainer.max_steps=8", "resume=auto")  # free again: it resumes
    assert [r["step"] for r in read_metrics(run_dir)[0]] == list(range(1, 9))


def test_a_folder_that_is_not_a_run_is_refused_and_left_byte_identical(tmp_path):
    """Issue 32, item 7: `hydra.run.dir=.` in a project folder replaced the user's own config.yaml and appended to
    their train.log; now one line, exit 2, and the folder is byte-identical (Hydra has not run: no .hydra/)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("lr: 0.1  # the user's own\n")
    (project / "train.log").write_text("the user's own log\n")
    before = snapshot(project)
    proc = run_cli(*QUICK, "hydra.run.dir=.", cwd=project, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, ". (hydra.run.dir) is not an accutrain run directory: it holds files of its own "
                                "(config.yaml, train.log) and no .accutrain mark")
    assert snapshot(project) == before and sorted(p.name for p in project.iterdir()) == ["config.yaml", "train.log"]


def test_an_empty_run_directory_value_is_refused(tmp_path):
    """`hydra.run.dir=` trained in the working directory."""
    proc = run_cli(*QUICK, "hydra.run.dir=", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert_one_line_error(proc, "hydra.run.dir is empty: the run would be written into the working directory")
    assert not any(tmp_path.iterdir())
    with pytest.raises(UserError, match="hydra.sweep.dir is empty"):
        check(["-m", *QUICK, "seed=0,1", "hydra.sweep.dir="])


def test_an_empty_folder_or_an_earlier_run_is_a_run_directory(tmp_path):
    from accutrain.store import owned

    (tmp_path / "empty").mkdir()
    owned.refuse_foreign(tmp_path / "empty", "hydra.run.dir")
    owned.refuse_foreign(tmp_path / "new", "hydra.run.dir")
    owned.refuse_foreign(used_run(tmp_path), "hydra.run.dir")  # marked (and a note of the user's beside it)
    hydra_only = tmp_path / "hydra_only"  # a run made before the mark, stopped before its status.json
    (hydra_only / ".hydra").mkdir(parents=True)
    (hydra_only / ".hydra" / "config.yaml").write_text("micro_batch: 8\ntrainer:\n  epochs: 2\n")
    (hydra_only / "train.log").write_text("")
    owned.refuse_foreign(hydra_only, "hydra.run.dir")
    (hydra_only / ".hydra" / "config.yaml").write_text("db:\n  host: x\n")  # another Hydra app's record
    with pytest.raises(UserError, match="is not an accutrain run directory"):
        owned.refuse_foreign(hydra_only, "hydra.run.dir")


def test_overwriting_a_finished_run_twice_deletes_and_lists_everything_it_owned(tmp_path):
    """Issue 52: best.pt (a run with a validation split) went with neither overwrite, and the next run then set it
    aside as another branch's; every file the earlier run wrote is deleted and named, nothing moved aside."""
    args = [*QUICK, "trainer.export=weights"]  # debug=fast has a validation split: best.pt and its name
    run_dir, _ = train_run(tmp_path, "run", *args)
    for _ in range(2):
        owned = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()
                 and not p.relative_to(run_dir).as_posix().startswith((".hydra", ".accutrain", ".lock", "train.log"))}
        assert {"checkpoints/best.pt", "model.safetensors", "status.json"} <= owned
        _, proc = train_run(tmp_path, "run", *args, "trainer.overwrite=true")
        warning = next(line for line in proc.stderr.splitlines() if "trainer.overwrite=true: deleted" in line)
        listed = set(warning.split("deleted the earlier run's ", 1)[1].split(f" in {run_dir}")[0].split(", "))
        assert owned <= listed, owned - listed
        assert "train.log (emptied)" in listed
        assert not list((run_dir / "checkpoints").glob("abandoned-*")), proc.stderr
        assert "another branch" not in proc.stderr


def test_overwrite_never_empties_a_train_log_that_links_outside_the_run(tmp_path):
    run_dir, _ = train_run(tmp_path, "run", *QUICK)
    outside = tmp_path / "my-notes.log"
    outside.write_text("the user's own log, kept\n")
    (run_dir / "train.log").unlink()
    (run_dir / "train.log").symlink_to(outside)
    _, proc = train_run(tmp_path, "run", *QUICK, "resume=auto")  # nothing left to train: its lines not written there
    assert outside.read_text() == "the user's own log, kept\n"
    assert "is a link to" in proc.stderr and "does not write through it" in proc.stderr
    _, proc = train_run(tmp_path, "run", *QUICK, "trainer.overwrite=true")
    assert outside.read_text() == "the user's own log, kept\n"
    assert f"train.log (a link to {outside}: the link removed, {outside} untouched)" in proc.stderr
    log = run_dir / "train.log"
    assert not log.is_symlink() and "done: 3 optimizer steps" in log.read_text()  # the new run's own log
