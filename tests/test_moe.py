"""Routed experts: the grouped-matmul kernel (Pallas' interpreter on CPU) against lax.ragged_dot,
and expert parallelism against tensor parallelism through the serving step on 8 forced CPU devices
(same greedy tokens; one [T, H] all-reduce per MoE layer, the k pairs of a token combined first)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtp.config.engine_args import EngineArgs
from jtp.errors import ShardingError
from jtp.kernels import grouped_matmul as gmm
from jtp.kernels.grouped_matmul import (
    GroupedMatmulConfig,
    choose_config,
    grouped_matmul,
    num_tiles,
    tile_map,
)
from jtp.models.layers import BlockFp8
from jtp.models.moe import RoutedExperts
from jtp.parallel.sharding import make_mesh
from jtp.worker.runner import ModelRunner

pytest.importorskip("torch")
from hf_models import assert_same_outputs, assert_step_collectives, make_hf_checkpoint  # noqa: E402
from test_hf_parity import one_row_plan  # noqa: E402
from test_sharding import greedy  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST


def sorted_rows(rng, rows: int, num_groups: int, used: int):
    """Group sizes of `rows` rows spread over `used` of the groups (the others empty)."""
    chosen = rng.choice(num_groups, size=used, replace=False)
    ids = np.sort(rng.choice(chosen, size=rows))
    return jnp.asarray(np.bincount(ids, minlength=num_groups), jnp.int32)


@pytest.mark.parametrize(
    "rows,k,n,groups,used,config",
    [
        (8, 64, 96, 32, 8, None),  # a decode step's pairs: split K, 16-row tiles
        (40, 32, 64, 4, 4, GroupedMatmulConfig(16, 32, 16, 2)),
        (200, 64, 32, 8, 5, GroupedMatmulConfig(64, 32, 32, 1)),  # tiles spanning groups' ends
        (3, 16, 16, 8, 2, GroupedMatmulConfig(16, 16, 16, 1)),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_ragged_dot(rows, k, n, groups, used, config, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, k, n)), dtype)
    sizes = sorted_rows(rng, rows, groups, used)
    ref = jax.lax.ragged_dot(x, w, sizes, precision=HIGHEST, preferred_element_type=jnp.float32)
    out = grouped_matmul(x, w, sizes, config=config, interpret=True)
    assert out.dtype == dtype and out.shape == (rows, n)
    tol = 1e-4 if dtype == jnp.float32 else 0.05 * float(jnp.abs(ref).max())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=0)

    # gate and up in one pass, the SwiGLU activation in the kernel's epilogue.
    up = jnp.asarray(rng.standard_normal((groups, k, n)), dtype)
    ref_up = jax.lax.ragged_dot(x, up, sizes, precision=HIGHEST, preferred_element_type=jnp.float32)
    fused = grouped_matmul(x, (w, up), sizes, config=config, interpret=True)
    ref_fused = jax.nn.silu(ref) * ref_up
    fused_tol = 1e-3 if dtype == jnp.float32 else 0.05 * float(jnp.abs(ref_fused).max())
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(ref_fused), atol=fused_tol, rtol=1e-4)

    # A contiguous range of groups whose rows start at an offset: one device's experts under EP.
    lo, hi = groups // 4, groups // 4 + groups // 2
    offset = int(sizes[:lo].sum())
    count = int(sizes[lo:hi].sum())
    local = grouped_matmul(x, w[lo:hi], sizes[lo:hi], offset, config=config, interpret=True)
    np.testing.assert_allclose(
        np.asarray(local[offset : offset + count], np.float32), np.asarray(ref[offset : offset + count]), atol=tol, rtol=0
    )


def fp8_experts(rng, groups: int, k: int, n: int, block: tuple[int, int]) -> BlockFp8:
    """Random float8 values with a distinct scale per block (a scale read from the wrong block shows)."""
    values = jnp.asarray(rng.standard_normal((groups, k, n)) * 8, jnp.float32).astype(jnp.float8_e4m3fn)
    return BlockFp8(values, jnp.asarray(rng.uniform(0.25, 4, (groups, k // block[0], n // block[1])), jnp.float32))


@pytest.mark.parametrize(
    "rows,k,n,groups,used,block,config",
    [
        (1, 256, 256, 16, 1, (128, 128), None),  # B=1 decode, top-1: split K, 16-row tiles
        (8, 256, 128, 24, 8, (128, 128), None),  # a decode step's pairs, most groups empty
        (40, 256, 256, 8, 3, (128, 128), GroupedMatmulConfig(16, 64, 32, 2)),  # 4 K steps and 2 n blocks a block
        (200, 64, 32, 8, 5, (16, 16), None),  # prefill-sized tiles spanning groups' ends, small blocks
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_kernel_matches_ragged_dot_on_dequantized_weights(rows, k, n, groups, used, block, config, dtype):
    """float8 experts and their block scales, dequantized in the kernel: the same products as
    ragged_dot on the dequantized weights, plain, gated (gate, up) and a range of groups (EP)."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w, up = fp8_experts(rng, groups, k, n, block), fp8_experts(rng, groups, k, n, block)
    sizes = sorted_rows(rng, rows, groups, used)
    if config is None and rows <= 8:
        assert choose_config(rows, k, n, groups, 1, block).splits > 1  # fp32 partials summed after
    ref, ref_up = (jax.lax.ragged_dot(x, a.dequantize(dtype), sizes, precision=HIGHEST,
                                      preferred_element_type=jnp.float32) for a in (w, up))
    ref_fused = jax.nn.silu(ref) * ref_up
    # float32: ~1e-6 of the largest output (fp32 sums in another order); bfloat16: the rounding of x @ w.
    tol = (lambda r: (1e-5 if dtype == jnp.float32 else 0.02) * float(jnp.abs(r).max()))

    out = grouped_matmul(x, w.values, sizes, config=config, scales=w.scale, interpret=True)
    assert out.dtype == dtype and out.shape == (rows, n)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol(ref), rtol=0)
    fused = grouped_matmul(x, (w.values, up.values), sizes, config=config, scales=(w.scale, up.scale),
                           interpret=True)
    np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(ref_fused), atol=tol(ref_fused), rtol=0)

    lo, hi = groups // 4, groups // 4 + groups // 2
    offset, count = int(sizes[:lo].sum()), int(sizes[lo:hi].sum())
    local = grouped_matmul(x, w.values[lo:hi], sizes[lo:hi], offset, config=config, scales=w.scale[lo:hi],
                           interpret=True)
    np.testing.assert_allclose(np.asarray(local[offset : offset + count], np.float32),
                               np.asarray(ref[offset : offset + count]), atol=tol(ref), rtol=0)


