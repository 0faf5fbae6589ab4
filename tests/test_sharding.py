"""Tensor parallelism on 8 forced CPU devices: same tokens and logprobs at every tp, XLA's
all-reduces in the compiled serving step (two per layer), each device reading only its own slice."""

import numpy as np
import pytest

from jtp.config.engine_args import EngineArgs
from jtp.config.model_config import ModelConfig
from jtp.errors import ShardingError
from jtp.models.layers import FusedWeight
from jtp.loading.weights import SafetensorsCheckpoint
from jtp.parallel.sharding import kv_head_replicas
from jtp.worker.runner import ModelRunner

pytest.importorskip("torch")
from hf_models import (  # noqa: E402
    StepOutput,
    assert_same_outputs,
    assert_step_collectives,
    make_hf_checkpoint,
    run_step,
)
from test_hf_parity import one_row_plan  # noqa: E402

# 8 query heads over 2 KV heads: tp=4 and tp=8 need KV-head replication (x2, x4).
WIDE = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=128)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen2"])
def checkpoint(request, tmp_path_factory):
    _, path = make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param), **WIDE)
    return request.param, path


def greedy(runner: ModelRunner, prompt, n: int) -> StepOutput:
    """n greedy steps through the serving step, each feeding back the token it sampled."""
    table = list(range(runner.num_blocks))
    bs = runner.block_size
    outs = [run_step(runner, one_row_plan(prompt, 0, table, bs))]
    for i in range(n - 1):
        outs.append(run_step(runner, one_row_plan(outs[-1].tokens, len(prompt) + i, table, bs)))
    return StepOutput.concat(outs)


def fused_names(runner: ModelRunner) -> set[str]:
    return {name for layer in runner.params["layers"] for name, w in layer.items() if isinstance(w, FusedWeight)}


def test_tp_invariance(checkpoint):
    """Also: one device multiplies q/k/v (and a dense MLP's gate/up) as one fused weight, a sharded mesh
    keeps them apart, and both give the same tokens and logprobs."""
    kind, path = checkpoint
    prompt = np.random.default_rng(0).integers(0, 128, 19).tolist()
    single = ModelRunner.from_args(EngineArgs(model=path, num_blocks=16, block_size=4))
    assert fused_names(single) >= {"q_proj+k_proj+v_proj"} | ({"gate_proj+up_proj"} if kind != "qwen3_moe" else set())
    base = greedy(single, prompt, 12)
    for tp in (2, 4, 8):
        runner = ModelRunner.from_args(EngineArgs(model=path, tensor_parallel_size=tp, num_blocks=16, block_size=4))
        assert not fused_names(runner)
        assert kv_head_replicas(runner.cfg, tp) == max(1, tp // 2)
        assert_same_outputs(greedy(runner, prompt, 12), base, atol=1e-5, msg=f"{kind} tp={tp}")


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_decode_step_has_two_all_reduces_per_layer(checkpoint, tp):
    _, path = checkpoint
    plan = one_row_plan([1], 5, [0, 1, 2], 4)  # one decode token
    assert_step_collectives(ModelRunner.from_args(EngineArgs(
        model=path, tensor_parallel_size=tp, num_blocks=8, block_size=4)), plan)
    assert_step_collectives(ModelRunner.from_args(EngineArgs(model=path, num_blocks=8, block_size=4)), plan)


def test_each_device_reads_only_its_slice(checkpoint, monkeypatch):
    kind, path = checkpoint
    reads: list[tuple[str, tuple]] = []
    original = SafetensorsCheckpoint.read

    def spy(self, name, index=()):
        out = original(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(SafetensorsCheckpoint, "read", spy)
    ModelRunner.from_args(EngineArgs(model=path, tensor_parallel_size=4, num_blocks=4, block_size=4))
    cfg = ModelConfig.from_dir(path)
    q_reads = [shape for name, shape in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q_reads == [(cfg.q_size // 4, cfg.hidden_size)] * 4  # column-parallel: a quarter each
    o_reads = [shape for name, shape in reads if name == "model.layers.0.self_attn.o_proj.weight"]
    assert o_reads == [(cfg.hidden_size, cfg.q_size // 4)] * 4  # row-parallel
    k_reads = [shape for name, shape in reads if name == "model.layers.0.self_attn.k_proj.weight"]
    assert k_reads == [(cfg.head_dim, cfg.hidden_size)] * 4  # one (replicated) KV head each
    biggest = max(int(np.prod(s)) for n, s in reads if not n.endswith("embed_tokens.weight"))
    assert biggest < max(cfg.q_size, cfg.intermediate_size) * cfg.hidden_size


def test_indivisible_tp_is_a_clear_error(tmp_path):
    _, path = make_hf_checkpoint("qwen3", tmp_path / "m", num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ShardingError, match="num_attention_heads"):
        ModelRunner.from_args(EngineArgs(model=path, tensor_parallel_size=4, num_blocks=4))
    with pytest.raises(ShardingError, match="device"):
        ModelRunner.from_args(EngineArgs(model=path, tensor_parallel_size=16, num_blocks=4))
