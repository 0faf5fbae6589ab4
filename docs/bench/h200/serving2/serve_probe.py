"""jtp serve with every engine step's host timing logged to $STEP_LOG (a probe, not shipped)."""
import os
import sys
import time

from jtp.engine import engine as engine_module

_log = open(os.environ["STEP_LOG"], "w", buffering=1)


def _record(t):
    s = t.shape or (0, 0, 0)
    _log.write(f"{time.monotonic():.6f} {t.total:.6f} {t.wait:.6f} {t.schedule:.6f} {t.prepare:.6f} "
               f"{t.dispatch:.6f} {t.process:.6f} {s[0]} {s[1]} {s[2]} {int(t.compiled)} {t.tokens}\n")


engine_module.Engine.step_timings = staticmethod(_record)
if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))
from jtp.entrypoints.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
