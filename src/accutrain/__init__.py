"""accutrain: gradient accumulation whose every optimizer step is exactly the big batch's step."""

__version__ = "0.1.0"
