"""The names of the results table: columns, column families, tracker categories, case statuses.

Torch-free, imported by the code that writes rows and by the code that reads them (summary, report,
regress, the memory model's columns), so that a name is spelled in one place.
"""

from __future__ import annotations

# ---- statuses ----------------------------------------------------------------------------------------
OK = "ok"
SKIPPED = "skipped"
FAILED = "failed"
OOM = "oom"
TIMEOUT = "timeout"
FAILED_STATUSES = (FAILED, TIMEOUT, OOM)

# ---- memory: the live-tensor trackers (fsdpbench.metrics.tracker) ---------------------------------------
TRACKER_CATEGORIES = (
    "params",
    "params_unsharded",
    "grads",
    "grads_unsharded",
    "optim",
    "activations",
    "temp",
    "all_gather",
    "reduce_scatter",
    "inputs",
    "buffers",
    "other",
)
TRACKER_PEAK = "mem_tracker_peak_bytes"  # total at the moment of the peak
TRACKER_MODEL_STATES = "mem_tracker_model_states_bytes"  # params + grads + optimizer state after step


def tracker_peak_column(category: str) -> str:
    """The column of one tracker category at the moment of the peak."""
    return f"mem_tracker_peak_{category}_bytes"


TRACKER_PEAK_COLUMNS = (TRACKER_PEAK, *(tracker_peak_column(c) for c in TRACKER_CATEGORIES))

# ---- column families, by prefix -------------------------------------------------------------------------
MEMORY_PREFIX = "mem_"  # measured memory, each column names its source (tracker, alloc, nvml, rss, ...)
COMM_PREFIX = "comm_"  # communication volume, time and bandwidth per collective (profiled step)
OVERLAP_PREFIX = "overlap_"  # communication hidden under compute (profiled step)
PREDICTED_PREFIX = "pred_"  # the analytic memory model (fsdpbench.predictors.memory_model.columns)
TRACED_PREFIX = "traced_"  # the traced predictor (fsdpbench.predictors.traced)
VENDOR_ESTIMATE_PREFIX = "ds_est_"  # DeepSpeed's own estimator (fsdpbench.predictors.memory_model.columns)

# ---- a case's configuration, the same on every rank's row ----------------------------------------------
CONFIG_COLUMNS = tuple(
    (
        "scenario strategy world_size shard_size model model_args params wrap n_units prefetch precision "
        "optimizer batch_size global_batch_size seq_len warmup_steps timed_steps backend device device_name "
        "activation_checkpointing compile cpu_offload backward_prefetch forward_prefetch limit_all_gathers "
        "strategy_args torch_version commit case_step_time_ms throughput_samples_s throughput_tokens_s "
        "case_wall_s loss_first loss_final mode emulate_ranks"
    ).split()
)
# what two cases must share for one's step time to be compared with the other's (the reference case's);
# strategy, wrap, prefetch and shard size are what is compared
PEER_COLUMNS = tuple(
    (
        "run world_size model model_args precision optimizer batch_size seq_len activation_checkpointing "
        "compile cpu_offload device backend warmup_steps timed_steps"
    ).split()
)

# ---- step time --------------------------------------------------------------------------------------
STEP_TIME = "step_time_ms"  # a rank's median over its timed steps
CASE_STEP_TIME = "case_step_time_ms"  # the case's: its slowest rank's median
STEP_TIME_SPREAD_COLUMNS = ("step_time_p10_ms", "step_time_p90_ms", "step_time_mean_ms", "step_time_std_ms")
# the step-time model (fsdpbench.metrics.step_model)
STEP_MODEL_COLUMNS = (
    "model_step_time_ms",
    "model_compute_ms",
    "model_comm_ms",
    "model_exposed_comm_ms",
    "model_peer_wait_ms",
    "model_overlap_ratio",
    "model_link",
    "model_link_source",
    "model_method",
)

