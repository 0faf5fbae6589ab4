"""The sampling defaults a checkpoint asks for in its generation_config.json (vLLM's
`--generation-config`): applied to every field a request leaves unset, by the server, `jtp
generate`, `jtp batch` and `Engine.submit` alike.

    sampling_defaults("path/to/Qwen3-8B", "auto")  # {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    sampling_defaults("path/to/Qwen3-8B", "vllm")  # {}: SamplingParams' own defaults

The mode is "auto" (the model directory's file), "vllm" (none: the engine's built-in defaults) or
another directory holding a generation_config.json. Only the keys vLLM reads are taken, renamed to
SamplingParams' fields; the engine checks their values.
"""

from __future__ import annotations

import json
from pathlib import Path

from jtp.errors import ConfigError

GENERATION_CONFIG_MODES = ("auto", "vllm")

# generation_config.json key -> SamplingParams field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_dir: str | Path, mode: str = "auto") -> dict:
    """The SamplingParams fields the generation config sets (an empty dict for "vllm" or no file)."""
    if mode == "vllm":
        return {}
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    if mode != "auto" and not path.is_file():
        raise ConfigError(f"--generation-config {mode}: no generation_config.json in that directory "
                          f"(give auto, vllm or a directory that holds one)")
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return {field: config[key] for key, field in _KEYS.items() if config.get(key) is not None}
