"""Qwen3-Next / Qwen3.5 hybrid family: HF parity, ragged rows and state slots, TP, loading, config.

Tiny float32 models from tests/hf_hybrid.py; HF transformers (pure-torch fallback kernels) is the
reference. Every step runs through the serving step (`ModelRunner.dispatch`, via hf_models.run_step):
its greedy tokens and top-20 logprobs are what is compared. Runners are shared per model kind so
each (T, B) shape compiles once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from pathlib import Path

import hf_hybrid as hh
import numpy as np
import pytest
from hf_models import (
    StepOutput,
    assert_same_outputs,
    assert_step_collectives,
    logprob_error,
    run_step,
)

PROMPT_LEN = 150  # > two 64-token chunks, not a multiple of 64
GEN = 32
BUCKET_T, BUCKET_B = 65, 2  # the shape of the ragged-batch tests
# tp > 1 sums partial products in another order. These random tiny models amplify fp32 round-off
# (where a DeltaNet head's output is near zero its gated RMSNorm scales it up ~1000x; HF's own
# fp32 logits are up to ~1e-4 off its fp64 ones for some seeds). Measured on logits, tp=2 vs tp=1:
# 6e-6 and 1.2e-5; tp=4 vs tp=1 (4 key heads, 8 value heads): 4e-5..1e-4, each as close to HF
# fp64 as tp=1 is. A wrong split is O(1), so this still catches every sharding bug.
TP_TOL = 1e-4


def chunk_edges(n: int) -> list[int]:
    """Prompt positions whose outputs a prefill check reads: the first, the last and both sides of
    every 64-token DeltaNet chunk boundary. (Each rides along as a padding row of the step, and
    padding rows cost a DeltaNet row each, so not all n.)"""
    return sorted({0, n - 1} | {p for edge in range(64, n, 64) for p in (edge - 1, edge)})


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def make_runner(path, tp=1, max_seqs=4):
    from jtp.config.engine_args import EngineArgs
    from jtp.worker.runner import ModelRunner

    return ModelRunner.from_args(EngineArgs(
        model=path, tensor_parallel_size=tp, num_blocks=128, block_size=16, max_num_seqs=max_seqs,
        num_state_slots=2 * max_seqs))


def state_of(runner, slot: int) -> dict[str, np.ndarray]:
    """The slot's DeltaNet state of every linear layer, in HF's layout (conv channels Q|K|V)."""
    out = {}
    for i, layer in enumerate(runner.cache):
        if runner.cfg.is_linear_layer(i):
            conv = np.concatenate([np.asarray(layer.conv_q[slot]), np.asarray(layer.conv_k[slot]), np.asarray(layer.conv_v[slot])])
            out[f"{i}.conv"] = conv
            out[f"{i}.recurrent"] = np.asarray(layer.recurrent[slot])
    return out


def hf_state(model, ids) -> dict[str, np.ndarray]:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    out = {}
    for i, layer in enumerate(cache.layers):
        if hasattr(layer, "recurrent_states"):
            out[f"{i}.conv"] = layer.conv_states[0][0, :, 1:].numpy()  # only the last K-1 columns matter
            out[f"{i}.recurrent"] = layer.recurrent_states[0][0].numpy()
    return out


def assert_states_close(a: dict, b: dict, tol=1e-4):
    assert a.keys() == b.keys() and a
    for k in a:
        assert rel(a[k], b[k]) < tol, k


class Case:
    """One tiny model: HF references, a tp=1 runner, its prefill outputs/state and greedy decode."""

    def __init__(self, kind: str, root: Path):
        self.kind = kind
        self.model = hh.build_model(kind)
        self.path = hh.save(self.model, root / kind, fuse_experts=kind == "qwen3_5_moe")
        self.prompt = tokens(1, PROMPT_LEN)
        self.hf_generated = hh.hf_generate(self.model, self.prompt, GEN)
        self.model64 = hh.double(self.model)
        self.hf_logits = hh.hf_logits(self.model64, self.prompt + self.hf_generated[:-1])
        self.runner = make_runner(self.path)

        planner = hh.Planner()
        self.prefill = run_step(self.runner, planner.plan([(0, 0, self.prompt)]), positions=chunk_edges(PROMPT_LEN))
        self.prefill_state = state_of(self.runner, 0)
        self.generated, decode = [], []
        nxt = int(self.prefill.tokens[-1])
        for step in range(GEN):
            self.generated.append(nxt)
            if step == GEN - 1:
                break
            decode.append(run_step(self.runner, planner.plan([(0, 0, [nxt])])))
            nxt = int(decode[-1].tokens[0])
        self.decode = StepOutput.concat(decode)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return functools.lru_cache(maxsize=None)(lambda kind: Case(kind, root))


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hf_parity_prefill_decode_and_greedy(case, kind):
    c = case(kind)
    assert logprob_error(c.prefill, c.hf_logits[chunk_edges(PROMPT_LEN)]) < 1e-4
    # 31 single-token decode steps continue from the slot state and the paged K/V.
    assert logprob_error(c.decode, c.hf_logits[PROMPT_LEN:]) < 1e-4
    assert c.generated == c.hf_generated


def test_yarn_with_partial_rotary_matches_hf(tmp_path):
    """YaRN on a hybrid: its frequencies over the partial rotary dims (8 of 32), its attention
    factor on cos and sin, positions past a short original context (16)."""
    rope = {**hh.ROPE, "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
    model = hh.build_model("qwen3_5_text", rope_parameters=rope)
    assert model.config.rope_parameters["rope_type"] == "yarn"
    path = hh.save(model, tmp_path / "yarn")
    prompt = tokens(7, 70)
    ref = hh.hf_logits(hh.double(model), prompt)
    out = run_step(make_runner(path), hh.Planner().plan([(0, 0, prompt)]), positions=chunk_edges(len(prompt)))
    assert logprob_error(out, ref[chunk_edges(len(prompt))]) < 1e-4


def test_hf_state_after_prefill(case):
    c = case("qwen3_next")
    assert_states_close(c.prefill_state, hf_state(c.model, c.prompt))


# ----------------------------------------------------------------------------- ragged rows and slots


def test_chunked_prefill_anywhere_equals_one_shot_and_token_by_token(case):
    c = case("qwen3_5_text")
    ids = tokens(2, 1 + 37 + 64 + 65)
    ref = hh.hf_logits(c.model64, ids)
    r, planner = c.runner, hh.Planner()

    # Chunks of 1, 37, 64 and 65 tokens in slot 1 (chunk boundaries mid-64, all padded to one bucket).
    start = 0
    for n in (1, 37, 64, 65):
        out = run_step(r, planner.plan([(1, 1, ids[start : start + n])], BUCKET_T, BUCKET_B))
        start += n
        assert logprob_error(out.take([0]), ref[[start - 1]]) < 1e-4, n
    chunked = state_of(r, 1)

    # The same tokens one at a time in slot 2.
    steps = StepOutput.concat([run_step(r, planner.plan([(2, 2, [t])])) for t in ids])
    assert logprob_error(steps, ref) < 1e-4
    assert_states_close(state_of(r, 2), chunked, 1e-5)
    assert_states_close(chunked, hf_state(c.model, ids))


def test_mixed_batch_and_reused_slot(case):
    c = case("qwen3_5_text")
    a, b, d = tokens(3, 41), tokens(4, 38), tokens(5, 50)
    ref_a, ref_b, ref_d = (hh.hf_logits(c.model64, x) for x in (a, b, d))
    r, planner = c.runner, hh.Planner()

    run_step(r, planner.plan([(0, 2, a[:40])], BUCKET_T, BUCKET_B))
    # One step: a's decode token and b's first prefill chunk, different slots.
    out = run_step(r, planner.plan([(0, 2, a[40:]), (1, 3, b[:37])], BUCKET_T, BUCKET_B))
    assert logprob_error(out.take([0]), ref_a[[40]]) < 1e-4
    assert logprob_error(out.take([1]), ref_b[[36]]) < 1e-4
    # b decodes while d starts at position 0 in a's old slot: it must see a zero state.
    out = run_step(r, planner.plan([(1, 3, b[37:]), (2, 2, d)], BUCKET_T, BUCKET_B))
    assert logprob_error(out.take([0]), ref_b[[37]]) < 1e-4
    assert logprob_error(out.take([1]), ref_d[[49]]) < 1e-4


def test_prompt_step_lays_out_its_long_rows_apart(case):
    """A step with a row over SHORT_ROW tokens runs its rows of several tokens as [long_rows, L]
    (here 4 of its 8 rows) and every lone token (decodes, a one-token prompt) as one recurrence
    step: each row's logits and state equal HF's; a step with more rows of several tokens than
    that is refused, not computed."""
    from jtp.core.buckets import long_rows

    limit = long_rows(80, 8, 80)
    assert limit == 4

    c = case("qwen3_5_text")
    r, planner = make_runner(c.path, max_seqs=8), hh.Planner()
    seqs = {s: tokens(20 + s, n) for s, n in {0: 40, 1: 20, 2: 3, 3: 11, 4: 13, 5: 10, 6: 1}.items()}
    run_step(r, planner.plan([(s, s, seqs[s][:-1]) for s in (3, 4, 5)], 80, 8))
    rows = [(s, s, seqs[s][-1:]) for s in (3, 4, 5)] + [(s, s, seqs[s]) for s in (0, 1, 2, 6)]
    out = run_step(r, planner.plan(rows, 80, 8))
    for b, (s, _, _) in enumerate(rows):
        ref = hh.hf_logits(c.model64, seqs[s])
        assert logprob_error(out.take([b]), ref[[-1]]) < 1e-4, f"sequence {s}"
    for s in (0, 3):
        assert_states_close(state_of(r, s), hf_state(c.model, seqs[s]))

    many = [(s, s, tokens(30 + s, 17 if s == 0 else 2)) for s in range(limit + 1)]
    with pytest.raises(ValueError, match=f"at most {limit} rows of several tokens"):
        run_step(r, hh.Planner().plan(many, 80, 8))


# ----------------------------------------------------------------------------- per-row padding (query_bound)


def delta_rule_inputs(B, L, H, dk, dv, empty, seed):
    """Random q, k, v, g, beta, state of the gated delta rule; k = g = beta = 0 where empty [B, L]
    (padding tokens, which must leave the state alone)."""
    import jax
    import jax.numpy as jnp

    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(jax.random.normal(ks[0], (B, L, H, dk))), unit(jax.random.normal(ks[1], (B, L, H, dk)))
    v = jax.random.normal(ks[2], (B, L, H, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, L, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, L, H)))
    e = empty[..., None]
    return q, jnp.where(e[..., None], 0.0, k), v, jnp.where(e, 0.0, g), jnp.where(e, 0.0, beta), \
        jax.random.normal(ks[5], (B, H, dk, dv))


def token_by_token(q, k, v, g, beta, S):
    """The L = 1 recurrence over every token: (outputs [B, L, H, dv], the states after 0..L tokens)."""
    import jax
    import jax.numpy as jnp

    from jtp.models.delta_rule import gated_delta_step

    step, outs, states = jax.jit(gated_delta_step), [], [S]
    for t in range(q.shape[1]):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
        states.append(S)
    return jnp.stack(outs, 1), states


def test_single_step_rule_equals_chunked_rule():
    """The L = 1 decode recurrence, token after token, is the chunked rule over the same tokens;
    and the chunked rule's kept state (a verify row's state before its drafts) is the recurrence's
    state after that many tokens, in any chunk."""
    import jax
    import jax.numpy as jnp

    from jtp.models.delta_rule import chunked_gated_delta_rule

    B, L = 3, 8
    # Row 2 is empty from t = 5 on: k = g = beta = 0 must leave its state alone in both paths.
    pad = (jnp.arange(B)[:, None] == 2) & (jnp.arange(L)[None, :] >= 5)
    x = delta_rule_inputs(B, L, 2, 4, 5, pad, seed=0)
    keep_lens = jnp.array([3, 6, 0], jnp.int32)  # in the first chunk, the second, and none at all
    o_ref, S_ref, kept = jax.jit(chunked_gated_delta_rule, static_argnums=6)(*x, 4, keep_lens)
    outs, states = token_by_token(*x)
    assert rel(outs, o_ref) < 1e-5
    assert rel(states[-1], S_ref) < 1e-5
    for b, n in enumerate(keep_lens.tolist()):
        assert rel(states[n][b], kept[b]) < 1e-5, f"row {b}: state after {n} tokens"


def test_chunked_rule_skips_chunks_past_each_rows_end():
    """Given each row's length and a bound on their sum, the chunked rule computes only the chunks
    that hold tokens (10 of 12 here): its outputs, final and kept states equal the recurrence's."""
    import jax
    import jax.numpy as jnp

    from jtp.models.delta_rule import chunked_gated_delta_rule

    B, L = 3, 16
    lens = jnp.array([16, 3, 6], jnp.int32)
    pad = jnp.arange(L)[None, :] >= lens[:, None]
    x = delta_rule_inputs(B, L, 2, 4, 5, pad, seed=1)
    keep_lens = jnp.array([10, 2, 0], jnp.int32)
    rule = jax.jit(chunked_gated_delta_rule, static_argnames=("chunk", "max_tokens"))
    o, S_end, kept = rule(*x, chunk=4, keep_lens=keep_lens, row_lens=lens, max_tokens=25)
    outs, states = token_by_token(*x)
    real = ~pad[..., None, None]
    assert rel(jnp.where(real, outs, 0.0), jnp.where(real, o, 0.0)) < 1e-5
    assert rel(states[-1], S_end) < 1e-5
    for b, n in enumerate(keep_lens.tolist()):
        assert rel(states[n][b], kept[b]) < 1e-5, f"row {b}: state after {n} tokens"


