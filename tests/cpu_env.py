"""The environment of a jtp subprocess in the tests: JAX on the CPU with `devices` forced host
devices, and every other XLA flag of the test session (conftest.py) kept, so the subprocess
compiles like the tests do and shares their compilation cache."""
from __future__ import annotations

import os

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int) -> str:
    others = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
    return " ".join([*others, f"{DEVICE_FLAG}={devices}"])


def cpu_env(devices: int = 1, **extra: str) -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices), **extra}
