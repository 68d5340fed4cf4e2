"""Imported by the fork server only (launch.py preloads it, first): importing it is the act of tying
the fork server's life to the orchestrator's, so no rank outlives a killed ``fsdpbench run``, of
making every rank deaf to SIGINT, and of taking the fork server's output off the terminal. The fork
server reads its SIGINT disposition after its preloads and hands it to each process it forks, so the
ranks start ignoring a terminal's Ctrl-C, which the orchestrator answers by stopping them
(pipeline/interrupts.py). Its file descriptors 1 and 2 point at /dev/null before torch is imported:
the C++ libraries' import-time lines (c10d's "debug level is set to DETAIL" under
TORCH_DISTRIBUTED_DEBUG) are not the user's to read, and every process it forks points them at its
own log first thing (a rank's rank{R}.log, a probe process's, the traced predictor's). Nothing else
imports this module."""

import os

from fsdpbench.pipeline.interrupts import ignore_sigint
from fsdpbench.pipeline.lifeline import die_with_parent, send_output_to

die_with_parent()
ignore_sigint()
send_output_to(os.devnull)
