"""A dataset of your own for `data=custom` (docs/config.md):
`accutrain data=custom data._target_=examples.mydata.make +data.size=1000`, run from the repository's top folder.

accutrain calls the factory with the data node's keys and the run's `seed`; it returns accutrain's `Datasets`: the
training and validation splits, the number of classes, the shape of one sample and a description for the log."""
import torch

from accutrain.data.datasets import Datasets, InMemory


def make(size: int, seed: int, val_size: int = 32, **_) -> Datasets:
    """Two classes of random 1×8×8 images: the sign of an image's mean is its class."""
    g = torch.Generator().manual_seed(seed)

    def split(n: int) -> InMemory:
        x = torch.randn(n, 1, 8, 8, generator=g)
        return InMemory(x, (x.mean(dim=(1, 2, 3)) > 0).long())

    return Datasets(split(size), split(val_size), 2, (1, 8, 8), f"two classes by sign ({size} samples)")
