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


# XLA's own optimisation settings for one program, over the suite's fast-compile flags
# (conftest.py): Pallas' interpreter runs a kernel's grid as a loop of many small ops, so the
# kernel tests spend their time running programs, not compiling them (docs/bench/ci-time.md).
OPTIMIZED = dict(xla_backend_optimization_level=2, xla_cpu_use_fusion_emitters=True,
                 xla_cpu_parallel_codegen_split_count=32)


def jit_optimized(fun, **jit_kwargs):
    """jax.jit with XLA's optimisations on for this program."""
    import jax

    return jax.jit(fun, compiler_options=OPTIMIZED, **jit_kwargs)


def cuda_lowering(fun, *args) -> str:
    """The text of jitted `fun` lowered for CUDA on this CPU machine (Pallas -> Triton runs here too):
    an op a kernel uses that Triton lacks fails on the CPU, not on a lent GPU. Skips where this jax
    cannot lower for CUDA at all."""
    import jax
    import pytest

    try:
        return jax.jit(fun).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001
        if "cuda" in str(e).lower() and "platform" in str(e).lower():
            pytest.skip(f"this jax cannot lower for cuda here: {e}")
        raise
