"""Values PyTorch or the maths refuse are refused before PyTorch loads, in one line naming the key, the value and what
is valid (issue 32) — and a value they accept is not."""
import pytest
from conftest import assert_one_line_error, run_cli

from accutrain.cli.command import check
from accutrain.config.validate import validate
from accutrain.errors import UserError, one_line

REFUSED = [
    (["optim.momentum=-0.5"], "optim.momentum=-0.5 is not valid: expected 0 (none) or a positive, finite momentum"),
    (["optim.momentum=nan"], "optim.momentum=nan is not valid"),
    (["optim=adamw", "optim.betas=[2,0.5]"], "optim.betas=[2.0, 0.5] is not valid: expected two decays"),
    (["optim=adamw", "optim.betas=[0.9]"], "optim.betas=[0.9] is not valid: expected two decays [β1, β2], each 0 <= β"),
    (["optim=adamw", "optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] is not valid"),
    (["optim=adamw", "optim.eps=-1"], "optim.eps=-1.0 is not valid: expected a positive, finite number"),
    (["optim=adamw", "optim.eps=0"], "optim.eps=0.0 is not valid"),
    (["optim.weight_decay=-1"], "optim.weight_decay=-1.0 is not valid: expected 0 (none) or a positive, finite decay"),
    (["optim=adamw", "optim.weight_decay=nan"], "optim.weight_decay=nan is not valid"),
    (["optim.lr=nan"], "optim.lr=nan is not valid: expected a positive, finite learning rate"),
    (["optim.lr=inf"], "optim.lr=inf is not valid"),
    (["optim.lr=-0.1"], "optim.lr=-0.1 is not valid"),
    (["optim.nesterov=true", "optim.momentum=0"], "optim.nesterov=true needs momentum: optim.momentum=0"),
    (["trainer.grad_clip=nan"], "trainer.grad_clip=nan is not valid: expected a positive norm or null"),
    (["trainer.min_delta=nan"], "trainer.min_delta=nan is not valid: expected a finite number, 0 or more"),
    (["trainer.min_delta=-0.1"], "trainer.min_delta=-0.1 is not valid"),
    (["trainer.min_delta=inf"], "trainer.min_delta=inf is not valid"),
    (["seed=99999999999999999999"], "seed=99999999999999999999 is not valid: expected an integer from "
                                    "-9223372036854775808 to 18446744073709551615"),
    (["seed=-9223372036854775809"], "seed=-9223372036854775809 is not valid"),
    (["debug=fast", "data.seed=18446744073709551616"], "data.seed=18446744073709551616 is not valid"),
    (["sched.min_lr_ratio=-1"], "sched.min_lr_ratio=-1.0 is not valid: expected a fraction of the peak lr, 0 <= ratio"),
    (["sched.min_lr_ratio=5"], "sched.min_lr_ratio=5.0 is not valid"),
    (["sched.min_lr_ratio=nan"], "sched.min_lr_ratio=nan is not valid"),
    (["model=mlp", "model.hidden=[0]"], "model.hidden=[0] is not valid: expected a list of positive sizes"),
    (["model=mlp", "model.hidden=[64,-3]"], "model.hidden=[64, -3] is not valid"),
    (["model=cnn", "model.channels=[0]"], "model.channels=[0] is not valid"),
    (["model=char_lm", "model.hidden=0"], "model.hidden=0 is not valid: expected a positive size"),
    (["model=mlp", "model.dropout=1.5"], "model.dropout=1.5 is not valid: expected a probability between 0 and 1"),
    (["debug=fast", "data.num_classes=1"], "data.num_classes=1 is not valid: expected 2 or more classes"),
    (["augment.mixup_alpha=nan"], "augment.mixup_alpha=nan is not valid"),
    (["micro_batch=auto", "global_batch=32", "trainer.device=cpu"],
     "micro_batch=auto on the CPU needs trainer.memory_budget_mb=N"),
]


@pytest.mark.parametrize("overrides, message", REFUSED)
def test_values_pytorch_or_the_maths_refuse_are_one_line(compose, overrides, message):
    with pytest.raises(UserError) as info:
        validate(compose(*overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["optim.momentum=0"], ["optim.nesterov=true"], ["optim=adamw", "optim.betas=[0,0.5]", "optim.eps=1e-12"],
    ["optim.weight_decay=0"], ["sched.min_lr_ratio=0"], ["sched.min_lr_ratio=1"], ["trainer.grad_clip=inf"],
    ["seed=18446744073709551615"], ["seed=-9223372036854775808"], ["model=mlp", "model.dropout=1"],
    # a _target_ of the user's takes what its own code accepts: only accutrain's own optimizer's keys are checked
    ["optim._target_=mypkg.optim.make", "optim.momentum=-1"], ["sched._target_=mypkg.sched", "sched.min_lr_ratio=7"],
    ["model=mlp", "model._target_=mypkg.mlp", "model.hidden=[0]"],
])
def test_values_pytorch_accepts_pass(compose, overrides):
    validate(compose(*overrides))


def test_micro_batch_auto_on_a_cpu_found_by_device_auto_is_refused_before_the_run(monkeypatch):
    """trainer.device=auto needs PyTorch to know there is no CUDA: refused by the placement, which runs before the
    run directory is made."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as info:
        check(["debug=fast", "micro_batch=auto", "global_batch=32"], decide=False)
    assert "micro_batch=auto on the CPU needs trainer.memory_budget_mb=N" in one_line(info.value)


def test_the_largest_seed_torch_accepts_trains(tmp_path):
    """Every stream derived from the seed (an epoch's order, a synthetic sample) is taken modulo 2**64, as torch takes
    a seed: the largest seed works, and a negative one draws what its value modulo 2**64 draws."""
    import torch

    from accutrain.seeding import derived_seed, generator

    assert derived_seed(3, 7) == 3 * 1_000_003 + 7  # the streams of every seed that worked before are unchanged
    big = 2**64 - 1
    torch.randn(2, generator=generator(big, 10**6))  # overflowed: RuntimeError / ValueError before
    assert torch.equal(torch.randn(3, generator=generator(-5, 2)), torch.randn(3, generator=generator(2**64 - 5, 2)))


@pytest.mark.parametrize("args, fragment", [
    (["optim.momentum=-0.5"], "optim.momentum=-0.5 is not valid"),
    (["optim=adamw", "optim.betas=[0.9]"], "optim.betas=[0.9] is not valid"),
    (["seed=99999999999999999999"], "seed=99999999999999999999 is not valid"),
    (["optim.lr=nan"], "optim.lr=nan is not valid"),
    (["optim.nesterov=true", "optim.momentum=0"], "optim.nesterov=true needs momentum"),
    (["micro_batch=auto", "global_batch=32"], "micro_batch=auto on the CPU needs trainer.memory_budget_mb"),
])
def test_the_command_refuses_them_in_one_line_and_writes_nothing(tmp_path, args, fragment):
    """The CLI: exit 2, one line, no traceback, no run directory (the last case on a machine without CUDA, found
    after PyTorch loads, yet before the run directory is made)."""
    if args[0] == "micro_batch=auto":
        import torch

        if torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
    run_dir = tmp_path / "run"
    proc = run_cli("debug=fast", *args, f"hydra.run.dir={run_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_one_line_error(proc, fragment)
    assert not run_dir.exists()
