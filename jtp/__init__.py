"""jtp: JAX/XLA inference for the Qwen3 family.

    from jtp import Engine, EngineArgs, SamplingParams

The names load on first use, so `import jtp` stays cheap (no jax import).
"""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

_PUBLIC = {
    "EngineArgs": "jtp.config.engine_args",
    "EngineConfig": "jtp.config.engine_config",
    "Engine": "jtp.engine.engine",
    "SamplingParams": "jtp.core.sampling_params",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'jtp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_PUBLIC[name]), name)
