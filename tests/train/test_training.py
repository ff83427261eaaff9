"""Runs that learn, on each dataset, and what a run records."""
import json

from conftest import TINY, make_image_folder, read_metrics, train_here


def test_digits_run(tmp_path):
    run_dir, _ = train_here(tmp_path, "digits", "model=mlp", "data=digits", "trainer.epochs=3",
                            "micro_batch=16", "accum=2", "trainer.progress=false")
    _, evals = read_metrics(run_dir)
    assert evals[-1]["val_acc"] > 0.85


def test_synthetic_cnn_run_learns(tmp_path):
    run_dir, _ = train_here(tmp_path, "synthetic", "debug=fast", "model=cnn", "data.size=300", "trainer.epochs=4",
                            "micro_batch=8", "accum=2", "optim=adamw")
    _, evals = read_metrics(run_dir)
    assert evals[-1]["val_acc"] > 0.5  # ten classes: chance is 0.1


def test_imagefolder_run(tmp_path):
    root = make_image_folder(tmp_path / "images")
    run_dir, log = train_here(tmp_path, "folder", "model=cnn", "data=imagefolder", f"data.root={root}",
                              "data.image_size=8", "loader.num_workers=0", "micro_batch=4", "accum=2",
                              "trainer.epochs=2", "trainer.progress=false")
    assert "18 train / 6 val, 3×8×8, 3 classes" in log
    assert len(read_metrics(run_dir)[0]) == 6  # 18 samples / 8 → 2 full windows + 1 of 2, over 2 epochs


def test_metrics_lines_are_json_and_the_first_records_the_plan(tmp_path):
    run_dir, _ = train_here(tmp_path, "run", *TINY, "data.size=30", "trainer.max_steps=1")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {"kind": "plan", "plan": dict(effective=32, micro_batch=32, accum=1, devices=1, train_size=30,
                                                       steps_per_epoch=1, total_steps=1, last_window="step",
                                                       schedule=None, micro_tokens=None)}
    assert [r["step"] for r in records[1:]] == [1, 1]  # the step, then its evaluation
