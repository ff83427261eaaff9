"""Models, their norms, EMA, activation checkpointing, optimizers and schedulers, each a factory chosen by config.

The built-in model factories are named here, as `_target_` paths take them (`model._target_=accutrain.models.mlp`);
they live in accutrain.models.factories.
"""
from accutrain.models.factories import CharLM, char_lm, cnn, mlp, torchvision_classifier

__all__ = ["CharLM", "char_lm", "cnn", "mlp", "torchvision_classifier"]
