"""The run pipeline: scenario → cases → ranks (launch, worker) → rank records → rows → run directory."""
