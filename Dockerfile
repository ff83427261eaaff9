# The image docs/cluster.md's Kubernetes recipe names: accutrain installed from this repository (it is not on PyPI).
#   docker build -t your-registry/accutrain:latest .
# PyTorch's Linux wheels carry their CUDA libraries: the image runs on a GPU node whose driver the container runtime
# exposes (the NVIDIA container toolkit), and on the CPU elsewhere. The command is the TrainJob's (torchrun -m …).
FROM python:3.11-slim
WORKDIR /opt/accutrain
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN pip install --no-cache-dir .
WORKDIR /workspace
CMD ["accutrain", "--help"]
