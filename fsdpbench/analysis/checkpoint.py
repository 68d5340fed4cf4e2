"""A case's checkpoint figures from its ranks' rows: bytes summed over ranks, rank 0's host peak (the
rank that holds a full state dict), the slowest rank's save and load, and whether the round trip held."""

from __future__ import annotations

from typing import Any

import pandas as pd

from fsdpbench.core import schema

_COLUMN = schema.CHECKPOINT_COLUMNS


def checkpoint_case_columns(ranks: pd.DataFrame) -> dict[str, Any]:
    """The case-level checkpoint columns (none when the case ran no checkpoint phase)."""
    if _COLUMN["method"] not in ranks or ranks[_COLUMN["method"]].isna().all():
        return {}
    rank0 = ranks[ranks[schema.RANK] == 0]

    def of_rank0(column: str) -> Any:
        return rank0[column].iloc[0] if column in rank0 and not rank0.empty else None

    def total(column: str) -> Any:
        values = pd.to_numeric(ranks[column], errors="coerce") if column in ranks else pd.Series(dtype=float)
        return int(values.sum()) if values.notna().all() and len(values) else None

    def slowest(column: str) -> Any:
        return pd.to_numeric(ranks[column], errors="coerce").max() if column in ranks else None

    checks = [_COLUMN["state_equal"], _COLUMN["loss_equal"]]
    present = all(c in ranks for c in checks)
    round_trip = present and bool(ranks[checks].fillna(False).astype(bool).all().all())
    return {
        schema.CKPT_CASE_BYTES: total(schema.CKPT_BYTES),
        schema.PRED_CKPT_CASE_BYTES: total(schema.PRED_CKPT_BYTES),
        schema.CKPT_RANK0_HOST_PEAK: of_rank0(schema.CKPT_SAVE_HOST_PEAK),
        schema.PRED_CKPT_RANK0_HOST_PEAK: of_rank0(schema.PRED_CKPT_HOST_PEAK),
        schema.CKPT_CASE_SAVE_S: slowest(schema.CKPT_SAVE_S),
        schema.CKPT_CASE_LOAD_S: slowest(schema.CKPT_LOAD_S),
        schema.CKPT_ROUND_TRIP_OK: round_trip,
    }
