"""The KV pool and the recurrent-state slots: sized (from the device memory the weights left, when
`num_blocks` is not given), allocated on the devices, and their host bookkeeping."""

from __future__ import annotations

import logging

from jtp.config.engine_config import EngineConfig
from jtp.core.page_pool import PagePool
from jtp.core.state_pool import StatePool
from jtp.worker.runner import ModelRunner

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 256 << 20  # without device memory stats (CPU), size the pool to this


def kv_blocks_for_memory(runner: ModelRunner, config: EngineConfig) -> int:
    """Blocks that fit in `gpu_memory_utilization` of device memory beside the weights and the
    state slots; on a host without allocator stats, enough for every row at full length within
    CPU_KV_BUDGET_BYTES (and never less than one request of max_model_len)."""
    utilization = config.gpu_memory_utilization
    per_block = runner.bytes_per_block()
    stats = runner.memory_stats()
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
        free -= runner.num_state_slots * runner.bytes_per_state_slot()
        blocks = int(free // per_block)
        log.info("KV pool sized from device memory: %.1f GiB free x %.2f", free / 2**30, utilization)
        if blocks < 1:
            raise RuntimeError(
                f"no device memory left for the KV cache: {per_block} bytes per block, {free / 2**30:.2f} GiB "
                f"free at --gpu-memory-utilization {utilization} (raise it, or lower --max-num-seqs)"
            )
        return blocks
    # The configured context must really be served, so at least one request of max_model_len.
    want = -(-config.max_num_seqs * config.max_model_len // config.block_size)
    one_request = -(-config.max_model_len // config.block_size)
    return max(min(want, CPU_KV_BUDGET_BYTES // per_block), one_request)


def allocate_pools(runner: ModelRunner, config: EngineConfig) -> tuple[PagePool, StatePool | None]:
    """Allocate the device cache and return its host bookkeeping: the page pool, and the state
    pool on hybrid models (None without recurrent layers)."""
    per_block, per_slot = runner.bytes_per_block(), runner.bytes_per_state_slot()
    num_blocks = config.num_blocks or kv_blocks_for_memory(runner, config)
    runner.allocate_cache(num_blocks)
    log.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per device)",
             num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**20)
    if not per_slot:
        return PagePool(num_blocks, config.block_size), None
    log.info("recurrent-state slots: %d (%.1f MiB per device)", config.num_state_slots,
             config.num_state_slots * per_slot / 2**20)
    return PagePool(num_blocks, config.block_size), StatePool(config.num_state_slots)
