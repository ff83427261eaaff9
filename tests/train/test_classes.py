"""The data's class names by output index, recorded where a run's user looks: the log's data line (once), the
checkpoints, status.json and the exported weights — read back by a process of their own."""
import json
import subprocess
import sys

import pytest
from conftest import assert_one_line_user_error, make_image_folder, train_here, train_run

from accutrain.errors import UserError

READ_BACK = """
import json, sys
from pathlib import Path
import torch
from accutrain.store.classes import from_weights
run = Path(sys.argv[1])
print(json.dumps(dict(
    checkpoint=torch.load(run / "checkpoints" / "last.pt", weights_only=True)["classes"],
    best=torch.load(run / "checkpoints" / "best.pt", weights_only=True)["classes"],
    status=json.loads((run / "status.json").read_text())["classes"],
    export=from_weights(run / "model.safetensors"))))
"""


def test_an_image_folders_class_names_are_in_the_log_checkpoint_status_and_export(tmp_path):
    root = make_image_folder(tmp_path / "shapes", classes=("circle", "square", "triangle"))
    run_dir, proc = train_run(tmp_path, "run", "model=cnn", "data=imagefolder", f"data.root={root}",
                              "data.image_size=8", "loader.num_workers=0", "micro_batch=6", "trainer.epochs=1",
                              "trainer.progress=false", "trainer.export=weights")
    log = (run_dir / "train.log").read_text()
    assert "18 train / 6 val, 3×8×8, 3 classes (0 circle, 1 square, 2 triangle)" in log
    assert log.count("circle") == 1 and log.count("3 classes") == 1  # named once, counted once
    read = subprocess.run([sys.executable, "-c", READ_BACK, str(run_dir)], capture_output=True, text=True,
                          check=True)
    names = ["circle", "square", "triangle"]
    assert json.loads(read.stdout) == dict(checkpoint=names, best=names, status=names, export=names)



def test_a_resume_onto_other_class_names_is_refused_in_one_line(tmp_path):
    root = make_image_folder(tmp_path / "shapes", classes=("circle", "square", "triangle"))
    args = ["model=cnn", "data=imagefolder", f"data.root={root}", "data.image_size=8", "loader.num_workers=0",
            "micro_batch=6", "trainer.progress=false"]
    run_dir, _ = train_here(tmp_path, "run", *args, "trainer.epochs=1")
    for split in ("train", "val"):  # square → box: box, circle, triangle — output 0 would mean another class
        (root / split / "square").rename(root / split / "box")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "run", *args, "trainer.epochs=2", "resume=auto")
    assert_one_line_user_error(info.value, "step-00000003.pt was trained on other classes: its output 0 is 'circle', "
                               "this data's 'box'", "resume with the same class names")
