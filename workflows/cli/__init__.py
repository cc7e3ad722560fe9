"""The `planner` command: one cmd_*.py per subcommand, and the inputs they share."""
