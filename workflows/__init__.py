"""Workflows: the `planner` command and the jobs on top of everything (autotune, Optuna tune, report)."""
