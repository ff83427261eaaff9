"""Datasets: the shipped digits, deterministic synthetic data, image folders, and missing data."""
import pytest
import torch
from conftest import make_image_folder

from accutrain.data.datasets import digits, synthetic, torchvision_dataset
from accutrain.data.folders import image_folder
from accutrain.errors import UserError


def test_digits_ship_with_a_fixed_held_out_split():
    d = digits()
    assert (len(d.train), len(d.val), d.num_classes, d.sample_shape) == (1438, 359, 10, (1, 8, 8))
    x, y = d.train[0]
    assert x.shape == (1, 8, 8) and 0 <= y < 10
    assert sorted(set(int(d.val[i][1]) for i in range(len(d.val)))) == list(range(10))


def test_synthetic_is_deterministic_by_seed_and_sized_by_config():
    a, b, c = synthetic(40, 10, 6, 4, 2, 1.0, seed=1), synthetic(40, 10, 6, 4, 2, 1.0, seed=1), \
        synthetic(40, 10, 6, 4, 2, 1.0, seed=2)
    assert (len(a.train), len(a.val), a.sample_shape, a.num_classes) == (40, 10, (2, 6, 6), 4)
    assert torch.equal(a.train[3][0], b.train[3][0]) and a.train[3][1] == b.train[3][1]
    assert not torch.equal(a.train[3][0], c.train[3][0])
    assert not torch.equal(a.train[0][0], a.val[0][0])


def test_synthetic_generated_lazily_equals_held_in_memory(monkeypatch):
    """Large synthetic sets are generated per sample; the values are those the in-memory copy holds."""
    import accutrain.data.datasets as data
    held = synthetic(30, 5, 6, 3, 1, 1.0, seed=4)
    monkeypatch.setattr(data, "SYNTHETIC_IN_MEMORY_BYTES", 0)
    lazy = synthetic(30, 5, 6, 3, 1, 1.0, seed=4)
    assert isinstance(lazy.train, data.Synthetic) and not isinstance(held.train, data.Synthetic)
    for split in ("train", "val"):
        for i in (0, 4):
            assert torch.equal(getattr(lazy, split)[i][0], getattr(held, split)[i][0])
            assert getattr(lazy, split)[i][1] == getattr(held, split)[i][1]


def test_image_folder_reads_train_and_val(tmp_path):
    d = image_folder(str(make_image_folder(tmp_path)), image_size=8, channels=3)
    assert (len(d.train), len(d.val), d.num_classes, d.sample_shape) == (18, 6, 3, (3, 8, 8))
    assert d.train[0][0].shape == (3, 8, 8)
    grey = image_folder(str(tmp_path), image_size=8, channels=1)
    assert grey.train[0][0].shape == (1, 8, 8)


def test_image_folder_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="no train/ folder there"):
        image_folder(str(tmp_path / "nowhere"), 8, 3)
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "val" / "a").mkdir(parents=True)
    with pytest.raises(UserError, match="no images found under"):
        image_folder(str(tmp_path), 8, 3)


def test_missing_torchvision_dataset_says_where_it_looked_and_how_to_download(tmp_path):
    with pytest.raises(UserError) as info:
        torchvision_dataset("cifar10", str(tmp_path), download=False)
    assert str(tmp_path / "cifar-10-batches-py") in str(info.value) and "data.download=true" in str(info.value)
    with pytest.raises(UserError, match="expected one of cifar10, mnist"):
        torchvision_dataset("imagenet", str(tmp_path), download=False)
