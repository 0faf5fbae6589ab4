"""Host time of one engine step, phase by phase: what `Engine.step_timings` is called with.

    engine.step_timings = lambda t: print(t.host_s, t.wait_s)

schedule: `Scheduler.schedule` and its `SchedulerOutput`; prepare: the input batch's diffs and
packed arrays; dispatch: the jitted call (launch and argument transfer; compilation on a new
shape, see `compiled`); process: the previous step's results (of which `wait` is the time spent
waiting for the device to deliver them). `host_s` is everything but the wait.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepTiming:
    schedule: float = 0.0
    prepare: float = 0.0
    dispatch: float = 0.0
    process: float = 0.0  # includes `wait`
    wait: float = 0.0
    total: float = 0.0
    shape: tuple[int, int, int] | None = None  # (tokens, rows, blocks per row) of the dispatched step
    compiled: bool = False  # the dispatch traced (and compiled) a new step variant
    tokens: int = 0  # tokens handed out to requests (the processed step's)

    @property
    def host_s(self) -> float:
        return self.total - self.wait

    def dispatched(self, t0: float, t1: float, t2: float, t3: float, layout, compiled: bool) -> None:
        """Account a dispatch: scheduling from t0, preparing from t1, the call from t2 to t3."""
        self.schedule += t1 - t0
        self.prepare += t2 - t1
        self.dispatch += t3 - t2
        self.shape = (layout.num_tokens, layout.num_rows, layout.max_blocks)
        self.compiled = compiled
