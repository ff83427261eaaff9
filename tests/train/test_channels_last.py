"""trainer.channels_last: the model's 4-D weights and the images in NHWC memory format — the same steps as the
contiguous run (another summation order: float rounding), on one device and on 2 ranks, and a bit-identical resume."""
import pytest
import torch
from conftest import assert_identical, final_weights, rewind, run_of, train_here

from accutrain.core.precision import make_precision
from accutrain.dist import World
from accutrain.train.build import build

CNN = ["debug=fast", "model=cnn", "model.channels=[8,16]", "data.size=96", "data.channels=3", "micro_batch=8",
       "accum=4", "optim=sgd", "optim.lr=0.1"]


def test_images_go_channels_last_and_everything_else_as_it_is():
    precision = make_precision("bf16-true", torch.device("cpu"), channels_last=True)
    image = precision.inputs(torch.randn(2, 3, 5, 5))
    assert image.is_contiguous(memory_format=torch.channels_last) and image.dtype == torch.bfloat16
    tokens = precision.inputs(torch.arange(6).reshape(2, 3))
    assert tokens.dtype == torch.int64 and tokens.is_contiguous()
    plain = make_precision("32", torch.device("cpu")).inputs(torch.randn(2, 3, 5, 5))
    assert not plain.is_contiguous(memory_format=torch.channels_last)


def test_the_built_model_holds_its_convolutions_channels_last():
    parts = build(run_of(*CNN, "trainer.channels_last=true"), World(), torch.device("cpu"))
    convolutions = [p for p in parts.model.parameters() if p.dim() == 4]
    assert convolutions and all(p.is_contiguous(memory_format=torch.channels_last) for p in convolutions)
    assert parts.precision.channels_last


@pytest.mark.slow
def test_channels_last_takes_the_contiguous_runs_steps_on_one_device_and_two_ranks(tmp_path):
    plain, _ = train_here(tmp_path, "plain", *CNN)
    nhwc, _ = train_here(tmp_path, "nhwc", *CNN, "trainer.channels_last=true")
    two, _ = train_here(tmp_path, "two", *CNN, "trainer.channels_last=true", "devices=2", "accum=2")
    reference = final_weights(plain)
    for run in (nhwc, two):
        for key, value in final_weights(run).items():
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
def test_a_channels_last_run_resumes_bit_identically(tmp_path):
    args = [*CNN, "trainer.channels_last=true", "optim.momentum=0.9", "trainer.checkpoint_every=1",
            "trainer.keep_checkpoints=20"]
    run, _ = train_here(tmp_path, "run", *args)
    uninterrupted = final_weights(run)
    rewind(run, 3)  # the momentum buffers come back from the checkpoint into channels_last weights
    resumed, log = train_here(tmp_path, "run", *args, "resume=auto")
    assert "at optimizer step 3" in log
    assert_identical(final_weights(resumed), uninterrupted)
