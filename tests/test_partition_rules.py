"""Logical axes beside every weight, one rule table (jtp/parallel/rules.py), and the family protocol.

The reference for "how each weight is split" is the regex table jtp used before the logical
axes (path pattern -> PartitionSpec, first match wins), copied here: every parameter of every
family, at real shapes, must get exactly its spec. What the old table did silently (replicate a
parameter no rule named, or a dim that does not divide) is now an error that names it.
"""
from __future__ import annotations

import inspect
import re

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from scripts_loader import load_script

from jtp.config.model_config import ModelConfig
from jtp.errors import CheckpointError, ShardingError
from jtp.loading.dummy_weights import random_params
from jtp.loading.sources import Tensor
from jtp.models import family_of, qwen3, qwen3_5
from jtp.models.attention import KV_AXES, Q_AXES, zeroed_layer_kv
from jtp.models.base import ModelFamily
from jtp.models.moe import EXPERTS_IN_AXES, EXPERTS_OUT_AXES
from jtp.parallel.rules import (
    EXPERT_PARALLEL,
    TENSOR_PARALLEL,
    logical_sharding,
    partition_spec,
)
from jtp.parallel.sharding import make_mesh, validate_tp

# The regex table of jtp before logical axes (first match wins; the last rule replicated the rest).
REGEX_RULES = [
    (r"^(embed|lm_head)$", P("tp", None)),
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)$", P("tp", None)),
    (r"\.(q_bias|k_bias|v_bias)$", P("tp")),
    (r"\.(o_proj|down_proj)$", P(None, "tp")),
    (r"\.experts_(gate|up)$", P(None, None, "tp")),
    (r"\.experts_down$", P(None, "tp", None)),
    (r"\.gdn_(q|k|v|z|b|a|conv_q|conv_k|conv_v)$", P("tp", None)),
    (r"\.gdn_(A_log|dt_bias)$", P("tp")),
    (r"\.(shared_gate|shared_up)$", P("tp", None)),
    (r"\.(gdn_out|shared_down)$", P(None, "tp")),
    (r".*", P()),
]
REGEX_EXPERT_PARALLEL = [(r"\.experts_(gate|up|down)$", P("tp", None, None))]


def regex_spec(path: str, expert_parallel: bool) -> P:
    for pattern, spec in (REGEX_EXPERT_PARALLEL if expert_parallel else []) + REGEX_RULES:
        if re.search(pattern, path):
            return spec
    raise AssertionError(path)


def same_spec(a: P, b: P) -> bool:
    """Equal up to trailing unsplit dims (P("tp") and P("tp", None) split alike)."""
    def norm(s):
        s = list(s)
        while s and s[-1] is None:
            s.pop()
        return s
    return norm(a) == norm(b)


PRESETS = ["qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3.5-9b", "qwen3.5-0.8b", "qwen3.5-35b-a3b",
           "qwen3-next-80b-a3b"]


def preset_config(preset: str) -> ModelConfig:
    return ModelConfig.from_hf(load_script("make_random_checkpoint").make_config(preset, "bfloat16"))


def qwen2_config() -> ModelConfig:  # q/k/v biases
    return ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_attention_heads=28,
                                    num_key_value_heads=4, num_hidden_layers=2, intermediate_size=18944))


def qwen3_attention_bias_config() -> ModelConfig:  # q/k/v and o biases
    return ModelConfig.from_hf(dict(model_type="qwen3", vocab_size=256, hidden_size=64, num_attention_heads=8,
                                    num_key_value_heads=2, head_dim=16, num_hidden_layers=1, intermediate_size=128,
                                    attention_bias=True))


CONFIGS = {p: (lambda p=p: preset_config(p)) for p in PRESETS} | {
    "qwen2": qwen2_config, "qwen3-attention-bias": qwen3_attention_bias_config}


def fits(cfg: ModelConfig, tp: int, expert_parallel: bool) -> bool:
    try:
        validate_tp(cfg, tp, expert_parallel)
        return True
    except ShardingError:
        return False


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_parameter_is_split_by_its_axes_as_the_regex_table_split_it(name):
    cfg = CONFIGS[name]()
    family = family_of(cfg)
    mtp = bool(cfg.mtp_layers)
    for expert_parallel in (False, True) if cfg.num_experts else (False,):
        tps = [tp for tp in (1, 2, 4, 8) if fits(cfg, tp, expert_parallel)]
        assert tps[-1] >= 4, tps
        for tp in tps:
            layout = family.param_layout(cfg, tp, mtp)
            kinds = {path.split(".")[-1] for path in layout}
            assert {"embed", "q_proj", "k_proj", "o_proj"} <= kinds
            mesh = make_mesh(tp)
            for path, source in layout.items():
                sharding = logical_sharding(mesh, path, source.shape, source.axes, expert_parallel)
                expected = regex_spec(path, expert_parallel)
                assert same_spec(sharding.spec, expected), (name, tp, expert_parallel, path, source.axes, sharding.spec)


