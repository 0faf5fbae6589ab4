"""The device's answers to jtp/config/device_defaults.py: hand the allocator its share before the
backend starts, then read the first device's platform and memory for the batch defaults."""

from __future__ import annotations

import os

from jtp.config.device_defaults import HOST, MEM_FRACTION_ENV, BatchDefaults, allocator_fraction, batch_defaults
from jtp.config.engine_args import EngineArgs


def backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def hand_utilization_to_allocator(gpu_memory_utilization: float) -> None:
    """Let XLA's GPU allocator take `gpu_memory_utilization` of each card, unless the backend already
    started (a notebook that ran JAX first: the budget then stays within the limit it has) or the
    variable is set (the user's choice stands)."""
    if MEM_FRACTION_ENV in os.environ or backend_started():
        return
    os.environ[MEM_FRACTION_ENV] = f"{gpu_memory_utilization:.4f}"


def device_memory_bytes(device) -> int | None:
    """A GPU's memory, from its allocator's limit and share (None where the backend keeps no stats)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] / allocator_fraction())


def local_device_defaults() -> BatchDefaults:
    """The defaults for this process's first device (this starts the JAX backend)."""
    import jax

    device = jax.local_devices()[0]
    return batch_defaults(device.platform, device_memory_bytes(device) if device.platform == "gpu" else None)


def with_device_defaults(args: EngineArgs) -> EngineArgs:
    """`args` with the batch sizes left out taken from this process's device, after handing
    --gpu-memory-utilization to XLA's allocator (before the backend starts)."""
    if 0 < args.gpu_memory_utilization <= 1:  # else validate() names it
        hand_utilization_to_allocator(args.gpu_memory_utilization)
    if args.max_num_seqs is not None and args.max_num_batched_tokens is not None:
        return args
    if args.is_multiprocess:  # no device query before jax.distributed.initialize: the flags, else the host's
        return args.with_batch_defaults(HOST)
    return args.with_batch_defaults(local_device_defaults())
