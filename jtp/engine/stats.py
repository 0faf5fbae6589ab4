"""EngineStats: a point-in-time count of the engine's requests, KV pool, prefix cache and
speculation, as the server's /metrics and the benchmarks read it."""

from __future__ import annotations

import dataclasses

from jtp.core.page_pool import PagePool
from jtp.core.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests (with prefix caching on)
    prefix_cache_hits: int = 0  # of those, tokens whose KV (and state) came from the cache
    prefix_cache_blocks: int = 0  # KV blocks registered in the prefix cache
    prompt_tokens_computed: int = 0  # prompt tokens prefilled (the work the cache saves)
    num_snapshots: int = 0
    spec_decode_num_drafts: int = 0  # speculating rows verified
    spec_decode_num_draft_tokens: int = 0  # tokens drafted for them
    spec_decode_num_accepted_tokens: int = 0  # of those, tokens the target model sampled too
    spec_decode_num_state_rollbacks: int = 0  # hybrid rows whose recurrent state went back before a rejected draft
    compilations: int = 0  # step programs compiled since start (warm-up included): none should follow /ready
    compile_seconds: float = 0.0  # time those compilations took

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens if self.spec_decode_num_draft_tokens else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verified row emits on average: its accepted drafts plus the target's own token."""
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts if self.spec_decode_num_drafts else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def collect_stats(scheduler: Scheduler, pool: PagePool, num_waiting: int, num_snapshots: int, runner=None) -> EngineStats:
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=num_waiting,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_total=pool.total_blocks,
        prefix_cache_queries=scheduler.prefix_queries,
        prefix_cache_hits=scheduler.prefix_hits,
        prefix_cache_blocks=pool.num_cached_blocks,
        prompt_tokens_computed=scheduler.prompt_tokens_computed,
        num_snapshots=num_snapshots,
        spec_decode_num_drafts=scheduler.spec_verified_rows,
        spec_decode_num_draft_tokens=scheduler.spec_draft_tokens,
        spec_decode_num_accepted_tokens=scheduler.spec_accepted_tokens,
        spec_decode_num_state_rollbacks=scheduler.spec_state_rollbacks,
        compilations=runner.compilations if runner is not None else 0,
        compile_seconds=runner.compile_seconds if runner is not None else 0.0,
    )
