"""EngineConfig: EngineArgs resolved once, under the same names, for every layer below the CLI.

Config-only checkpoints (config.json, no weights): resolving reads nothing else.
"""
import dataclasses

import pytest
from scripts_loader import load_script

from jtp.config.engine_args import EngineArgs
from jtp.config.engine_config import EngineConfig
from jtp.config.model_config import ModelConfig
from jtp.config.speculative import SpeculativeConfig
from jtp.errors import ConfigError


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tiny-config")
    load_script("make_random_checkpoint").write_checkpoint("qwen3-tiny", path, "bfloat16", config_only=True)
    return path


def test_every_setting_keeps_its_cli_name():
    """No renames on the way down: each field is an EngineArgs field, but for what resolving adds."""
    args = {f.name for f in dataclasses.fields(EngineArgs)}
    added = {"model_config", "sampling_defaults", "args"}
    assert {f.name for f in dataclasses.fields(EngineConfig)} - added <= args


def test_resolves_what_the_layers_below_would_otherwise_each_work_out(bare):
    model = ModelConfig.from_dir(bare)
    config = EngineConfig.from_args(
        EngineArgs(model=str(bare), max_num_seqs=4, speculative_config='{"method": "ngram"}'))
    assert config.dtype == model.dtype == "bfloat16"  # "auto": the checkpoint's declared dtype
    assert config.max_model_len == model.max_position_embeddings
    assert config.num_state_slots == 2 * 4 + 8
    assert config.speculative_config == SpeculativeConfig(method="ngram") and config.mtp_drafts == 0
    assert config.model_config == model and config.served_model_name == bare.name

    explicit = EngineConfig.from_args(EngineArgs(model=str(bare), dtype="float32", max_model_len=64,
                                                 num_state_slots=9, max_num_seqs=4,
                                                 speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    assert (explicit.dtype, explicit.max_model_len, explicit.num_state_slots) == ("float32", 64, 9)
    assert explicit.mtp_drafts == 2


def test_a_bad_setting_fails_before_anything_loads(bare):
    with pytest.raises(ConfigError, match="--max-model-len 1000000: exceeds the model's max_position_embeddings"):
        EngineConfig.from_args(EngineArgs(model=str(bare), max_model_len=1_000_000))
    with pytest.raises(ConfigError, match="speculative method 'medusa' is unknown"):
        EngineConfig.from_args(EngineArgs(model=str(bare), speculative_config='{"method": "medusa"}'))


def test_a_multi_process_engine_is_built_with_its_group(bare):
    from jtp.engine.engine import Engine

    config = EngineConfig.from_args(EngineArgs(model=str(bare), tensor_parallel_size=2, num_processes=2))
    with pytest.raises(ValueError, match="worker group"):
        Engine(config)


def test_generation_config_sampling_defaults(bare, tmp_path):
    """vLLM's --generation-config: auto reads the model's file (its vLLM keys, max_new_tokens as
    max_tokens), vllm none, DIR another directory's; a bad value fails when the engine checks it."""
    import json
    from jtp.config.generation_config import sampling_defaults
    from jtp.engine.input_processor import InputProcessor

    (bare / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 99, "eos_token_id": 2}))
    try:
        auto = EngineConfig.from_args(EngineArgs(model=str(bare))).sampling_defaults
        assert auto == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 99}
        assert EngineConfig.from_args(EngineArgs(model=str(bare), generation_config="vllm")).sampling_defaults == {}
        (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "repetition_penalty": 1.05}))
        assert sampling_defaults(bare, str(tmp_path)) == {"temperature": 0.2, "repetition_penalty": 1.05}
        with pytest.raises(ConfigError, match="--generation-config"):
            EngineArgs(model=str(bare), generation_config="greedy").validate()
        with pytest.raises(ConfigError, match="no generation_config.json"):
            sampling_defaults(bare, str(tmp_path / "nowhere"))
        model = ModelConfig.from_dir(bare)
        inputs = InputProcessor(model, 64, None, frozenset(), None, auto)
        assert inputs.default_params(seed=1).temperature == 0.6 and inputs.default_params(top_k=0).top_k == 0
        with pytest.raises(ConfigError, match="temperature must be"):
            InputProcessor(model, 64, None, frozenset(), None, {"temperature": -1.0})
    finally:
        (bare / "generation_config.json").unlink()
