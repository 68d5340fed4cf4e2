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

# ---- units ----------------------------------------------------------------------------------------------
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")  # powers of 1024

# ---- issue 23: checkpointing, measured (fsdpbench/engine/checkpoint.py) and predicted ------------------
# CheckpointRecord field → column; every one per rank (the case's figure: rank 0's, or the max over ranks)
CHECKPOINT_COLUMNS = {
    "method": "ckpt_method",  # str, same on every rank: the case's checkpoint method
    "with_optimizer": "ckpt_with_optimizer",  # bool, same on every rank
    "save_s": "ckpt_save_s",  # s, wall of the save on this rank (case: max over ranks)
    "save_blocked_s": "ckpt_save_blocked_s",  # s, wall the loop waited (async: until staged; max)
    "load_s": "ckpt_load_s",  # s, wall of the load into a fresh model and optimizer (max)
    "bytes_written": "ckpt_bytes_written",  # B, this rank's files on disk (case: sum over ranks)
    "files": "ckpt_files",  # count, this rank's files (case: sum)
    "save_host_peak_bytes": "mem_rss_ckpt_save_peak_bytes",  # B, RSS peak above the phase's baseline
    "load_host_peak_bytes": "mem_rss_ckpt_load_peak_bytes",  # B, RSS peak above the load's baseline
    "save_device_peak_bytes": "mem_alloc_ckpt_save_peak_bytes",  # B, CUDA allocator peak (GPU only)
    "load_device_peak_bytes": "mem_alloc_ckpt_load_peak_bytes",  # B, CUDA allocator peak (GPU only)
    "state_equal": "ckpt_state_equal",  # bool, loaded local state == saved, tensor by tensor (all ranks)
    "loss_uninterrupted": "ckpt_loss_uninterrupted",  # the step after the save, without the round trip
    "loss_after_load": "ckpt_loss_after_load",  # the same step after the load (this rank's loss)
    "loss_equal": "ckpt_loss_equal",  # bool, the two losses are equal (all ranks)
}
CKPT_BYTES = CHECKPOINT_COLUMNS["bytes_written"]
CKPT_SAVE_HOST_PEAK = CHECKPOINT_COLUMNS["save_host_peak_bytes"]
CKPT_SAVE_S = CHECKPOINT_COLUMNS["save_s"]
CKPT_LOAD_S = CHECKPOINT_COLUMNS["load_s"]
# the analytic prediction (fsdpbench/predictors/checkpoint.py), per rank, labelled modelled
PRED_CKPT_BYTES = "pred_ckpt_bytes"  # B, this rank's files (payload + the format's framing and metadata)
PRED_CKPT_PAYLOAD_BYTES = "pred_ckpt_payload_bytes"  # B, the saved tensors' bytes in this rank's files
PRED_CKPT_HOST_PEAK = "pred_ckpt_save_host_peak_bytes"  # B, host memory the save adds on this rank
PRED_CKPT_DEVICE_TRANSIENT = "pred_ckpt_device_transient_bytes"  # B, device memory while gathering
PRED_CKPT_BYTES_ERR = "pred_ckpt_bytes_err"  # (pred - measured) / measured, this rank's bytes
PRED_CKPT_HOST_PEAK_ERR = "pred_ckpt_save_host_peak_err"  # (pred - measured) / measured
# a case's checkpoint figures (fsdpbench/analysis/checkpoint.py), one per case row
CKPT_CASE_BYTES = "ckpt_case_bytes_written"  # B, sum over ranks of the files written
PRED_CKPT_CASE_BYTES = "pred_ckpt_case_bytes"  # B, modelled, sum over ranks
CKPT_RANK0_HOST_PEAK = "mem_rss_ckpt_save_rank0_peak_bytes"  # B, rank 0's RSS peak above its baseline
PRED_CKPT_RANK0_HOST_PEAK = "pred_ckpt_save_rank0_host_peak_bytes"  # B, modelled, rank 0
CKPT_CASE_SAVE_S = "ckpt_case_save_s"  # s, max over ranks (the save ends when the slowest rank's does)
CKPT_CASE_LOAD_S = "ckpt_case_load_s"  # s, max over ranks
CKPT_ROUND_TRIP_OK = "ckpt_round_trip_ok"  # bool, every rank's state and loss equal after the load
