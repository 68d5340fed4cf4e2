"""Every model family, declared as plain data (no torch): one file each, imported here to register it."""

from fsdpbench.models.families import decoder, hf, mlp, mnist_cnn  # noqa: F401  (registration)
