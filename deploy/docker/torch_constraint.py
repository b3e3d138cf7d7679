"""Prints the pip constraint that keeps the image's installed torch: ``torch==<public version>``.

Both images install torch first (the GPU one from PyPI, whose Linux wheels are CUDA builds; the CPU
one from PyTorch's CPU index) and then psg with this constraint, so that resolving psg's
dependencies can never swap torch for another build or version.

The local version label (``+cu128``, ``+cpu``) is dropped. Under PEP 440 ``torch==2.13.0`` is met by
the installed 2.13.0+cpu, while ``torch==2.13.0+cpu`` names a build only PyTorch's own index
publishes: whenever pip looks for torch again it cannot satisfy that from PyPI and fails with
ResolutionImpossible (deploy/README.md, "Building").

Run with the image's Python (``python deploy/docker/torch_constraint.py > /tmp/torch-pin.txt``).
"""

import torch

print("torch==" + torch.__version__.split("+", 1)[0])