def test_the_expert_parallel_table_differs_only_for_experts():
    assert {a for a in TENSOR_PARALLEL if TENSOR_PARALLEL[a] != EXPERT_PARALLEL[a]} == {"experts", "expert_mlp"}
    assert TENSOR_PARALLEL.keys() == EXPERT_PARALLEL.keys()


def test_the_kernels_specs_are_the_caches_and_weights_specs():
    assert partition_spec(KV_AXES) == P(None, None, "tp", None)  # heads split, as the KV cache is
    assert partition_spec(Q_AXES) == P(None, "tp", None)
    assert partition_spec(EXPERTS_IN_AXES) == P(None, None, "tp")
    assert partition_spec(EXPERTS_OUT_AXES) == P(None, "tp", None)
    assert partition_spec(EXPERTS_IN_AXES, EXPERT_PARALLEL) == P("tp", None, None)
    # The cache the runner allocates has the spec the attention kernel's shard_map assumes.
    cfg = qwen3_attention_bias_config()
    kv = zeroed_layer_kv(cfg, make_mesh(4), 2, 4, jnp.float32)
    assert kv.k.sharding.spec == partition_spec(KV_AXES) and kv.k.shape[2] == 4  # 2 KV heads, each twice
    assert kv.k.shape[0] == 2 + 1  # the pool's 2 pages and the scratch page


def test_deltanet_state_is_split_like_its_weights():
    cfg = ModelConfig.from_hf(load_script("make_random_checkpoint").make_config("qwen3.5-tiny", "float32"))
    cache = qwen3_5.init_cache(cfg, make_mesh(2), num_blocks=2, block_size=4, num_state_slots=3, dtype=jnp.float32)
    state = cache[0]
    assert [s.sharding.spec for s in state] == [P(None, "tp", None)] * 3 + [P(None, "tp", None, None)]
    assert state.recurrent.dtype == jnp.float32 and state.conv_q.shape[0] == 3 + 1  # the pool's 3 and the scratch slot


def tiny_qwen3(**overrides) -> ModelConfig:
    raw = dict(model_type="qwen3", vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, num_hidden_layers=1, intermediate_size=64)
    return ModelConfig.from_hf(raw | overrides)


def planted(monkeypatch, path: str, source: Tensor):
    """qwen3's layout with one more parameter, first (so the loader meets it before drawing others)."""
    original = qwen3.param_layout
    monkeypatch.setattr(qwen3, "param_layout", lambda cfg, tp=1, mtp=False: {path: source} | original(cfg, tp, mtp))


def test_a_parameter_with_an_axis_no_rule_knows_is_an_error(monkeypatch):
    planted(monkeypatch, "layers.0.new_proj", Tensor("new_proj.weight", (64, 32), ("new_heads", "embed")))
    with pytest.raises(ShardingError, match=r"layers\.0\.new_proj \[64, 32\]: logical axis 'new_heads'"):
        random_params(tiny_qwen3(), make_mesh(2), jnp.float32)
    with pytest.raises(ShardingError, match="new_heads"):  # at tp 1 too: nothing is replicated by default
        random_params(tiny_qwen3(), make_mesh(1), jnp.float32)


def test_a_split_dim_that_does_not_divide_is_an_error(monkeypatch):
    planted(monkeypatch, "layers.0.odd_proj", Tensor("odd_proj.weight", (6, 32), ("mlp", "embed")))
    with pytest.raises(ShardingError, match=r"layers\.0\.odd_proj \[6, 32\]: dim 6 \(logical axis 'mlp'\) .* tp=4"):
        random_params(tiny_qwen3(), make_mesh(4), jnp.float32)
    assert logical_sharding(make_mesh(2), "odd_proj", (6, 32), ("mlp", "embed")).spec == P("tp", None)  # 6 = 2 x 3


def test_a_vocabulary_that_does_not_divide_is_an_error_not_a_replication():
    with pytest.raises(ShardingError, match=r"embed \[130, 32\]: dim 130 \(logical axis 'vocab'\) .* tp=4"):
        random_params(tiny_qwen3(vocab_size=130), make_mesh(4), jnp.float32)


def test_axes_are_declared_for_every_dim():
    with pytest.raises(ValueError, match="one logical axis for each of the 2 dims"):
        Tensor("w", (4, 4), ("embed",))
    with pytest.raises(ValueError, match="one logical axis"):
        Tensor("w", (4,), (None,))


def test_families_satisfy_the_protocol_with_one_signature():
    assert isinstance(qwen3, ModelFamily) and isinstance(qwen3_5, ModelFamily)
    assert inspect.signature(qwen3.param_layout) == inspect.signature(qwen3_5.param_layout)
    assert qwen3.mtp_forward is None and callable(qwen3_5.mtp_forward)
    assert qwen3_5.compute_logits is qwen3.compute_logits
    with pytest.raises(CheckpointError, match="no multi-token-prediction head"):
        qwen3.param_layout(tiny_qwen3(), 1, mtp=True)
