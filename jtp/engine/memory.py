"""The KV pool and the recurrent-state slots: sized (from the device memory the weights left, when
`num_blocks` is not given), allocated on the devices, and their host bookkeeping."""

from __future__ import annotations

import logging
import os

from jtp.config.engine_config import EngineConfig
from jtp.core.page_pool import PagePool
from jtp.core.state_pool import StatePool
from jtp.errors import ConfigError
from jtp.worker.runner import ModelRunner

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 256 << 20  # without device memory stats (CPU), size the pool to this
GIB = 2**30


def kv_blocks_for_memory(runner: ModelRunner, config: EngineConfig) -> int:
    """Blocks that fit in `gpu_memory_utilization` of device memory beside the weights and the
    state slots; on a host without allocator stats, enough for every row at full length within
    CPU_KV_BUDGET_BYTES. Either way the pool must hold one request of max_model_len: a budget
    that cannot is a ConfigError saying what to change, raised before anything is allocated."""
    utilization = config.gpu_memory_utilization
    per_block = runner.bytes_per_block()
    stats = runner.memory_stats()
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
        free -= runner.num_state_slots * runner.bytes_per_state_slot()
        blocks = int(free // per_block)
        log.info("KV pool sized from device memory: %.1f GiB free x %.2f", free / GIB, utilization)
        if blocks < 1:
            raise RuntimeError(
                f"no device memory left for the KV cache: {per_block} bytes per block, {free / GIB:.2f} GiB "
                f"free at --gpu-memory-utilization {utilization} (raise it, or lower --max-num-seqs)"
            )
        budget = f"{free / GIB:.2f} GiB left at --gpu-memory-utilization {utilization}"
        remedy = "raise --gpu-memory-utilization"
    else:
        want = -(-config.max_num_seqs * config.max_model_len // config.block_size)
        blocks = min(want, CPU_KV_BUDGET_BYTES // per_block)
        budget = f"CPU KV budget of {CPU_KV_BUDGET_BYTES / GIB:.2f} GiB"
        remedy = "give the pool's size with --num-blocks"
    check_one_request_fits(blocks, per_block, config, budget, remedy)
    return blocks


def check_one_request_fits(blocks: int, per_block: int, config: EngineConfig, budget: str, remedy: str) -> None:
    """The configured context must really be served: refuse a pool too small for one full request."""
    one_request = -(-config.max_model_len // config.block_size)
    if blocks >= one_request:
        return
    raise ConfigError(
        f"one request of max_model_len {config.max_model_len:,} needs {one_request:,} KV blocks "
        f"({one_request * per_block / GIB:.2f} GiB per device), more than the {budget} holds "
        f"({blocks:,} blocks, {blocks * config.block_size:,} tokens): lower --max-model-len to at most "
        f"{blocks * config.block_size:,}, or {remedy}"
    )


def memory_limit_bytes(runner: ModelRunner) -> int | None:
    """What one device can hold at most: its allocator's limit, or the host's RAM on CPU."""
    stats = runner.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return None


def check_pool_size(num_blocks: int, per_block: int, runner: ModelRunner) -> None:
    """An explicit --num-blocks larger than the device (or the host's RAM) is refused before allocating."""
    limit = memory_limit_bytes(runner)
    if limit is not None and num_blocks * per_block > limit:
        raise ConfigError(
            f"--num-blocks {num_blocks:,}: {num_blocks * per_block / GIB:,.2f} GiB of KV cache per device, more "
            f"than the {limit / GIB:,.2f} GiB the device can hold"
        )


def allocate_pools(runner: ModelRunner, config: EngineConfig) -> tuple[PagePool, StatePool | None]:
    """Allocate the device cache and return its host bookkeeping: the page pool, and the state
    pool on hybrid models (None without recurrent layers)."""
    per_block, per_slot = runner.bytes_per_block(), runner.bytes_per_state_slot()
    if config.num_blocks:
        num_blocks = config.num_blocks
        check_pool_size(num_blocks, per_block, runner)
    else:
        num_blocks = kv_blocks_for_memory(runner, config)
    runner.allocate_cache(num_blocks)
    log.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per device)",
             num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**20)
    if not per_slot:
        return PagePool(num_blocks, config.block_size), None
    log.info("recurrent-state slots: %d (%.1f MiB per device)", config.num_state_slots,
             config.num_state_slots * per_slot / 2**20)
    return PagePool(num_blocks, config.block_size), StatePool(config.num_state_slots)
