"""`planner tune`: Optuna search over the planner's and decoder's knobs (docs/tune.md)."""
