"""How many of this process's XLA compilations the persistent compilation cache answered.

JAX reports each cache hit as a `jax.monitoring` event; the listener is registered on first use
and counts hits from every thread (warm-up compiles on a pool)."""

from __future__ import annotations

import threading

import jax

_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_lock = threading.Lock()
_hits = 0
_listening = False


def _on_event(event: str, **kwargs) -> None:
    global _hits
    if event == _HIT_EVENT:
        with _lock:
            _hits += 1


def cache_hits() -> int:
    """Persistent-cache hits in this process since the first call (0 on the first call)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
        return _hits