# ---- predictions against measurements: error column → (predicted, measured) --------------------------
# an error is (predicted − measured) / measured (fsdpbench.analysis.frame.relative_error)
ERROR_COLUMNS = {
    "pred_peak_err": ("pred_peak_bytes", TRACKER_PEAK),
    "pred_model_states_err": ("pred_model_states_bytes", TRACKER_MODEL_STATES),
    "traced_peak_err": ("traced_peak_bytes", TRACKER_PEAK),
    "ds_est_model_states_err": ("ds_est_model_states_bytes", TRACKER_MODEL_STATES),
}

# ---- issue 22: the CUDA caching allocator and NVML, predicted beside the measurement ----------------------
ALLOC_CONF = "alloc_conf"  # text, same on every rank: the case's PYTORCH_CUDA_ALLOC_CONF ("": defaults)
# measured (fsdpbench.metrics.allocator, fsdpbench.metrics.nvml), bytes per rank: what the predictions face
MEASURED_ALLOC_ALLOCATED = "mem_alloc_peak_allocated_bytes"  # max_memory_allocated over the memory step
MEASURED_ALLOC_RESERVED = "mem_alloc_peak_reserved_bytes"  # max_memory_reserved over the memory step
MEASURED_NVML = "mem_nvml_peak_bytes"  # NVML device memory used, peak over the case
# predicted, per rank (each rank's own stream), modelled: the traced allocation stream replayed through the
# allocator model (fsdpbench.predictors.memory_model.allocator) — CUDA cases of a --traced run only
TRACED_ALLOC_ALLOCATED = "traced_alloc_peak_allocated_bytes"  # bytes: predicted max_memory_allocated
TRACED_ALLOC_RESERVED = "traced_alloc_peak_reserved_bytes"  # bytes: predicted max_memory_reserved
TRACED_ALLOC_FRAGMENTATION = "traced_alloc_fragmentation"  # ratio: reserved but free at the allocated peak
TRACED_NVML = "traced_nvml_peak_bytes"  # bytes: predicted reserved + CUDA context + NCCL buffers
TRACED_NVML_CONTEXT = "traced_nvml_context_bytes"  # bytes: the CUDA context & libraries term used
TRACED_NVML_NCCL = "traced_nvml_nccl_bytes"  # bytes: the NCCL buffers term used
TRACED_ALLOC_ALLOCATED_ERR = "traced_alloc_peak_allocated_err"  # relative error vs MEASURED_ALLOC_ALLOCATED
TRACED_ALLOC_RESERVED_ERR = "traced_alloc_peak_reserved_err"  # relative error vs MEASURED_ALLOC_RESERVED
TRACED_NVML_ERR = "traced_nvml_peak_err"  # relative error vs MEASURED_NVML
ALLOCATOR_PREDICTION_COLUMNS = (
    TRACED_ALLOC_ALLOCATED,
    TRACED_ALLOC_RESERVED,
    TRACED_ALLOC_FRAGMENTATION,
    TRACED_NVML,
    TRACED_NVML_CONTEXT,
    TRACED_NVML_NCCL,
    TRACED_ALLOC_ALLOCATED_ERR,
    TRACED_ALLOC_RESERVED_ERR,
    TRACED_NVML_ERR,
)
CONFIG_COLUMNS = (*CONFIG_COLUMNS, ALLOC_CONF)
ERROR_COLUMNS.update(
    {
        TRACED_ALLOC_ALLOCATED_ERR: (TRACED_ALLOC_ALLOCATED, MEASURED_ALLOC_ALLOCATED),
        TRACED_ALLOC_RESERVED_ERR: (TRACED_ALLOC_RESERVED, MEASURED_ALLOC_RESERVED),
        TRACED_NVML_ERR: (TRACED_NVML, MEASURED_NVML),
    }
)

# ---- units ----------------------------------------------------------------------------------------------
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")  # powers of 1024
