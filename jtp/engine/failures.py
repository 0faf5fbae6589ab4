"""What a failed step does to the engine. A mixin of `Engine`: it works through the engine's step
lock, its requests' streams and its worker group.

- In a multi-process group a failed step means a broken group (a follower died, hung or diverged):
  the group's monitor names the cause, `fail` ends every unfinished request with a retryable
  error, and the step raises `WorkerGroupError`, whether the loop thread or the caller (manual
  mode: `jtp batch`, `jtp generate`, `Engine.generate`) ran it.
- A data-parallel replica (`on_failure` set) fails whole: its device state is rebuilt.
- A lone engine fails the running requests and steps on.
"""

from __future__ import annotations

import logging

from jtp.engine.memory import STEP_REMEDY
from jtp.errors import WorkerGroupError, is_out_of_memory, out_of_memory

log = logging.getLogger(__name__)


class EngineFailures:
    # Called with the engine once it has failed (`fail`), when set; a failed step then fails the
    # whole engine (a data-parallel replica, which is rebuilt: jtp/engine/data_parallel.py).
    on_failure = None

    def fail(self, message: str) -> None:
        """End every unfinished request with the retryable error `message` and run no more steps: a
        follower died, hung or diverged (the group's monitor calls it), or a replica's step failed.
        The step thread may be stuck in a collective, so the step lock is only waited for briefly."""
        with self._intake:
            self.failure = message
            self._stopping = True
            self._intake.notify_all()
        if self.on_failure is not None:  # first: a request retried once it has ended must not come back here
            self.on_failure(self)
        locked = self._lock.acquire(timeout=2.0)
        try:
            with self._intake:
                outs = self.outputs.unfinished()
            for out in outs:
                out.error, out.retryable = message, True
                self._finish(out, "error", touch_scheduler=locked)
        finally:
            if locked:
                self._lock.release()
        self.ready.clear()
        self.failed.set()

    def _group_failure(self, error: Exception) -> WorkerGroupError:
        """A step failed in a worker group, which is broken now: the error the step raises instead
        (the collective's own, "connection reset by peer", names no follower). The group's monitor
        names the cause if it can (a follower that died is seen at once), else the step's error
        does; `fail` has ended the requests by the time this returns (step lock not held)."""
        if not self.group.failed.wait(1.0):
            self.group.fail(f"a step failed: {type(error).__name__}: {error}")
        self.failed.wait(10.0)
        return WorkerGroupError(self.failure or f"the worker group failed ({self.group.failure}); retry the request")

    def _step_failed(self, error: Exception) -> bool:
        """The loop thread's step raised `error` (logged here): whether the loop steps on."""
        if self.group is not None:  # the step failed the group (WorkerGroupError): no more steps
            return False
        if self.on_failure is not None:  # its device state is no longer trustworthy: rebuilt whole
            log.exception("engine step failed; failing the engine")
            self.fail(f"a step failed ({type(error).__name__}: {error}); retry the request")
            return False
        log.exception("engine step failed; failing the running requests")
        reason = (str(out_of_memory(error, "in a step", STEP_REMEDY)) if is_out_of_memory(error)
                  else f"{type(error).__name__}: {error}")
        with self._lock:
            self._inflight.clear()
            for req in list(self.scheduler.running):
                out = self.outputs.get(req.id)
                out.error = reason
                self._finish(out, "error")
            self.scheduler.reset_prefix_cache()  # what the failed step was to write is not trustworthy
        return True
