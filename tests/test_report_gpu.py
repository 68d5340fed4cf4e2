"""The report of a real GPU run (the H100 reference: decoder-base on 1 GPU, fp32 and bf16) names what
tells its groups apart and says why a 1-rank case has no communication figures."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fsdpbench.report.data import build_case_frame
from fsdpbench.report.figures_perf import build_comm_bytes_panel
from fsdpbench.report.tables import NO_COMM, compare_rows, glance_groups

H100_RUN = Path(__file__).parent / "data" / "gpu-h100" / "single_gpu_decoder-base_results.parquet"


@pytest.fixture(scope="module")
def cases() -> pd.DataFrame:
    results = pd.read_parquet(H100_RUN)
    results["run"] = "h100"
    return build_case_frame(results)


def test_group_titles_name_the_precision_that_tells_them_apart(cases):
    titles = [title for title, _ in glance_groups(cases)]
    assert sorted(titles) == ["1 GPU (NCCL), decoder-base, bf16", "1 GPU (NCCL), decoder-base, fp32"]


def test_one_rank_cases_say_no_communication_between_ranks(cases):
    for _, group in glance_groups(cases):
        rows = {r.metric: r for r in compare_rows(group)}
        comm = rows["comm / step / rank: measured / predicted"]
        assert set(comm.text.values()) == {NO_COMM} and comm.winners == []
        assert set(rows["overlap"].text.values()) == {NO_COMM}
        # the GPU's own sources are there, named
        assert all(t != "—" for t in rows["NVML peak (GPU)"].text.values())
    assert (
        build_comm_bytes_panel(cases).missing
        == "no communication between ranks: every case ran on one rank (world size 1)"
    )
