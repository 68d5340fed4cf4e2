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

# ---- issue 24: the step-time model's compute without the profiler, and where the model can be checked --
# ms, per rank: one step's compute timed without the profiler, collectives taking no time (the compute
# twin's rank 0 timed-step median, or an emulated rank's own); source fsdpbench.predictors.compute_twin
MODEL_COMPUTE_BARE = "model_compute_bare_ms"
# ratio, per rank: bare / profiled compute, the factor applied to every interval of the profiled trace
MODEL_COMPUTE_SCALE = "model_compute_scale"
# bool, same on every rank: a measured step time exists that the model describes (CPU: ranks <= cores,
# not emulated); fsdpbench.metrics.step_model.checkable
MODEL_CHECKABLE = "model_checkable"
# text, same on every rank: why the modelled step time cannot be checked here ("" when it can)
MODEL_UNCHECKED_REASON = "model_unchecked_reason"

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
    MODEL_COMPUTE_BARE,
    MODEL_COMPUTE_SCALE,
    MODEL_CHECKABLE,
    MODEL_UNCHECKED_REASON,
)

# ---- predictions against measurements: error column → (predicted, measured) --------------------------
# an error is (predicted − measured) / measured (fsdpbench.analysis.frame.relative_error)
ERROR_COLUMNS = {
    "pred_peak_err": ("pred_peak_bytes", TRACKER_PEAK),
    "pred_model_states_err": ("pred_model_states_bytes", TRACKER_MODEL_STATES),
    "traced_peak_err": ("traced_peak_bytes", TRACKER_PEAK),
    "ds_est_model_states_err": ("ds_est_model_states_bytes", TRACKER_MODEL_STATES),
}

# ---- units ----------------------------------------------------------------------------------------------
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")  # powers of 1024
