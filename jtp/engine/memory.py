"""The KV pool and the recurrent-state slots: sized (from the device memory the weights left, when
`num_blocks` is not given), allocated on the devices, and their host bookkeeping."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax

from jtp.config.device_defaults import allocator_fraction
from jtp.config.engine_config import EngineConfig
from jtp.core.buckets import Buckets
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParams, pack_sampling
from jtp.core.state_pool import StatePool
from jtp.core.step_input import StepInput, StepPlan
from jtp.errors import ConfigError
from jtp.worker.runner import ModelRunner

log = logging.getLogger(__name__)

GIB = 2**30
# What to change when the device runs out of memory at each stage (jtp.errors.out_of_memory).
LOAD_REMEDY = ("the weights do not fit: split them over more devices (--tensor-parallel-size / "
               "--pipeline-parallel-size), quantize them (--quantization fp8), or raise --gpu-memory-utilization")
POOL_REMEDY = "lower --num-blocks or --gpu-memory-utilization (the pool asked for more than the device had free)"
STEP_REMEDY = ("lower --max-num-batched-tokens (the largest step's activations) or --gpu-memory-utilization "
               "(more room beside the KV pool)")
# Without device memory stats (CPU): the pool may take this share of the host's available memory, at most
# the cap (vLLM's CPU backend sizes its KV space from the host's memory too).
HOST_KV_SHARE = 0.25
HOST_KV_CAP_BYTES = 4 * GIB
MARGIN_BYTES = 256 << 20  # beside the measured workspace: what the allocator loses to fragmentation
# Compile scratches kept free beside the pool: for a compile once the pool is in place (without warm-up,
# or a pipeline's); warm-up compiles before the pool is allocated, on as many threads as the pool's room holds.
COMPILE_ROOM = 1


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How one device's budget splits (bytes): what is in use (the weights), the recurrent-state
    slots, the largest step's workspace (measured: its compiled programs' temporaries and outputs),
    COMPILE_ROOM compile scratches (one is about the largest weight array: GPU autotuning copies a
    GEMM's operands), a margin, and the KV pool, the rest."""

    budget: int
    in_use: int
    states: int
    workspace: int
    compile_scratch: int

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.in_use - self.states - self.workspace - COMPILE_ROOM * self.compile_scratch - MARGIN_BYTES

    def summary(self) -> str:
        gib = lambda n: f"{n / GIB:.2f}"  # noqa: E731
        return (f"device budget {gib(self.budget)} GiB: {gib(self.in_use)} in use (weights), {gib(self.states)} state "
                f"slots, {gib(self.workspace)} step workspace (measured), {gib(COMPILE_ROOM * self.compile_scratch)} for "
                f"compiles, {gib(MARGIN_BYTES)} margin, {gib(max(self.kv_bytes, 0))} KV cache")


def device_budget(stats: dict, utilization: float) -> int:
    """Bytes this engine may take on the device: `utilization` of the card, within the allocator's
    limit (which is that share already when the allocator was handed it before the backend started)."""
    limit = stats["bytes_limit"]
    return int(min(limit, utilization * limit / allocator_fraction()))


def largest_step(config: EngineConfig, runner: ModelRunner) -> StepInput:
    """A padding step of the largest shape the scheduler can pick, sampling with top-p (the costliest variant)."""
    max_blocks = -(-config.max_model_len // config.block_size)
    buckets = Buckets.make(config.max_num_batched_tokens, config.max_num_seqs, max_blocks, runner.uses_row_len_bound)
    T, B, L = max(buckets.shapes(), key=lambda shape: (shape[0] * shape[2], shape[1]))
    plan = StepPlan.padding(T, B, L, buckets.table_width)
    return StepInput(plan, pack_sampling([SamplingParams(temperature=1.0, top_p=0.9)] * B, B, [0] * B, [0] * B))


def step_workspace_bytes(runner: ModelRunner, step: StepInput) -> int:
    """Device bytes the programs of `step` need beyond their arguments, from XLA's own accounting of
    the compiled programs (temporaries, and outputs that alias no argument), summed. Compiles them
    (GPU autotuning off: this is a measurement, not the executable that will run)."""
    options = {"xla_gpu_autotune_level": "0"} if jax.default_backend() == "gpu" else None
    total = 0
    for _, lowered in runner.lower(step, again=True):
        stats = lowered.compile(compiler_options=options).memory_analysis()
        if stats is None:  # a backend that keeps no accounting
            return 0
        total += stats.temp_size_in_bytes + max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes)
    return total


