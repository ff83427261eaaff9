"""The data checked once, cheaply, at start (accutrain.data.checks), and a sample that fails later — in a loader's
worker process too — named in one line (accutrain.core.samples); text records whose fields are not strings; a key a
factory takes no argument for (issue 32)."""
import json

import pytest
import torch
from conftest import assert_one_line_user_error, run_of
from torch.utils.data import Dataset

from accutrain.config.targets import instantiate
from accutrain.core.batches import BatchFormat
from accutrain.core.loader import window_loader
from accutrain.core.options import LastWindow
from accutrain.core.plan import make_plan
from accutrain.core.windows import WindowSampler
from accutrain.data.checks import prepare
from accutrain.data.datasets import Datasets, InMemory, eval_loader
from accutrain.data.text import text_data


def made(n=64, nval=8, classes=3, train_labels=None, val_labels=None, dtype=torch.int64):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 4, 4, generator=g), torch.randint(3, (n,), generator=g).to(dtype)
    yv = y[:nval].clone()
    for i, v in (train_labels or {}).items():
        y[i] = v
    for i, v in (val_labels or {}).items():
        yv[i] = v
    return Datasets(InMemory(x, y), InMemory(x[:nval], yv), classes, (1, 4, 4), "test data")


def refused(compose, data, *fragments, overrides=()):
    with pytest.raises(Exception) as info:
        prepare(data, run_of("debug=fast", *overrides))
    assert_one_line_user_error(info.value, *fragments)


def test_good_data_passes_unchanged(compose):
    data = made()
    datasets, batches = prepare(data, run_of("debug=fast"))
    assert datasets is data and isinstance(batches, BatchFormat)


def test_reading_the_first_samples_draws_from_no_random_stream(compose):
    """A dataset that draws from the global generators: the run trains as it would without the check."""
    class Draws(InMemory):
        def __getitem__(self, i):
            torch.rand(1)
            return super().__getitem__(i)

    data = made()
    data.train = Draws(data.train.images, data.train.labels)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    prepare(data, run_of("debug=fast"))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("data, fragments", [
    ({"train": 1}, ["data._target_=accutrain.data.synthetic returned a dict, not an accutrain.data.Datasets("]),
    (made(classes=1), ["returned num_classes=1: expected an integer, 2 or more"]),
    (made(n=0), ["its training split is empty (0 samples)"]),
    (made(nval=0), ["its held-out split is empty (0 samples): evaluation needs at least one sample"]),
    (made(train_labels={40: 7}), ["training sample 40 has label 7: out of range for the data's 3 classes (expected "
                                  "0 … 2)"]),
    (made(val_labels={3: 3}), ["held-out sample 3 has label 3: out of range for the data's 3 classes"]),
    (made(train_labels={12: -1}), ["training sample 12 has label -1"]),
    (made(train_labels={12: -100}), ["training sample 12 has label -100",
                                     "a sample cannot be ignored (loss.ignore_index=-100)"]),
    (made(dtype=torch.float32), ["target is torch.float32 of shape scalar: cross-entropy takes class indices as "
                                 "integers"]),
    (made(dtype=torch.int32), ["target is torch.int32", "convert them (labels.long())"]),
])
def test_data_mistakes_are_one_line_naming_the_sample(compose, data, fragments):
    refused(compose, data, *fragments)


def test_ignore_index_on_class_targets_is_refused_unless_the_terms_are_counted(compose):
    """One class per sample and a mean over the samples: a sample whose label is ignore_index would add nothing to
    the loss yet count in |W|. Counting elements (loss.normalize=elements) counts only the samples not ignored."""
    refused(compose, made(), "loss.ignore_index=2 on one class per sample", "loss.normalize=elements",
            overrides=["loss.ignore_index=2"])
    prepare(made(train_labels={12: 2}), run_of("debug=fast", "loss.ignore_index=2", "loss.normalize=elements"))


