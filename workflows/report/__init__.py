"""`planner report`: the figures and the index page (docs/reports.md)."""
