"""The KV pool's size when `num_blocks` is not given: what device memory the weights left."""

from __future__ import annotations

import logging

from jtp.config.engine_config import EngineConfig
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
