"""The main job, `planner autotune`: profile, acceptance, plan, race, write (docs/main-job.md)."""
