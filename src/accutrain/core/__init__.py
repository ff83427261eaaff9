"""The guarantee: the batch plan, windows, micro-batches, the loss and the step's arithmetic, precision, gradient
buffers. PyTorch only: no config library, no processes."""