def numpy_fused_decode(q, k, v, a, b, weights, states, a_log, dt_bias, pool, rows, ratio):
    """float64 numpy of a DeltaNet decode token (conv update, gates, l2norms, recurrence) per row."""
    token, valid, read, fresh, write = rows
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    states, pool = [f64(s).copy() for s in states], f64(pool).copy()
    H, dk, dv = pool.shape[1:]
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    outs = np.zeros((len(token), H, dv))
    for row in range(len(token)):
        t = token[row]
        convs = []
        for x, w, s in zip((q, k, v), weights, states):
            prev = np.zeros(s.shape[1:]) if fresh[row] else s[read[row]]
            full = np.concatenate([prev, f64(x)[t][:, None] * valid[row]], axis=1)  # [C, K]
            y = np.sum(full * f64(w), axis=1)
            convs.append(y * sigmoid(y))
            s[write[row]] = full[:, 1:]
        qc, kc, vc = (c.reshape(-1, d) for c, d in zip(convs, (dk, dk, dv)))
        for h in range(H):
            qn = qc[h // ratio] / np.sqrt(np.sum(qc[h // ratio] ** 2) + 1e-6) / np.sqrt(dk)
            kn = kc[h // ratio] / np.sqrt(np.sum(kc[h // ratio] ** 2) + 1e-6) * valid[row]
            beta = sigmoid(f64(b)[t, h]) * valid[row]
            g = -np.exp(f64(a_log)[h]) * np.logaddexp(f64(a)[t, h] + f64(dt_bias)[h], 0) * valid[row]
            S = np.exp(g) * (np.zeros((dk, dv)) if fresh[row] else pool[read[row], h])
            S = S + np.outer(kn, beta * (vc[h] - S.T @ kn))
            outs[row, h] = S.T @ qn
            pool[write[row], h] = S
    return outs, states, pool


def fused_decode_inputs(rng, T=4, Hk=2, ratio=3, dk=32, dv=64, taps=4, slots=10):
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    H = Hk * ratio
    q, k, v = normal(T, Hk * dk), normal(T, Hk * dk), normal(T, H * dv)
    a, b = normal(T, H), normal(T, H)
    weights = tuple(normal(c, taps) * 0.5 for c in (Hk * dk, Hk * dk, H * dv))
    states = tuple(normal(slots, c, taps - 1) for c in (Hk * dk, Hk * dk, H * dv))
    a_log, dt_bias, pool = normal(H), normal(H), normal(slots, H, dk, dv)
    # Rows continuing a slot, one moving to a free slot, a fresh row, and two padding rows (the
    # scratch slot, the last); row tokens in any order of the flat step, fewer tokens than rows.
    rows = (np.array([3, 0, 2, 1, 0, 0], np.int32), np.array([True] * 4 + [False] * 2),
            np.array([0, 3, 5, 0, 0, 0], np.int32), np.array([False, False, False, True, True, True]),
            np.array([0, 3, 6, 7, 9, 9], np.int32))
    return (q, k, v, a, b, weights, states, a_log, dt_bias, pool, rows), ratio


def test_fused_decode_matches_numpy():
    """A DeltaNet layer's decode token in the two GPU kernels (interpreted here) against float64
    numpy; every slot nobody writes keeps its bytes (the pools are updated in place), the scratch
    slot too: padding rows move no state."""
    import jax
    import jax.numpy as jnp

    from jtp.models.attention import PagedAttention
    from jtp.models.delta_rule import fused_decode

    args, ratio = fused_decode_inputs(np.random.default_rng(7))
    want_o, want_states, want_pool = numpy_fused_decode(*args, ratio)
    parts, rest = [jnp.asarray(x) for x in args[:5]], jax.tree.map(jnp.asarray, args[5:])

    def separate(q, k, v, a, b, *rest):  # each part its own array
        return fused_decode([(x, 0, x.shape[1]) for x in (q, k, v, a, b)], *rest, PagedAttention("kernel"))

    def one_output(q, k, v, a, b, *rest):  # the parts as columns of one projection's output (z among them)
        whole = jnp.concatenate([q, k, v, jnp.ones_like(v), a, b], axis=1)
        starts = np.cumsum([0] + [x.shape[1] for x in (q, k, v, v, a)])
        columns = [(whole, int(start), x.shape[1]) for x, start in zip((q, k, v, a, b), starts[[0, 1, 2, 4, 5]])]
        return fused_decode(columns, *rest, PagedAttention("kernel"))

    for layout in (separate, one_output):
        step = jax.jit(layout)
        text = str(step.trace(*parts, *rest).jaxpr)
        assert "jtp_conv_update" in text and "jtp_delta_rule_step" in text
        o, states, pool = step(*parts, *rest)
        real = slice(0, 4)  # the two padding rows: zeros out, no state read or written
        np.testing.assert_allclose(np.asarray(o)[real], want_o[real], rtol=2e-5, atol=2e-5)
        assert not np.asarray(o)[4:].any()
        for got, want, before in zip((*states, pool), (*want_states, want_pool), (*args[6], args[9])):
            np.testing.assert_allclose(np.asarray(got)[:-1], want[:-1], rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(np.asarray(got)[-1], before[-1])  # the scratch slot: untouched


def test_fused_decode_lowers_to_triton_and_splits_heads_under_tp():
    """Qwen3.5-9B's shapes lower to Triton on the CPU (an op Triton lacks fails here, not on a lent
    GPU); at tp=2 the kernels run per head shard inside shard_map and equal the unsharded call."""
    import jax
    import jax.numpy as jnp
    from cpu_env import cuda_lowering
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jtp.kernels import delta_rule_step as fused
    from jtp.models.attention import PagedAttention
    from jtp.models.delta_rule import fused_decode
    from jtp.parallel.sharding import make_mesh

    S = jax.ShapeDtypeStruct
    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    B, T, Hk, H, dk, dv = 8, 8, 16, 32, 128, 128
    rows = (S((B,), i32), S((B,), jnp.bool_), S((B,), i32), S((B,), jnp.bool_), S((B,), i32))
    width = 2 * Hk * dk + 2 * H * dv + 2 * H  # Qwen3.5-9B's fused q/k/v/z/a/b output
    parts = ((0, 0), (0, Hk * dk), (0, 2 * Hk * dk))
    text = cuda_lowering(lambda *a: fused.conv_update(a[:1], parts, a[1:4], a[4:7], *a[7:]), S((T, width), bf16),
                         S((Hk * dk, 4), bf16), S((Hk * dk, 4), bf16), S((H * dv, 4), bf16),
                         S((65, Hk * dk, 3), bf16), S((65, Hk * dk, 3), bf16), S((65, H * dv, 3), bf16), *rows)
    assert "triton" in text and "jtp_conv_update" in text
    a_part, b_part = (0, width - 2 * H), (0, width - H)
    text = cuda_lowering(lambda q, k, v, x, *a: fused.delta_rule_step(q, k, v, (x,), a_part, b_part, *a),
                         S((B, Hk * dk), bf16), S((B, Hk * dk), bf16), S((B, H * dv), bf16), S((T, width), bf16),
                         S((H,), f32), S((H,), bf16), S((65, H, dk, dv), f32), *rows)
    assert "triton" in text and "jtp_delta_rule_step" in text

    mesh = make_mesh(2)
    args, _ = fused_decode_inputs(np.random.default_rng(8), Hk=2, ratio=2, dk=16, dv=32)
    q, k, v, a, b, weights, states, a_log, dt_bias, pool, rows = jax.tree.map(jnp.asarray, args)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    sharded = ([put(x, None, "tp") for x in (q, k, v, a, b)],
               tuple(put(w, "tp") for w in weights), tuple(put(s, None, "tp") for s in states), put(a_log, "tp"),
               put(dt_bias, "tp"), put(pool, None, "tp"), rows)
    step = jax.jit(lambda xs, *a: fused_decode([(x, 0, x.shape[1]) for x in xs], *a, PagedAttention("kernel", mesh)))
    assert "jtp_delta_rule_step" in str(step.trace(*sharded).jaxpr)
    got = step(*sharded)
    want = fused_decode([(x, 0, x.shape[1]) for x in (q, k, v, a, b)], weights, states, a_log, dt_bias, pool, rows,
                        PagedAttention("kernel"))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    # The parts as columns of one (replicated) array: under tp=2 each is sliced out and split.
    whole = jnp.concatenate([q, k, v, a, b], axis=1)
    starts = np.cumsum([0] + [x.shape[1] for x in (q, k, v, a)]).tolist()
    widths = [x.shape[1] for x in (q, k, v, a, b)]
    got = jax.jit(lambda w, *a: fused_decode([(w, s, n) for s, n in zip(starts, widths)], *a,
                                             PagedAttention("kernel", mesh)))(whole, *sharded[1:])
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_which_decode_steps_take_the_fused_kernels():
    """Head dims the kernels tile (powers of two, 32 value columns or more), conv channels in blocks
    of 16 or more per device, key heads that split over tp; the kernel path only."""
    from jtp.models.attention import PagedAttention
    from jtp.models.delta_rule import fused_decode_supported
    from jtp.parallel.sharding import make_mesh

    kernel, mesh = PagedAttention("kernel"), make_mesh(2)
    assert fused_decode_supported(kernel, 128, 128, 16, 2048, 2048, 4096)  # Qwen3.5-9B
    assert fused_decode_supported(kernel, 16, 32, 2, 32, 32, 192)  # 6 value heads on 2 key heads
    assert not fused_decode_supported(PagedAttention("reference"), 128, 128, 16, 2048, 2048, 4096)
    assert not fused_decode_supported(kernel, 128, 16, 16, 2048, 2048, 256)  # fewer value columns than a program's 32
    assert not fused_decode_supported(kernel, 96, 128, 16, 1536, 1536, 4096)  # dk not a power of two
    assert not fused_decode_supported(kernel, 16, 32, 1, 8, 8, 32)  # 8-channel conv blocks
    assert fused_decode_supported(PagedAttention("kernel", mesh), 16, 32, 2, 32, 32, 128)
    assert not fused_decode_supported(PagedAttention("kernel", mesh), 16, 32, 3, 48, 48, 192)  # 3 key heads on 2


def gpu_path_model(tmp_path, monkeypatch):
    """A tiny hybrid whose DeltaNet head dims the kernels tile (powers of two, 32 value columns or
    more), the kernel path switched on (interpreted off-GPU): (its path, its float64 HF copy, a list
    that grows each time the fused DeltaNet step kernel is traced)."""
    from jtp.kernels import delta_rule_step

    model = hh.build_model("qwen3_5_text", linear_key_head_dim=16, linear_value_head_dim=32)
    monkeypatch.setenv("JTP_ATTENTION", "kernel")
    traced = []
    kernel = delta_rule_step.delta_rule_step
    monkeypatch.setattr(delta_rule_step, "delta_rule_step", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    return hh.save(model, tmp_path / "model"), hh.double(model), traced


def test_gpu_kernels_match_hf(tmp_path, monkeypatch):
    """The GPU path (Pallas kernels, interpreted off-GPU) through the serving step: decode steps of two
    sequences and two padding rows run the fused DeltaNet decode step and the attention kernels, and
    agree with HF. (DeltaNet head dims the kernel tiles: powers of two, 32 value columns or more.)"""
    path, model64, traced = gpu_path_model(tmp_path, monkeypatch)
    runner = make_runner(path)
    assert runner.attention.impl == "kernel"
    prompts = [tokens(20, 12), tokens(21, 7)]
    planner = hh.Planner()
    out = run_step(runner, planner.plan([(0, 0, prompts[0]), (1, 1, prompts[1])]))
    generated = [[int(t)] for t in out.tokens]
    outputs = [[], []]
    for _ in range(4):
        plan = planner.plan([(0, 0, generated[0][-1:]), (1, 1, generated[1][-1:])], num_rows=4)
        out = run_step(runner, dataclasses.replace(plan, max_row_len=1))  # a pure decode step: L = 1
        for i in range(2):
            outputs[i].append(out.take(slice(i, i + 1)))
            generated[i].append(int(out.tokens[i]))
    assert traced, "the decode steps did not take the fused kernel"
    for i, prompt in enumerate(prompts):
        ref = hh.hf_logits(model64, prompt + generated[i][:-1])[len(prompt):]
        assert logprob_error(StepOutput.concat(outputs[i]), ref) < 1e-4, i
        assert [int(t) for t in ref.argmax(-1)] == generated[i][1:], i


def test_gpu_kernels_in_a_split_prompt_step_match_hf(tmp_path, monkeypatch):
    """The GPU path of a prompt step laid out apart (deltanet_rows.SplitRows): two decodes and a
    one-token prompt through the fused DeltaNet decode kernels (interpreted; five of the eight rows
    are not theirs), two prompt chunks through the chunked rule, each row's logits against HF."""
    path, model64, traced = gpu_path_model(tmp_path, monkeypatch)
    runner, planner = make_runner(path, max_seqs=8), hh.Planner()
    seqs = {s: tokens(40 + s, n) for s, n in {0: 9, 1: 6, 2: 20, 3: 3, 4: 1}.items()}
    run_step(runner, planner.plan([(s, s, seqs[s][:-1]) for s in (0, 1)], 32, 8))
    rows = [(0, 0, seqs[0][-1:]), (1, 1, seqs[1][-1:])] + [(s, s, seqs[s]) for s in (2, 3, 4)]
    out = run_step(runner, planner.plan(rows, 32, 8))
    assert traced, "the lone tokens did not take the fused kernel"
    for b, (s, _, _) in enumerate(rows):
        assert logprob_error(out.take([b]), hh.hf_logits(model64, seqs[s])[[-1]]) < 1e-4, f"sequence {s}"


@pytest.mark.parametrize("C", [1, 2, 3, 17, 64])
def test_unit_lower_inverse_equals_numpy_inverse(C):
    """The chunked rule's (I + A)^-1 by repeated squaring equals a float64 inverse, at every size."""
    import jax.numpy as jnp

    from jtp.models.delta_rule import unit_lower_inverse

    A = np.tril(np.random.default_rng(C).normal(size=(2, 3, C, C)) * 0.3, -1).astype(np.float32)
    expected = np.linalg.inv(np.eye(C) + A.astype(np.float64))
    got = np.asarray(unit_lower_inverse(jnp.asarray(A)), np.float64)
    assert np.abs(got - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max())


def test_row_length_follows_query_bound():
    from jtp.models.attention import AttentionMetadata
    from jtp.models.deltanet_rows import deltanet_row_length

    meta = AttentionMetadata(*(np.zeros(1, np.int32) for _ in range(9)))
    assert deltanet_row_length(meta, 48) == (48, 48)  # no bound: L = T
    assert deltanet_row_length(meta, 150) == (192, 64)
    for bound, T, want in [(1, 16, (1, 1)), (2, 16, (2, 2)), (16, 48, (16, 16)), (100, 128, (128, 64)), (64, 48, (48, 48))]:
        assert deltanet_row_length(meta._replace(query_bound=np.arange(bound)), T) == want, (bound, T)


def drive_scheduler(runner, prompts, arrivals, max_tokens, general: bool):
    """Run requests through the real Scheduler's plans (query_bound set: L = 1 in pure decode
    steps), greedy. `general`: drop the bound (L = T), forcing the chunked path everywhere.
    Returns per-request outputs and, per step, (bound, row lengths, the rows' StepOutput,
    [(request, position, StepOutput row) of each row that sampled])."""
    from jtp.core.page_pool import PagePool
    from jtp.core.sampling_params import SamplingParams
    from jtp.core.scheduler import Request, Scheduler
    from jtp.core.state_pool import StatePool
    from jtp.worker.input_batch import InputBatch

    sched = Scheduler(PagePool(runner.num_blocks, runner.block_size), 4, 16, max_model_len=64,
                      states=StatePool(runner.num_state_slots))
    batch = InputBatch(4, 64, runner.block_size, sched.buckets)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [Request(str(i), p, params, 0, frozenset()) for i, p in enumerate(prompts)]
    steps = []
    while len(steps) < 100 and (sched.has_work() or len(steps) <= max(arrivals)):
        for r, at in zip(reqs, arrivals):
            if at == len(steps):
                sched.add(r)
        rows = sched.schedule()
        plan = batch.prepare(sched.output(rows)).to_step_input().plan
        bound = plan.max_row_len
        if general:
            plan.max_row_len = None
        out = run_step(runner, plan).take(slice(0, len(rows)))
        sampled = []
        sched.dispatched(rows)  # what the engine does once the step is on the device
        for b, row in enumerate(rows):
            if row.picks_next_token:
                sampled.append((int(row.request.id), row.request.num_computed - 1, out.take([b])))
                row.request.num_unseen_tokens -= 1
                row.request.output_ids.append(int(out.tokens[b]))
        steps.append((bound, [row.num_tokens for row in rows], out, sampled))
        for r in list(sched.running):
            if len(r.output_ids) >= max_tokens:
                sched.remove(r)
    return [r.output_ids for r in reqs], steps


def test_scheduler_plans_decode_path_equals_general_path_and_hf(case):
    """Scheduler-built steps: pure-decode steps (L = 1, the single-step recurrence) and mixed
    steps (L a bucket, rows of 1 token next to prefill chunks) equal the same steps run with
    L = T through the chunked path, and HF."""
    c = case("qwen3_5_text")
    # Contexts stay within one 16-token page and every prefill row within the 16-token bucket, so
    # the whole run compiles two step shapes: L = 16 (mixed) and L = 1 (pure decode).
    prompts, arrivals = [tokens(10, 10), tokens(11, 9), tokens(12, 10), tokens(13, 9)], [0, 1, 3, 5]
    outs, steps = drive_scheduler(c.runner, prompts, arrivals, 6, general=False)
    states = [state_of(c.runner, s) for s in range(4)]
    outs_general, steps_general = drive_scheduler(c.runner, prompts, arrivals, 6, general=True)

    bounds = [b for b, _, _, _ in steps]
    assert bounds.count(1) >= 3 and set(bounds) == {1, 16}
    assert any(b > 1 and 1 in lens for b, lens, _, _ in steps)  # a decode row inside a mixed step
    assert outs == outs_general and all(len(o) == 6 for o in outs)
    assert [lens for _, lens, _, _ in steps] == [lens for _, lens, _, _ in steps_general]
    for (bound, _, a, _), (_, _, b, _) in zip(steps, steps_general):
        assert_same_outputs(a, b, atol=5e-5, msg=f"bound {bound}")
    for s in range(4):  # every request got its own slot; the general run rewrote them
        assert_states_close(state_of(c.runner, s), states[s], 1e-5)

    refs = [hh.hf_logits(c.model64, p + o[:-1]) for p, o in zip(prompts, outs)]
    got = {i: [] for i in range(len(prompts))}
    for _, _, _, sampled in steps:
        for req, pos, out in sampled:
            got[req].append((out, refs[req][pos]))
    for req, pairs in got.items():
        assert len(pairs) == 6
        assert logprob_error(StepOutput.concat([o for o, _ in pairs]), np.stack([r for _, r in pairs])) < 1e-4, req


# ----------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_tp2_equals_tp1_with_one_all_reduce_per_block(case, kind):
    c = case(kind)
    r = make_runner(c.path, tp=2)
    planner = hh.Planner()
    out = run_step(r, planner.plan([(0, 0, c.prompt)]), positions=chunk_edges(PROMPT_LEN))
    assert logprob_error(out, c.hf_logits[chunk_edges(PROMPT_LEN)]) < TP_TOL
    np.testing.assert_array_equal(out.tokens, c.prefill.tokens)
    assert_states_close(state_of(r, 0), c.prefill_state, TP_TOL)

    plan = planner.plan([(0, 0, [c.generated[0]])])
    out = run_step(r, plan)
    assert logprob_error(out, c.hf_logits[[PROMPT_LEN]]) < TP_TOL
    assert out.tokens[0] == c.generated[1]
    # One all-reduce after each mixer (out_proj / o_proj) and one per FFN.
    assert_step_collectives(r, plan)


def test_tp4_with_replicated_kv_heads(tmp_path):
    model = hh.build_model("qwen3_5_text_hk4", seed=1)  # Hk 4, Hv 8, 2 KV heads: replicated twice over 4 ranks
    path = hh.save(model, tmp_path / "hk4")
    ids = tokens(6, 100)
    ref = hh.hf_logits(hh.double(model), ids)
    outs = []
    for tp in (1, 4):
        r = make_runner(path, tp=tp)
        plan = hh.Planner().plan([(0, 0, ids)])
        outs.append((run_step(r, plan, positions=chunk_edges(len(ids))), state_of(r, 0)))
    assert logprob_error(outs[0][0], ref[chunk_edges(len(ids))]) < 1e-4
    assert logprob_error(outs[1][0], ref[chunk_edges(len(ids))]) < TP_TOL
    np.testing.assert_array_equal(outs[1][0].tokens, outs[0][0].tokens)
    assert_states_close(outs[1][1], outs[0][1], TP_TOL)
    assert_step_collectives(r, plan)


# ----------------------------------------------------------------------------- loading


def test_skips_mtp_and_vision_tensors_with_one_log_line(case, tmp_path, caplog):
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jtp.config.model_config import ModelConfig
    from jtp.loading.weights import load_params
    from jtp.parallel.sharding import make_mesh

    c = case("qwen3_5")
    fake = {"mtp.fc.weight": np.ones((64, 128), np.float32), "mtp.layers.0.mlp.experts.0.up_proj.weight": np.ones((4, 4), np.float32)}
    path = hh.save(c.model, tmp_path / "mtp", extra=fake)
    visual = [n for n in load_file(path / "model.safetensors") if n.startswith("model.visual.")]
    assert visual
    cfg = ModelConfig.from_dir(path)
    with caplog.at_level(logging.INFO, logger="jtp.loading.weights"):
        params = load_params(path, cfg, make_mesh(1), jnp.float32)
    lines = [m for m in caplog.messages if "skipping" in m]
    assert lines == [f"skipping {len(visual) + len(fake)} checkpoint tensor(s) jtp does not use (mtp.*, model.visual.*)"]
    assert len(params["layers"]) == cfg.num_layers


def test_missing_tensor_is_named(case, tmp_path):
    import jax.numpy as jnp
    from safetensors.numpy import load_file, save_file

    from jtp.config.model_config import ModelConfig
    from jtp.errors import CheckpointError
    from jtp.loading.weights import load_params
    from jtp.parallel.sharding import make_mesh

    c = case("qwen3_5")
    path = hh.save(c.model, tmp_path / "missing")
    tensors = load_file(path / "model.safetensors")
    name = "model.language_model.layers.2.linear_attn.in_proj_qkv.weight"
    del tensors[name]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(repr(name))):
        load_params(path, ModelConfig.from_dir(path), make_mesh(1), jnp.float32)


def test_fused_and_per_expert_checkpoints_load_the_same(case, tmp_path):
    import jax.numpy as jnp

    from jtp.config.model_config import ModelConfig
    from jtp.loading.weights import load_params
    from jtp.parallel.sharding import make_mesh

    c = case("qwen3_5_moe")  # its checkpoint has fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]
    per_expert = hh.save(c.model, tmp_path / "per_expert")
    cfg = ModelConfig.from_dir(per_expert)
    mesh = make_mesh(2)
    a = load_params(c.path, cfg, mesh, jnp.float32)
    b = load_params(per_expert, cfg, mesh, jnp.float32)
    for name in ("experts_gate", "experts_up", "experts_down"):
        np.testing.assert_array_equal(np.asarray(a["layers"][0][name]), np.asarray(b["layers"][0][name]))


# ----------------------------------------------------------------------------- random-weight presets


def checkpoint_script():
    from scripts_loader import load_script

    return load_script("make_random_checkpoint")


@pytest.mark.parametrize("preset, billions", [("qwen3.5-0.8b", 0.752), ("qwen3.5-9b", 8.954), ("qwen3.5-tiny", 0.000637)])
def test_hybrid_presets_have_every_tensor_jtp_and_hf_expect(tmp_path, preset, billions):
    """Names and shapes of the presets' tensors equal what jtp's layout and HF's model (built on
    the meta device: nothing allocated) expect, and nothing else."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from jtp.config.model_config import ModelConfig
    from jtp.models.qwen3_5 import param_layout

    mk = checkpoint_script()
    raw = mk.make_config(preset, "bfloat16")
    specs = {name: tuple(shape) for name, shape, _ in mk.tensor_specs(raw)}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.model_type == "qwen3_5_text" and cfg.num_layers == len(raw["layer_types"])
    interval = 2 if preset == "qwen3.5-tiny" else 4  # real checkpoints: full attention every 4th layer
    assert [cfg.is_linear_layer(i) for i in range(cfg.num_layers)] == [(i + 1) % interval != 0 for i in range(cfg.num_layers)]
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == cfg.head_dim // 4
    expected = {}
    for source in param_layout(cfg, mtp=True).values():  # the MTP head too, as real checkpoints ship it
        expected |= source.expected()
    assert expected == specs and cfg.mtp_layers == 1
    specs = {name: shape for name, shape in specs.items() if not name.startswith("mtp.")}  # HF drops mtp.*

    (tmp_path / "config.json").write_text(json.dumps(raw))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if raw["tie_word_embeddings"]:
        assert hf.pop("lm_head.weight") == specs["model.embed_tokens.weight"]
    assert hf == specs
    assert sum(int(np.prod(s)) for s in specs.values()) == pytest.approx(billions * 1e9, rel=1e-3)


def test_tiny_hybrid_preset_loads_in_jtp_and_hf(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    mk = checkpoint_script()
    path = tmp_path / "qwen3.5-tiny"
    mk.write_checkpoint("qwen3.5-tiny", path, dtype="float32", quiet=True)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    ids = np.random.default_rng(7).integers(0, 1024, 70).tolist()
    ref = hh.hf_logits(hh.double(model.eval()), ids)
    runner = make_runner(path)
    out = run_step(runner, hh.Planner().plan([(0, 0, ids)]), positions=chunk_edges(len(ids)))
    assert np.isfinite(out.top_logprobs).all() and logprob_error(out, ref[chunk_edges(len(ids))]) < 1e-4


# ----------------------------------------------------------------------------- config


def test_config_parsing(case):
    from jtp.config.model_config import ModelConfig

    c = case("qwen3_5")
    cfg = ModelConfig.from_dir(c.path)
    assert cfg.checkpoint_prefix == "model.language_model."
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (2, 6, 8, 12)
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 1e7 and cfg.num_experts == 0

    raw = hh.config_json(c.path)["text_config"]
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}
    legacy |= dict(model_type="qwen3_5_text", full_attention_interval=2, rope_theta=5e6, partial_rotary_factor=0.5)
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.checkpoint_prefix == "model." and cfg.rotary_dim == 16 and cfg.rope_theta == 5e6
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2

    moe = {k: v for k, v in raw.items() if k != "intermediate_size"} | dict(
        model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, norm_topk_prob=False
    )
    cfg = ModelConfig.from_hf(moe)
    assert cfg.norm_topk_prob and all(cfg.moe_layers) and cfg.shared_expert_intermediate_size == 512

    nxt = dict(raw, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=2)
    cfg = ModelConfig.from_hf(nxt)
    assert cfg.moe_layers == (False, True, False, True) and cfg.norm_topk_prob


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(linear_num_value_heads=5), "linear_num_value_heads"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "sliding_attention"),
        (dict(rope_parameters=dict(rope_theta=1e7, partial_rotary_factor=0.1)), "partial_rotary_factor"),
        (dict(hidden_size=None), "hidden_size"),
    ],
)
def test_config_errors_name_the_field(case, change, field):
    from jtp.config.model_config import ConfigError, ModelConfig

    raw = hh.config_json(case("qwen3_5").path)
    raw["text_config"] = {k: v for k, v in {**raw["text_config"], **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(raw)
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_hf({"model_type": "qwen3_5"})


def test_qwen3_still_rejects_partial_rotary():
    from jtp.config.model_config import ConfigError, ModelConfig

    raw = dict(model_type="qwen3", vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    assert ModelConfig.from_hf(raw).partial_rotary_factor == 1.0
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf(raw | {"partial_rotary_factor": 0.5})


def test_deltanet_input_projections_fuse_into_one_product_or_by_kind():
    """One device: bf16 q/k/v/z/a/b are one product; with FP8 q/k/v/z (the kernel's weights) beside
    bf16 a and b (Qwen's FP8 releases), q/k/v/z and a/b are two. Each gives the unfused outputs."""
    import jax.numpy as jnp

    from jtp.models.layers import BlockFp8, fuse_projections, project

    rng = np.random.default_rng(0)
    names = ("gdn_q", "gdn_k", "gdn_v", "gdn_z", "gdn_a", "gdn_b")
    rows = dict(gdn_q=128, gdn_k=128, gdn_v=256, gdn_z=256, gdn_a=16, gdn_b=16)
    layer = {n: jnp.asarray(rng.standard_normal((rows[n], 256)) * 0.1, jnp.float32) for n in names}
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    want = project(x, layer, *names)

    def fp8(w):  # one scale per 128 x 128 block, values in range
        scale = jnp.max(jnp.abs(w.reshape(w.shape[0] // 128, 128, 2, 128)), axis=(1, 3)) / 448
        values = (w / jnp.repeat(jnp.repeat(scale, 128, 0), 128, 1)).astype(jnp.float8_e4m3fn)
        return BlockFp8(values, scale)

    mixed = {n: fp8(w) if rows[n] % 128 == 0 else w for n, w in layer.items()}
    for params, fp8_kernel, keys in (
            (layer, False, {"+".join(names)}),
            (mixed, True, {"gdn_q+gdn_k+gdn_v+gdn_z", "gdn_a+gdn_b"})):
        fused = fuse_projections({"layers": [dict(params)]}, fp8_kernel)["layers"][0]
        assert set(fused) == keys
        reference = want if params is layer else project(x, params, *names)  # the FP8 weights' own products
        for got, ref in zip(project(x, fused, *names), reference, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
