"""Imported by the fork server only (launch.py preloads it): importing it is the act of tying the
fork server's life to the orchestrator's, so no rank outlives a killed ``fsdpbench run``.
Nothing else imports this module."""

from fsdpbench.pipeline.lifeline import die_with_parent

die_with_parent()