def plan_memory(runner: ModelRunner, config: EngineConfig, stats: dict) -> MemoryPlan:
    """The budget's split, measured: the largest step's programs compiled against a pool of one
    request (their workspace does not depend on the pool's size: the pages are updated in place)."""
    in_use = int(stats.get("bytes_in_use", 0))
    workspace = 0
    if runner.compiles_ahead:  # (a worker group's followers would have to compile the probe too: not measured)
        runner.allocate_cache(-(-config.max_model_len // config.block_size))
        try:
            workspace = step_workspace_bytes(runner, largest_step(config, runner))
        finally:
            runner.release_cache()
    largest_weight = max((x.nbytes // max(1, len(x.sharding.device_set)) for x in jax.tree.leaves(runner.params)
                          if hasattr(x, "sharding")), default=0)
    return MemoryPlan(device_budget(stats, config.gpu_memory_utilization), in_use,
                      runner.num_state_slots * runner.bytes_per_state_slot(), workspace, largest_weight)


def compile_threads_for_memory(runner: ModelRunner, workers: int) -> int:
    """At most `workers` compile threads, fewer where the device lacks the room for each one's scratch
    beside the KV pool (what the plan reserved, and what is free now)."""
    plan, stats = getattr(runner, "memory_plan", None), runner.memory_stats()
    if plan is None or not stats or not plan.compile_scratch:
        return workers
    free = plan.budget - int(stats.get("bytes_in_use", 0))
    return max(1, min(workers, int(free // (1.25 * plan.compile_scratch))))


def host_kv_budget() -> int:
    """The pool's budget on a host without allocator stats: a share of the available memory, capped."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = memory_limit_bytes(None) or HOST_KV_CAP_BYTES
    return int(min(HOST_KV_CAP_BYTES, HOST_KV_SHARE * available))


def kv_blocks_for_memory(runner: ModelRunner, config: EngineConfig) -> int:
    """Blocks that fit in the device's budget beside the weights, the state slots and the largest
    step's measured workspace; on a host without allocator stats, enough for every row at full length
    within `host_kv_budget()`. Either way the pool must hold one request of max_model_len: a budget
    that cannot is a ConfigError saying what to change, raised before the pool is allocated."""
    utilization = config.gpu_memory_utilization
    per_block = runner.bytes_per_block()
    stats = runner.memory_stats()
    if stats and "bytes_limit" in stats:
        plan = runner.memory_plan = plan_memory(runner, config, stats)
        log.info("memory plan: %s", plan.summary())
        blocks = int(plan.kv_bytes // per_block)
        if blocks < 1:
            raise ConfigError(
                f"no device memory left for the KV cache at --gpu-memory-utilization {utilization}: {plan.summary()} "
                "(raise --gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, add devices with "
                "--tensor-parallel-size, or quantize with --quantization fp8)"
            )
        budget = f"{plan.kv_bytes / GIB:.2f} GiB the plan leaves at --gpu-memory-utilization {utilization}"
        remedy = "raise --gpu-memory-utilization or lower --max-num-batched-tokens"
    else:
        want = -(-config.max_num_seqs * config.max_model_len // config.block_size)
        host_budget = host_kv_budget()
        blocks = min(want, host_budget // per_block)
        budget = f"host KV budget of {host_budget / GIB:.2f} GiB ({HOST_KV_SHARE:.0%} of available memory, at most {HOST_KV_CAP_BYTES / GIB:.0f} GiB)"
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


def memory_limit_bytes(runner: ModelRunner | None) -> int | None:
    """What one device can hold at most: its allocator's limit, or the host's RAM on CPU."""
    stats = runner.memory_stats() if runner is not None else None
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


def allocate_pools(runner: ModelRunner, config: EngineConfig, deferred: bool = False) -> tuple[PagePool, StatePool | None]:
    """Allocate the device cache (`deferred`: at its first use, see ModelRunner.allocate_cache) and
    return its host bookkeeping: the page pool, and the state pool on hybrid models (None without
    recurrent layers)."""
    per_block, per_slot = runner.bytes_per_block(), runner.bytes_per_state_slot()
    if config.num_blocks:
        num_blocks = config.num_blocks
        check_pool_size(num_blocks, per_block, runner)
    else:
        num_blocks = kv_blocks_for_memory(runner, config)
    runner.allocate_cache(num_blocks, deferred)
    log.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per device)",
             num_blocks, config.block_size, num_blocks * config.block_size, num_blocks * per_block / 2**20)
    if not per_slot:
        return PagePool(num_blocks, config.block_size), None
    log.info("recurrent-state slots: %d (%.1f MiB per device)", config.num_state_slots,
             config.num_state_slots * per_slot / 2**20)
    return PagePool(num_blocks, config.block_size), StatePool(config.num_state_slots)
