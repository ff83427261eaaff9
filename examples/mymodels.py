"""A model of your own for `model=custom` (docs/config.md): the README's
`accutrain model=custom model._target_=examples.mymodels.Net +model.depth=4`, run from the repository's top folder.

accutrain calls the class with the data's `num_classes`, `in_channels` and `image_size`, and the model node's other
keys (`+model.depth=4`) as keyword arguments."""
import torch
import torch.nn as nn


class Net(nn.Module):
    """`depth` hidden layers as wide as the flattened image, then a linear layer to the classes."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int, depth: int = 2):
        super().__init__()
        width = in_channels * image_size ** 2
        self.body = nn.Sequential(nn.Flatten(), *[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                                  for _ in range(depth)], nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
