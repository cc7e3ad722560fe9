"""The profiler measures: forward latency versus input length on this machine (`planner profile`).

models.py builds or loads the model (presets, directories, config files), measure.py times the
decoder's tree forward pass, fit.py turns medians into the latency model the planner reads,
plot.py draws it, cli.py is the subcommand. Nothing here imports torch at package import time.
"""
