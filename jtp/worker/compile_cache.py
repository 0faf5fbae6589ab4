"""What this process's XLA compilations cost, and how many the persistent compilation cache answered.

JAX reports each cache hit as a `jax.monitoring` event and each phase of a compile (tracing,
lowering to StableHLO, XLA's backend compile, which on GPUs includes autotuning) as a duration
event. The listeners are registered on first use and count every thread (warm-up compiles on a
pool, so the backend seconds add up the threads' time, not the wall time)."""

from __future__ import annotations

import collections
import threading

import jax

_HIT_EVENT = "/jax/compilation_cache/cache_hits"
PHASES = {
    "trace": "/jax/core/compile/jaxpr_trace_duration",
    "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "compile": "/jax/core/compile/backend_compile_duration",
}
_PHASE_OF = {event: phase for phase, event in PHASES.items()}
_lock = threading.Lock()
_hits = 0
_seconds: dict[str, float] = collections.defaultdict(float)
_listening = False


class _ThreadHits(threading.local):
    count = 0


_thread_hits = _ThreadHits()


def _on_event(event: str, **kwargs) -> None:
    global _hits
    if event == _HIT_EVENT:
        _thread_hits.count += 1  # (the listener runs on the compiling thread)
        with _lock:
            _hits += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
    phase = _PHASE_OF.get(event)
    if phase is not None:
        with _lock:
            _seconds[phase] += duration


def _listen() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True


def cache_hits() -> int:
    """Persistent-cache hits in this process since the first call (0 on the first call)."""
    with _lock:
        _listen()
        return _hits


def thread_cache_hits() -> int:
    """Persistent-cache hits on this thread since the first call of `cache_hits` or this."""
    with _lock:
        _listen()
    return _thread_hits.count


def phase_seconds() -> dict[str, float]:
    """Seconds spent tracing, lowering and compiling, summed over threads, since the first call."""
    with _lock:
        _listen()
        return {phase: _seconds[phase] for phase in PHASES}
