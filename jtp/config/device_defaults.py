"""What the device decides before anything is loaded: the allocator's share of its memory, and the
batch sizes an engine gets when its flags leave them out.

XLA's GPU allocator takes 75% of the card unless told otherwise when the backend starts, so
`--gpu-memory-utilization` is handed to it (XLA_PYTHON_CLIENT_MEM_FRACTION) before the first device
query: the engine's budget is then the allocator's own limit, and a model of 61 GB fits on an 80 GB
card. The batch sizes follow vLLM's rule (a card of 70 GiB or more gets the large defaults, CPUs
small ones), scaled down where jtp compiles a program per bucket:

| device                | max_num_seqs | max_num_batched_tokens |
|-----------------------|-------------:|-----------------------:|
| GPU, >= 70 GiB        |          256 |                  8,192 |
| GPU, smaller          |          128 |                  2,048 |
| CPU (and others)      |           32 |                    512 |
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
XLA_DEFAULT_FRACTION = 0.75  # XLA's GPU allocator without the variable
LARGE_GPU_BYTES = 70 * 2**30  # vLLM's line between its two GPU defaults (H100 / H200 / MI300 above it)


@dataclasses.dataclass(frozen=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int


LARGE_GPU = BatchDefaults(256, 8192)
SMALL_GPU = BatchDefaults(128, 2048)
HOST = BatchDefaults(32, 512)


def batch_defaults(platform: str, device_bytes: int | None) -> BatchDefaults:
    """The defaults for a device of this platform ("gpu", "cpu", ...) and memory (None: unknown)."""
    if platform != "gpu":
        return HOST
    return LARGE_GPU if device_bytes is not None and device_bytes >= LARGE_GPU_BYTES else SMALL_GPU


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


def allocator_fraction() -> float:
    """The share of each card XLA's GPU allocator may take in this process."""
    try:
        return float(os.environ.get(MEM_FRACTION_ENV, XLA_DEFAULT_FRACTION))
    except ValueError:
        return XLA_DEFAULT_FRACTION


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
