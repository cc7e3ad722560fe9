"""Stop a process group when the program that started it dies without stopping it.

    python watchdog.py PARENT_PID PGID GRACE_S

VllmServer and the profile's steps worker run vLLM in a process group of their own (so that Ctrl-C in
the terminal reaches only the planner, which then stops them). A planner killed outright (SIGKILL, the
kernel's out-of-memory killer, a crash) stops nothing, and its servers would keep a core and GBs of
memory for good. This watchdog, started beside each group in a session of its own, waits for one of
two things: the group is gone (the planner stopped it: the watchdog exits), or the planner is gone
(this process was re-parented): then it sends the group SIGTERM, and SIGKILL to what is left after
GRACE_S, as the planner's own stop does. Standard library only: it runs with the planner's interpreter
as a script, and must not import the project (it may outlive the files of a checkout).
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(parent: int, pgid: int, grace_s: float) -> int:
    """0 when the group ended first; 1 when the parent died and the group was stopped here."""
    while group_alive(pgid):
        if os.getppid() != parent:
            stop(pgid, grace_s)
            return 1
        time.sleep(POLL_S)
    return 0


def stop(pgid: int, grace_s: float) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not group_alive(pgid):
            return


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the planner, which stops the group
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
