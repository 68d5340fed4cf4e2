"""Results rows → per-case frames, the summary table and the regression gate (torch-free)."""
