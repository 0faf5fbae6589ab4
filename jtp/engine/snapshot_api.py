"""The engine's prefix-cache and snapshot methods: pin a prefix, continue from it, save and load
snapshots with orbax (snapshot_store.py), forget the cache. A mixin of `Engine`: it works through
the engine's step lock, its snapshot manager and its scheduler, and submits like any caller."""

from __future__ import annotations

from jtp.core.sampling_params import SamplingParams
from jtp.engine import snapshot_store
from jtp.errors import RequestError


class EngineSnapshots:
    def snapshot(self, request_id: str | None = None, *, tokens=None) -> str:
        """Pin a prefix in the cache and return a snapshot id to `restore` from later.

        From a request (running, or finished and not yet released): its prompt and output so far.
        From `tokens`: that sequence, prefilled first if the cache does not hold it. The snapshot
        holds the longest cached prefix (whole blocks; on hybrid models ending at a state
        checkpoint); `restore` recomputes the few tokens past it. Older snapshots are evicted
        (LRU) to stay within the entry cap and byte budget; when it cannot be made, an error
        says why and nothing is held.
        """
        if (request_id is None) == (tokens is None):
            raise RequestError("snapshot() takes a request id or tokens, not both or neither")
        with self._lock:
            if request_id is not None:
                if self.request(request_id).mm is not None:  # `restore` has no way to carry its images
                    raise RequestError(f"request {request_id!r} has images: snapshots hold text prompts only")
                return self.snapshots.pin_request(self.request(request_id))
            seq = [int(t) for t in tokens]
            snap_id = self.snapshots.pin_tokens(seq)
        if snap_id is None:  # not cached yet: prefill it (one sampled token, discarded), then pin
            self.result(self.submit(seq, SamplingParams(max_tokens=1, temperature=0.0)))
            with self._lock:
                snap_id = self.snapshots.pin(seq)
        return snap_id

    def restore(self, snapshot_id: str, prompt_ids=(), params: SamplingParams | None = None, request_id=None) -> str:
        """Continue generation from a snapshot: submit its tokens plus `prompt_ids` (new turn, if
        any) as a request; only the tokens past the pinned prefix are prefilled."""
        with self._lock:
            seq = self.snapshots.get(snapshot_id).tokens + [int(t) for t in prompt_ids]
        return self.submit(seq, params, request_id)

    def drop(self, snapshot_id: str) -> None:
        """Let go of a snapshot: its blocks and state return to the ordinary (evictable) cache."""
        with self._lock:
            self.snapshots.drop(snapshot_id)

    def list_snapshots(self) -> list:
        """Every snapshot, least recently used first."""
        with self._lock:
            return list(self.snapshots)

    def save_snapshots(self, path, snapshot_ids=None, overwrite: bool = False, include_prefix_cache: bool = False):
        """Write snapshots (default: all; with `include_prefix_cache` also the rest of the prefix
        cache) to `path` with orbax; see jtp/engine/snapshot_store.py."""
        return snapshot_store.save_snapshots(self, path, snapshot_ids, overwrite=overwrite, include_prefix_cache=include_prefix_cache)

    def load_snapshots(self, path, include_prefix_cache: bool = True) -> list[str]:
        """Load snapshots (and any saved prefix-cache entries, as fit) saved by an engine of the same
        model, config, dtype and mesh; their ids."""
        return snapshot_store.load_snapshots(self, path, include_prefix_cache=include_prefix_cache)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block and state checkpoint that nothing holds; returns how many blocks."""
        with self._lock:
            return self.scheduler.reset_prefix_cache()
