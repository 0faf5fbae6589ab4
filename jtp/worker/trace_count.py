"""Counting the step programs a runner traces: each one calls `note_trace()` as it is traced, and
`count_traces(runner)` adds the traces made inside it to `runner.compilations` (a trace means a
compilation; the count after warm-up should stay put)."""

from __future__ import annotations

import contextlib
import threading


class _TraceCounter(threading.local):
    count = 0


_TRACES = _TraceCounter()


def note_trace() -> None:
    _TRACES.count += 1


@contextlib.contextmanager
def count_traces(runner):
    before = _TRACES.count
    try:
        yield
    finally:
        runner.compilations += _TRACES.count - before
