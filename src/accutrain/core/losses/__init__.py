"""The loss families (`loss=`), one module each — its maths and the Loss members (accutrain.core.loss) — beside its
torch-free spec (`<family>_spec.py`: its config schema, its traits, its refusals), which accutrain.config.families
discovers before PyTorch loads. This package itself imports nothing, so reading the specs stays cheap."""