@pytest.mark.parametrize("rows", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("bn, bk", [(None, None), ("256", "256")])
def test_fp8_configs_keep_each_tile_in_one_block(rows, bn, bk, monkeypatch):
    """Qwen3-30B-A3B's expert shapes in 128 x 128 blocks: BK and BN divide the block, also when
    JTP_MOE_BN / JTP_MOE_BK ask for more."""
    for name, value in (("JTP_MOE_BN", bn), ("JTP_MOE_BK", bk)):
        if value:
            monkeypatch.setenv(name, value)
    for k, n, weights in ((2048, 768, 2), (768, 2048, 1), (2048, 384, 2), (384, 2048, 1)):
        cfg = choose_config(rows, k, n, 128, weights, (128, 128))
        assert 128 % cfg.bk == 0 and 128 % cfg.bn == 0 and k % (cfg.bk * cfg.splits) == 0, (k, n, cfg)


def test_tile_map_touches_only_chosen_experts():
    """B=1 decode of a top-8-of-128 model: 8 pairs, one 16-row tile per chosen expert, and every
    other program of the grid idle, so the kernel reads 8 experts' weights, not 128."""
    experts = np.array([3, 17, 40, 41, 77, 90, 100, 127])
    sizes = jnp.asarray(np.bincount(experts, minlength=128), jnp.int32)
    group, start, rows = (np.asarray(a) for a in tile_map(sizes, 0, 16, num_tiles(8, 128, 16)))
    used = rows > 0
    assert sorted(group[used].tolist()) == experts.tolist()
    assert rows[used].tolist() == [1] * 8 and start[used].tolist() == list(range(8))
    # A prefill-sized step: tiles cover every row exactly once, each inside its group.
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 150, 16)
    sizes[[2, 9]] = 0
    group, start, rows = (np.asarray(a) for a in tile_map(jnp.asarray(sizes), 0, 64, num_tiles(int(sizes.sum()), 16, 64)))
    covered = np.concatenate([np.arange(s, s + r) for s, r in zip(start, rows) if r])
    np.testing.assert_array_equal(np.sort(covered), np.arange(sizes.sum()))
    ends = np.cumsum(sizes)
    for g, s, r in zip(group, start, rows):
        if r:
            assert ends[g] - sizes[g] <= s and s + r <= ends[g]


@pytest.mark.parametrize("impl", ["kernel", "ragged_dot"])
def test_padding_tokens_route_to_no_expert(impl):
    """A step padded from 2 real tokens to 6: the padding tokens' experts are never used (the
    kernel is given NaN weights for them and stays finite), real tokens' outputs equal an unpadded
    run, padding outputs are 0."""
    rng = np.random.default_rng(3)
    E, H, I, k = 8, 32, 16, 2
    x = jnp.asarray(rng.standard_normal((6, H)), jnp.float32)
    experts = jnp.asarray([[0, 1], [2, 3], [4, 5], [6, 7], [4, 6], [5, 7]], jnp.int32)
    weights = jnp.asarray(rng.random((6, k)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((E, H, I)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, I, H)), jnp.float32)
    real = jnp.arange(6) < 2
    routed = RoutedExperts(impl)
    expected = routed(x[:2], weights[:2], experts[:2], gate, up, down)
    if impl == "kernel":  # experts 4..7 belong to padding tokens only: poison them
        gate, up, down = (w.at[4:].set(jnp.nan) for w in (gate, up, down))
    out = routed(x, weights, experts, gate, up, down, real)
    np.testing.assert_allclose(np.asarray(out[:2]), np.asarray(expected), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[2:]), 0)


