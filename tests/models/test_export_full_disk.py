"""trainer.export on a full disk (issue 52): one line, no half-written hf/ (the export is renamed into place whole),
and resume=auto, finding the run trained to its end but not exported, exports it then. The full disk is the
kernel's: RLIMIT_FSIZE lowered in this process while the export writes, so that safetensors' own write fails (EFBIG)
as it would with ENOSPC (Python ignores SIGXFSZ)."""
import resource

import pytest
import test_hf
from conftest import assert_one_line_user_error, train_here
from safetensors.torch import load_file

from accutrain.errors import UserError
from accutrain.models import hf

pytest.importorskip("transformers")
files, lm = test_hf.files, test_hf.lm


@pytest.fixture
def full_disk_during_export(monkeypatch):
    """Every file the export writes may hold at most 4 KiB, while it writes."""
    real = hf.export

    def export(*args, **kwargs):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return real(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(hf, "export", export)
    return monkeypatch


def test_an_export_on_a_full_disk_is_one_line_and_resume_auto_exports_it(files, tmp_path, full_disk_during_export):
    args = lm(files, "micro_batch=16", "trainer.export=hf", "trainer.epochs=1")
    with pytest.raises(UserError) as info:
        train_here(tmp_path, "run", *args)
    assert_one_line_user_error(info.value, "could not export the trained model (trainer.export=hf) to",
                               "File too large", "resume=auto exports it")
    run_dir = tmp_path / "run"
    assert not (run_dir / "hf").exists() and not list(run_dir.glob(".hf*"))  # no folder holding config.json alone
    full_disk_during_export.undo()  # room again
    _, log = train_here(tmp_path, "run", *args, "resume=auto")
    assert "nothing left to train" in log and "exporting the trained model now" in log
    weights = load_file(run_dir / "hf" / "model.safetensors")
    assert weights and (run_dir / "hf" / "config.json").is_file()
    _, again = train_here(tmp_path, "run", *args, "resume=auto")
    assert "exporting" not in again  # a whole export is not written again
