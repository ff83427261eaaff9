"""The batch arithmetic: effective batch, derived accum, optimizer steps per epoch and in total."""
import pytest

from accutrain.core.options import LastWindow
from accutrain.core.plan import derive_accum, make_plan
from accutrain.errors import UserError


def plan(**kw):
    args = dict(micro_batch=8, accum=4, devices=1, global_batch=None, train_size=110,
                last_window=LastWindow.step, epochs=2, max_steps=None)
    return make_plan(**{**args, **kw})


def test_effective_batch_is_the_product():
    p = plan(micro_batch=8, accum=4, devices=2, train_size=1000)
    assert p.effective == 64


def test_incomplete_last_window_is_a_step_by_default():
    p = plan()  # 110 = 3 × 32 + 14
    assert (p.tail, p.steps_per_epoch, p.total_steps) == (14, 4, 8)


def test_drop_policy_drops_the_tail_and_its_step():
    p = plan(last_window=LastWindow.drop)
    assert (p.steps_per_epoch, p.total_steps, p.steps_per_epoch * p.effective) == (3, 6, 96)


def test_windows_that_tile_the_epoch_have_no_tail():
    p = plan(train_size=128)
    assert (p.tail, p.steps_per_epoch) == (0, 4)


def test_max_steps_cuts_epochs_short_and_counts_epochs_begun():
    p = plan(epochs=10, max_steps=9)
    assert (p.total_steps, p.total_epochs) == (9, 3)
    p = plan(epochs=None, max_steps=9)
    assert (p.total_steps, p.total_epochs) == (9, 3)
    p = plan(epochs=1, max_steps=100)
    assert (p.total_steps, p.total_epochs) == (4, 1)


def test_accum_derived_from_global_batch():
    assert derive_accum(micro_batch=4, devices=1, accum=None, global_batch=32) == 8
    assert derive_accum(micro_batch=4, devices=2, accum=None, global_batch=32) == 4
    assert derive_accum(micro_batch=4, devices=2, accum=4, global_batch=32) == 4  # agreeing is fine
    assert derive_accum(micro_batch=4, devices=1, accum=None, global_batch=None) == 1
    assert derive_accum(micro_batch=4, devices=1, accum=3, global_batch=None) == 3


def test_global_batch_not_divisible_names_the_numbers():
    with pytest.raises(UserError, match=r"global_batch=100 is not a multiple of micro_batch 8 × devices 1 = 8"):
        derive_accum(micro_batch=8, devices=1, accum=None, global_batch=100)


def test_global_batch_contradicting_accum_names_the_numbers():
    with pytest.raises(UserError, match=r"accum=4 contradicts global_batch=64 .* accum 8"):
        derive_accum(micro_batch=8, devices=1, accum=4, global_batch=64)


def test_drop_with_a_batch_larger_than_the_data_is_refused():
    with pytest.raises(UserError, match="larger than the 110 training samples"):
        plan(micro_batch=128, accum=1, last_window=LastWindow.drop)


def test_start_up_lines():
    lines = plan().describe()
    assert lines[0] == "effective batch 32 = micro_batch 8 × accum 4 × devices 1"
    assert "4 optimizer steps per epoch (3 windows of 32 + 1 of 14 samples), 8 in total over 2 epochs" in lines[1]


@pytest.mark.parametrize("micro_batch, says", [
    (64, "2 optimizer steps per epoch (1 window of 64 + 1 of 46 samples), 4 in total over 2 epochs"),
    (128, "1 optimizer step per epoch (1 window of all 110 samples), 2 in total over 2 epochs"),
    (110, "1 optimizer step per epoch (1 window of 110), 2 in total over 2 epochs"),
])
def test_start_up_lines_count_in_the_singular_where_there_is_one(micro_batch, says):
    assert says in plan(micro_batch=micro_batch, accum=1).describe()[1]