def test_element_targets_may_be_ignore_index_and_nothing_else_out_of_range(compose):
    tokens = torch.randint(1, 5, (40, 6))
    targets = tokens.clone()
    targets[:, -2:] = -100  # padding
    ok = Datasets(InMemory(tokens, targets), InMemory(tokens[:4], targets[:4]), 5, (6,), "sequences")
    prepare(ok, run_of("debug=fast", "model=char_lm"))
    targets[30, 1] = 9
    refused(compose, ok, "training sample 30 at position (1,) has target 9: expected a class index 0 … 4, or "
            "loss.ignore_index=-100", overrides=["model=char_lm"])


def test_float_class_probabilities_per_sample_are_targets(compose):
    data = made()
    soft = torch.softmax(torch.randn(64, 3), 1)
    data.train, data.val = InMemory(data.train.images, soft), InMemory(data.val.images, soft[:8])
    prepare(data, run_of("debug=fast"))


class Raises(Dataset):
    """Sample `bad` raises; another sample of `odd` shape does not stack."""

    def __init__(self, n, bad=-1, odd=-1):
        self.n, self.bad, self.odd = n, bad, odd

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"cannot decode record {i}")
        return torch.ones(1, 4, 5 if i == self.odd else 4), torch.tensor(i % 3)


def test_a_sample_of_the_first_window_that_raises_or_has_another_shape(compose):
    first = 44  # of epoch 0's order for seed 0, n=64: read at start
    refused(compose, Datasets(Raises(64, bad=first), Raises(8), 3, (1, 4, 4), "x"),
            f"reading training sample {first} raised ValueError: cannot decode record {first} (test_checks.py:")
    refused(compose, Datasets(Raises(64, odd=3), Raises(8), 3, (1, 4, 4), "x"),
            "training samples 44 and 3 differ in shape ([1×4×4, scalar] and [1×4×5, scalar])")
    refused(compose, Datasets(Raises(64), Raises(8, odd=0), 3, (1, 4, 4), "x"),
            "training sample 44 and held-out sample 0 differ in shape")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_sample_that_raises_later_is_one_line_in_a_worker_too(workers):
    """Past the first window: the train loader (in this process, or a worker's) names the sample; so does the
    held-out loader."""
    plan = make_plan(micro_batch=8, accum=1, devices=1, global_batch=None, train_size=64, epochs=1,
                     last_window=LastWindow.step, max_steps=None)
    for bad, odd, fragment in ((50, -1, "reading training sample 50 raised ValueError: cannot decode record 50"),
                               (-1, 50, "differ in shape")):
        loader = window_loader(Raises(64, bad, odd), WindowSampler(plan, 0), workers, False,
                               torch.Generator().manual_seed(0))
        with pytest.raises(Exception) as info:
            for _ in loader:
                pass
        assert_one_line_user_error(info.value, fragment)
        del loader
    with pytest.raises(Exception) as info:
        for _ in eval_loader(Raises(8, bad=5), 4, workers, False, 0):
            pass
    assert_one_line_user_error(info.value, "reading held-out sample 5 raised ValueError")


def test_a_text_field_that_is_not_a_string_names_the_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"text": "hello"}, {"text": "there"}]) + "\n\n" +
                    json.dumps({"text": 12345}) + "\n")
    with pytest.raises(Exception) as info:
        text_data(str(path), None, 0.3, "bytes", 16, False, "longest", "text", "prompt", "response", "label", 0)
    assert_one_line_user_error(info.value, f'{path}:4: "text" is 12345: expected a string')


def test_a_key_the_factory_takes_no_argument_for_is_named_with_its_arguments():
    """`+data.size` to a factory without it (or debug=fast's data.size with data=custom): one line, not a
    TypeError at the call."""
    def make(n: int, seed: int = 0):
        return n

    import sys
    import types
    module = types.ModuleType("made_here")
    module.make = make
    sys.modules["made_here"] = module
    try:
        with pytest.raises(Exception) as info:
            instantiate("data", {"_target_": "made_here.make", "n": 3, "size": 300})
        assert_one_line_user_error(info.value, "data.size=300: data._target_=made_here.make takes no argument "
                                   "'size' (its arguments: n, seed): remove it with ~data.size")
        assert instantiate("data", {"_target_": "made_here.make", "n": 3}) == 3
    finally:
        del sys.modules["made_here"]
