"""Datasets, the views of their samples (augmentation), text and tokenizers.

The built-in datasets' factories and the types a user's data returns are named here, as `_target_` paths take them
(`data._target_=accutrain.data.digits`); they live in accutrain.data.datasets.
"""
from accutrain.data.datasets import Datasets, InMemory, digits, sequences, synthetic, torchvision_dataset
from accutrain.data.folders import image_folder

__all__ = ["Datasets", "InMemory", "digits", "image_folder", "sequences", "synthetic", "torchvision_dataset"]
