"""Imported by the fork server only (launch.py preloads it, first): importing it is the act of tying
the fork server's life to the orchestrator's, so no rank outlives a killed ``fsdpbench run``, and of
making every rank deaf to SIGINT. The fork server reads its SIGINT disposition after its preloads and
hands it to each process it forks, so the ranks start ignoring a terminal's Ctrl-C, which the
orchestrator answers by stopping them (pipeline/interrupts.py). Nothing else imports this module."""

from fsdpbench.pipeline.interrupts import ignore_sigint
from fsdpbench.pipeline.lifeline import die_with_parent

die_with_parent()
ignore_sigint()
