"""The strategies other modules name by role, not by name (torch-free, imports nothing)."""

# everything replicated: what the others are timed and compared against, and a case's default
REFERENCE_STRATEGY = "ddp"
# params, grads and optimizer state sharded over every rank (16Ψ/N): what ``predict`` answers by default
FULL_SHARD_STRATEGY = "zero3"
