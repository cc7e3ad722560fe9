"""`python3 -m planner`: hands over to the workflow layer's CLI (the one allowed upward import)."""
from workflows.cli.main import main

raise SystemExit(main())
