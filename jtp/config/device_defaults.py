"""What the device decides before anything is loaded: the allocator's share of its memory, and the
batch sizes an engine gets when its flags leave them out (the table; jtp/worker/devices.py asks the
device).

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
import os

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


def allocator_fraction() -> float:
    """The share of each card XLA's GPU allocator may take in this process."""
    try:
        return float(os.environ.get(MEM_FRACTION_ENV, XLA_DEFAULT_FRACTION))
    except ValueError:
        return XLA_DEFAULT_FRACTION
