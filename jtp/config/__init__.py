"""Configuration: `ModelConfig` from a checkpoint's config.json, `EngineArgs` (vLLM's names), speculative decoding settings. Imports nothing of jtp but `jtp.errors`."""
