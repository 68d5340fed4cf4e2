"""One rank's parallel model: wrap policy, knobs, strategy, optimizer, and the training step they run."""
