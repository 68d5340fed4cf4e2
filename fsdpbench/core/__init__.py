"""The lowest layer: plain data and the checks every reader and writer above it shares."""
