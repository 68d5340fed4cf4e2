"""fsdpbench: profile and model the memory of data-parallel sharding strategies in PyTorch."""

__version__ = "0.1.0"