def test_fp8_experts_whose_shards_split_a_block_are_dequantized(monkeypatch):
    """tp=2 over I = 32 in blocks 32 wide: a device's 16 columns would hold half a block's scale, so
    the kernel is given the dequantized experts (and still computes what ragged_dot does)."""
    rng = np.random.default_rng(4)
    E, H, I, k = 4, 32, 32, 2
    x = jnp.asarray(rng.standard_normal((5, H)), jnp.float32)
    experts = jnp.asarray(rng.choice(E, (5, k)), jnp.int32)
    weights = jnp.asarray(rng.random((5, k)), jnp.float32)
    gate, up = fp8_experts(rng, E, H, I, (16, 32)), fp8_experts(rng, E, H, I, (16, 32))
    down = fp8_experts(rng, E, I, H, (32, 16))
    expected = RoutedExperts("ragged_dot")(x, weights, experts, gate, up, down)
    kernel = gmm.grouped_matmul
    scaled = []
    monkeypatch.setattr(gmm, "grouped_matmul", lambda *a, **kw: scaled.append(kw.get("scales") is not None)
                        or kernel(*a, **kw))
    for tp, fp8 in ((1, True), (2, False)):
        scaled.clear()
        out = RoutedExperts("kernel", make_mesh(tp) if tp > 1 else None)(x, weights, experts, gate, up, down)
        assert scaled == [fp8, fp8], tp
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5 * float(jnp.abs(expected).max()))


EP_MODEL = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2, mlp_only_layers=[],
    num_attention_heads=8, num_key_value_heads=2, head_dim=16,  # tp=8 divides the heads
)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    _, path = make_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), **EP_MODEL)
    return path


def test_expert_parallel_matches_tensor_parallel(moe_checkpoint):
    prompt = np.random.default_rng(1).integers(0, 128, 13).tolist()
    base = greedy(ModelRunner.from_args(EngineArgs(model=moe_checkpoint, num_blocks=16, block_size=4)), prompt, 8)
    for tp in (2, 8):
        runner = ModelRunner.from_args(EngineArgs(
            model=moe_checkpoint, tensor_parallel_size=tp, num_blocks=16, block_size=4,
            enable_expert_parallel=True))
        gate = runner.params["layers"][0]["experts_gate"]
        assert gate.addressable_shards[0].data.shape == (8 // tp, 64, 32)  # whole experts per device
        assert_same_outputs(greedy(runner, prompt, 8), base, atol=1e-5, msg=f"EP tp={tp}")


def test_kernel_path_matches_ragged_dot_in_the_step(moe_checkpoint, monkeypatch):
    """The GPU path (JTP_MOE=kernel, interpreted here) through the serving step, TP and EP."""
    prompt = np.random.default_rng(2).integers(0, 128, 9).tolist()
    base = greedy(ModelRunner.from_args(EngineArgs(model=moe_checkpoint, num_blocks=16, block_size=4)), prompt, 4)
    monkeypatch.setenv("JTP_MOE", "kernel")
    for tp, ep in ((1, False), (2, False), (2, True)):
        runner = ModelRunner.from_args(EngineArgs(
            model=moe_checkpoint, tensor_parallel_size=tp, num_blocks=16, block_size=4, enable_expert_parallel=ep))
        assert runner.experts.impl == "kernel"
        assert_same_outputs(greedy(runner, prompt, 4), base, atol=1e-5, msg=f"kernel tp={tp} ep={ep}")


@pytest.mark.parametrize("ep", [False, True])
def test_moe_step_all_reduces_tokens_not_pairs(moe_checkpoint, ep):
    """Prefill and decode: each MoE layer all-reduces one [T, H] array (checked exactly)."""
    for plan in (one_row_plan(list(range(1, 8)), 0, [0, 1, 2], 4), one_row_plan([1], 5, [0, 1, 2], 4)):
        assert_step_collectives(ModelRunner.from_args(EngineArgs(
            model=moe_checkpoint, tensor_parallel_size=4, num_blocks=8, block_size=4,
            enable_expert_parallel=ep)), plan)


def test_expert_parallel_needs_divisible_experts(tmp_path):
    _, six = make_hf_checkpoint("qwen3_moe", tmp_path / "six", **{**EP_MODEL, "num_experts": 6})
    with pytest.raises(ShardingError, match=r"num_experts \(6\) is not divisible by tensor_parallel_size=4"):
        ModelRunner.from_args(EngineArgs(model=six, tensor_parallel_size=4, num_blocks=4, enable_expert_parallel=True))
    _, dense = make_hf_checkpoint("qwen3", tmp_path / "dense")
    with pytest.raises(ShardingError, match="mixture-of-experts"):
        ModelRunner.from_args(EngineArgs(
            model=dense, tensor_parallel_size=2, num_blocks=4, enable_expert_parallel=True))
