"""`python -m jtp.entrypoints.follower`: the process a local leader spawns for each follower.

The leader passes the launch (its place in the group, the engine's arguments) in $JTP_LAUNCH and
the secret as one line on stdin (so it is in neither /proc/PID/cmdline nor /proc/PID/environ);
the process then follows the leader's steps
(`jtp.distributed.follower.run_follower`) and exits the way every jtp command does.
"""
from __future__ import annotations

import json
import logging
import os
import sys

from jtp.config.engine_args import EngineArgs
from jtp.distributed.follower import run_follower
from jtp.distributed.launcher import (
    LAUNCH_ENV,
    LaunchSpec,
    exit_with_parent,
    receive_secret,
)
from jtp.entrypoints.cli_support import enable_compilation_cache, run_command


def main() -> int:
    launch = json.loads(os.environ.pop(LAUNCH_ENV))
    exit_with_parent(launch["parent_pid"])
    logging.basicConfig(level=os.environ.get("JTP_LOG_LEVEL", "WARNING"),
                        format=f"%(levelname)s follower {launch['spec']['process_id']} %(name)s: %(message)s")
    spec = LaunchSpec(**launch["spec"], secret=receive_secret(sys.stdin.buffer))
    args = EngineArgs(**launch["engine_args"])
    enable_compilation_cache()  # the leader's directory, from the environment it passed on
    return run_command(lambda _: run_follower(args, spec), None)


if __name__ == "__main__":
    sys.exit(main())
