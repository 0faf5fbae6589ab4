"""scripts/make_random_checkpoint.py's Qwen3 presets (dense and MoE): every tensor jtp's layout
expects and nothing else, the published parameter counts, and a tiny MoE preset that transformers
loads without a missing or unexpected tensor and whose greedy tokens jtp reproduces."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hf_models import hf_greedy
from scripts_loader import load_script


@pytest.fixture(scope="module")
def mk():
    return load_script("make_random_checkpoint")


def checkpoint_against_layout(mk, preset: str, param_layout):
    """The preset's config, its tensors {name: shape} and jtp's ModelConfig, once the tensors were
    found to be exactly those jtp's layout expects."""
    from jtp.config.model_config import ModelConfig
    from jtp.loading.weights import resolve_layout

    raw = mk.make_config(preset, "bfloat16")
    specs = {name: tuple(shape) for name, shape, _ in mk.tensor_specs(raw)}
    cfg = ModelConfig.from_hf(raw)
    expected = {}
    # Where the layout accepts either form (fused or per-expert experts), the one the files hold.
    for source in resolve_layout(param_layout(cfg), SimpleNamespace(names=set(specs))).values():
        expected |= source.expected()
    assert expected == specs
    return raw, specs, cfg


# Published sizes: Qwen3-8B 8.19 B, Qwen3-30B-A3B 30.5 B, Qwen3-235B-A22B 235.1 B parameters.
@pytest.mark.parametrize("preset, billions", [("qwen3-8b", 8.191), ("qwen3-30b-a3b", 30.532), ("qwen3-30b-a3b-4l", 3.1148),
                                              ("qwen3-235b-a22b", 235.09), ("qwen3-moe-tiny", 0.0011517)])
def test_presets_have_every_tensor_jtp_expects(mk, preset, billions):
    from jtp.models.qwen3 import param_layout

    raw, specs, cfg = checkpoint_against_layout(mk, preset, param_layout)
    assert sum(int(np.prod(s)) for s in specs.values()) == pytest.approx(billions * 1e9, rel=1e-3)
    if "moe" in raw["model_type"]:
        assert cfg.num_experts == raw["num_experts"] and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def test_tiny_moe_preset_loads_in_hf_and_jtp_greedy_matches(mk, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine

    path = tmp_path / "qwen3-moe-tiny"
    mk.write_checkpoint("qwen3-moe-tiny", path, dtype="float32", quiet=True)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    prompts = [np.random.default_rng(n).integers(0, 1024, n).tolist() for n in (3, 21)]
    expected = [hf_greedy(model.eval(), p, 8) for p in prompts]
    engine = Engine.from_args(EngineArgs(
        model=path, dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=16, max_num_seqs=4))
    got = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in got] == expected


@pytest.mark.parametrize("preset", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b-4l", "qwen3-next-80b-a3b-4l", "qwen3.5-moe-tiny", "qwen3-next-tiny"])
def test_hybrid_moe_presets_have_every_tensor_jtp_expects(mk, preset):
    from jtp.models.qwen3_5 import param_layout

    raw, _, cfg = checkpoint_against_layout(mk, preset, lambda cfg: param_layout(cfg, mtp=True))  # MTP head too
    assert cfg.num_experts == raw["num_experts"] and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    interval = 2 if preset.endswith("-tiny") else 4  # real checkpoints: full attention every 4th layer
    assert [cfg.is_linear_layer(i) for i in range(cfg.num_layers)] == [(i + 1) % interval != 0 for i in range(cfg.num_layers)]


@pytest.mark.parametrize("preset, hf_class", [("qwen3.5-moe-tiny", "Qwen3_5MoeForCausalLM"),
                                              ("qwen3-next-tiny", "Qwen3NextForCausalLM")])
def test_tiny_hybrid_moe_presets_load_in_hf_and_jtp_greedy_matches(mk, tmp_path, preset, hf_class):
    """The checkpoint layout real hybrid MoE models ship (fused or per-expert experts, packed or
    split DeltaNet projections): transformers loads it whole, and jtp's greedy tokens are its."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine

    path = tmp_path / preset
    mk.write_checkpoint(preset, path, dtype="float32", quiet=True)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == hf_class
    prompts = [np.random.default_rng(n).integers(0, 1024, n).tolist() for n in (3, 21)]
    expected = [hf_greedy(model.eval(), p, 6) for p in prompts]
    engine = Engine.from_args(EngineArgs(
        model=path, dtype="float32", skip_tokenizer_init=True, num_blocks=64, block_size=16, max_num_seqs=4))
    got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in got] == expected
