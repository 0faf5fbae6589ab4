"""jtp.worker.sampler against independent references: a per-row numpy reference of
logit bias, penalties and truncation, numpy argmax / log_softmax, exact distributions, and
the host-side jax.random key derivation."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtp.core.sampling_params import (
    MAX_LOGIT_BIAS,
    SamplingParamError,
    SamplingParams,
    pack_logit_bias,
    pack_penalty_tokens,
    pack_sampling,
)
from jtp.worker.sampler import (
    apply_penalties,
    build_logit_bias,
    build_penalty_counts,
    process_logits,
    sample,
    sample_jit,
)

# ----------------------------------------------------------------------------- numpy reference


def ref_bias(p: SamplingParams, vocab: int):
    """The row's logit bias as a dense vector (its float32 values, as they travel to the device)."""
    bias = np.zeros(vocab)
    for token, value in (p.logit_bias or {}).items():
        bias[int(token)] += float(np.float32(value))
    return bias


def ref_penalise(row, p: SamplingParams, prompt_ids, output_ids):
    """The logit bias, then HF repetition penalty over prompt+output, then OpenAI frequency/presence
    over output."""
    x = np.asarray(row, np.float64) + ref_bias(p, len(row))
    for t in set(prompt_ids) | set(output_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output_ids).items():
        x[t] -= p.frequency_penalty * count
        x[t] -= p.presence_penalty
    return x


def ref_keep(x, p: SamplingParams, slack: float = 0.0):
    """Set of token ids kept by top-k -> top-p -> min-p on penalised logits x.

    slack > 0 loosens every threshold a little, slack < 0 tightens it, so that
    ref_keep(-1) <= device <= ref_keep(+1) whatever float32 rounding does.
    """
    y = x / p.temperature
    vocab = len(y)
    finite_max = max(abs(v) for v in y if math.isfinite(v))

    def tol(v):  # slack in logit units, relative to the magnitude
        return slack * 1e-5 * (1 + finite_max)

    order = sorted(range(vocab), key=lambda i: -y[i])
    best = order[0]
    keep = set(range(vocab))
    if 0 < p.top_k < vocab:
        kth = y[order[p.top_k - 1]]
        keep = {i for i in range(vocab) if y[i] >= kth - tol(kth)} | {best}
    if p.top_p < 1.0:
        weights = {i: math.exp(y[i] - y[best]) for i in keep}
        total = sum(weights.values())
        mass, cutoff = 0.0, y[best]
        for i in order:
            if i not in keep:
                continue
            if mass >= p.top_p + slack * (1e-4 + 1e-6 * finite_max):
                break
            cutoff = y[i]
            mass += weights[i] / total
        keep = {i for i in keep if y[i] >= cutoff - tol(cutoff)} | {best}
    if p.min_p > 0:
        keep = {i for i in keep
                if y[i] - y[best] >= math.log(p.min_p) - tol(y[best])} | {best}
    return keep


def as_float32(p: SamplingParams) -> SamplingParams:
    """p with its float fields rounded to float32; below float32's normal range
    they are zero (XLA may flush subnormals)."""
    def f32(x):
        x = float(np.float32(x))
        return 0.0 if abs(x) < np.finfo(np.float32).tiny else x
    return dataclasses.replace(p, **{name: f32(getattr(p, name)) for name in (
        "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty")})


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- helpers


def flags_of(batch):
    return batch.static_flags()._asdict()


@functools.partial(jax.jit, static_argnames=("needs_top_k_p_min_p", "needs_penalties"))
def device_process(logits, batch, ids, is_output, bias_ids, biases, *, needs_top_k_p_min_p, needs_penalties):
    counts, prompt_mask = build_penalty_counts(ids, is_output, logits.shape[-1])
    bias = build_logit_bias(bias_ids, biases, logits.shape[-1])
    penalised = apply_penalties(logits + bias, batch, counts, prompt_mask)
    processed = process_logits(logits, batch, needs_top_k_p_min_p=needs_top_k_p_min_p,
                               needs_penalties=needs_penalties, output_counts=counts,
                               prompt_mask=prompt_mask, logit_bias=bias)
    return penalised, processed


def make_logits(rng, shape, mode):
    if mode == "grid":  # many exact ties
        return (rng.integers(-3, 4, shape) * 0.5).astype(np.float32)
    if mode == "extreme":
        return (rng.standard_normal(shape) * 1e3).astype(np.float32)
    logits = rng.standard_normal(shape).astype(np.float32) * 2
    if mode == "neg_inf":  # masked vocab entries; keep column 0 finite
        logits[rng.random(shape) < 0.3] = -np.inf
        logits[:, 0] = 1.0
    return logits


def param_strategy(vocab):
    return st.builds(
        SamplingParams,
        logit_bias=st.none() | st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=4),
        temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 1.7]) | st.floats(0.05, 3.0),
        top_k=st.integers(-1, vocab + 1),
        top_p=st.sampled_from([1.0, 0.9, 0.5, 1e-6]) | st.floats(0.01, 1.0),
        min_p=st.sampled_from([0.0, 0.0, 0.1, 1.0]) | st.floats(0.0, 1.0),
        repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]) | st.floats(0.1, 3.0),
        presence_penalty=st.sampled_from([0.0, 1.0]) | st.floats(-2.0, 2.0),
        frequency_penalty=st.sampled_from([0.0, -0.5]) | st.floats(-2.0, 2.0),
    )


# ----------------------------------------------------------------------------- processing vs reference


@settings(max_examples=60, deadline=None)
@given(data=st.data(), num_rows=st.sampled_from([1, 4]), vocab=st.sampled_from([7, 32]),
       mode=st.sampled_from(["normal", "grid", "extreme", "neg_inf"]),
       np_seed=st.integers(0, 2**31 - 1))
def test_process_logits_matches_reference(data, num_rows, vocab, mode, np_seed):
    rng = np.random.default_rng(np_seed)
    params = [data.draw(param_strategy(vocab)) for _ in range(num_rows)]
    logits = make_logits(rng, (num_rows, vocab), mode)
    prompts = [list(rng.integers(0, vocab, rng.integers(0, 6))) for _ in params]
    outputs = [list(rng.integers(0, vocab, rng.integers(0, 6))) for _ in params]
    batch = pack_sampling(params, num_rows, seeds=[0] * num_rows, steps=[0] * num_rows)
    ids, is_output = pack_penalty_tokens(prompts, outputs, num_rows, length=16)
    flags = batch.static_flags()
    penalised, processed = device_process(
        logits, batch, ids, is_output, *pack_logit_bias(params, num_rows),
        needs_top_k_p_min_p=flags.needs_top_k_p_min_p, needs_penalties=flags.needs_penalties)
    penalised, processed = np.asarray(penalised), np.asarray(processed)

    for r, p in enumerate(params):
        p = as_float32(p)  # the parameters travel to the device as float32
        ref = ref_penalise(logits[r], p, prompts[r], outputs[r])
        scale = 1 + np.max(np.abs(ref[np.isfinite(ref)]))
        np.testing.assert_allclose(penalised[r], ref, rtol=1e-5, atol=1e-6 * scale)
        if p.greedy:
            np.testing.assert_array_equal(processed[r], penalised[r])
            continue
        kept = set(np.flatnonzero(processed[r] > -np.inf))
        kept -= {i for i in kept if ref[i] == -np.inf}  # -inf tokens can never be drawn
        scaled = ref / p.temperature
        finite = np.isfinite(processed[r])
        np.testing.assert_allclose(processed[r][finite], scaled[finite], rtol=1e-5,
                                   atol=1e-6 * scale / p.temperature)
        assert np.all(processed[r][~finite] == -np.inf)
        if not flags.needs_top_k_p_min_p:
            continue
        must_keep = {i for i in ref_keep(ref, p, slack=-1) if ref[i] > -np.inf}
        may_keep = ref_keep(ref, p, slack=+1)
        assert must_keep <= kept <= may_keep, (r, p, sorted(must_keep), sorted(kept),
                                               sorted(may_keep))
        assert int(np.argmax(processed[r])) in kept


@pytest.mark.parametrize("params, kept", [
    # ties at the top-k boundary are all kept
    (SamplingParams(top_k=2), {1, 2, 3}),
    (SamplingParams(top_k=1), {3}),
    (SamplingParams(top_k=3), {1, 2, 3}),
    # top_p: probs of [1,2,2,3] are .072,.197,.197,.534; the tied pair goes in together
    (SamplingParams(top_p=0.5), {3}),
    (SamplingParams(top_p=0.6), {1, 2, 3}),
    (SamplingParams(top_p=0.75), {1, 2, 3}),
    (SamplingParams(top_p=0.95), {0, 1, 2, 3}),
    (SamplingParams(top_p=1.0), {0, 1, 2, 3}),
    # min_p 0.3: e^-1 = .37 of p_max survives, e^-2 = .14 does not
    (SamplingParams(min_p=0.3), {1, 2, 3}),
    (SamplingParams(min_p=1.0), {3}),
    # top-p runs on the top-k survivors renormalised: there p(3) = .576 >= .55
    (SamplingParams(top_k=2, top_p=0.55), {3}),
    (SamplingParams(top_k=2, top_p=0.6), {1, 2, 3}),
    (SamplingParams(top_k=1, top_p=0.01, min_p=0.9), {3}),
])
def test_truncation_exact_small_cases(params, kept):
    logits = np.array([[1.0, 2.0, 2.0, 3.0]], np.float32)
    batch = pack_sampling([params], 1, [0], [0])
    out = np.asarray(process_logits(jnp.asarray(logits), batch, needs_top_k_p_min_p=True,
                                    needs_penalties=False))
    assert set(np.flatnonzero(out[0] > -np.inf)) == kept
    assert ref_keep(logits[0].astype(np.float64), params) == kept


def test_penalties_exact_small_case():
    logits = np.array([[2.0, -2.0, 1.0, 0.5, 3.0]], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25)
    ids, is_output = pack_penalty_tokens([[0, 1]], [[2, 2, 1]], 1)
    out = sample(jnp.asarray(logits), pack_sampling([p], 1, [0], [0]),
                 needs_top_k_p_min_p=False, needs_penalties=True, num_logprobs=0,
                 penalty_ids=ids, penalty_is_output=is_output)
    # 0: 2/2=1; 1: -2*2 -.25 -.5 = -4.75; 2: 1/2 - .5 - .5 = -.5; 3: .5; 4: 3 (unseen)
    expected = np.array([1.0, -4.75, -0.5, 0.5, 3.0])
    np.testing.assert_allclose(ref_penalise(logits[0], p, [0, 1], [2, 2, 1]), expected)
    assert int(out.tokens[0]) == 4


def test_build_penalty_counts_matches_bincount():
    rng = np.random.default_rng(0)
    vocab = 23
    prompts = [list(rng.integers(0, vocab, n)) for n in (0, 5, 17)]
    outputs = [list(rng.integers(0, vocab, n)) for n in (9, 0, 30)]
    ids, is_output = pack_penalty_tokens(prompts, outputs, num_rows=4, length=64)
    assert ids.shape == (4, 64) and ids[3].tolist() == [-1] * 64
    counts, prompt_mask = build_penalty_counts(jnp.asarray(ids), jnp.asarray(is_output), vocab)
    for r in range(4):
        out = outputs[r] if r < 3 else []
        prompt = prompts[r] if r < 3 else []
        np.testing.assert_array_equal(counts[r], np.bincount(out, minlength=vocab))
        np.testing.assert_array_equal(prompt_mask[r], np.bincount(prompt, minlength=vocab) > 0)


# ----------------------------------------------------------------------------- logit bias


def test_logit_bias_moves_greedy_tokens_as_numpy_says_and_keeps_raw_logprobs():
    rng = np.random.default_rng(11)
    rows, vocab = 8, 40
    logits = make_logits(rng, (rows, vocab), "normal")
    row_biases = [{int(t): float(rng.uniform(-8, 8)) for t in rng.choice(vocab, 5, replace=False)} for _ in range(6)]
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias=bias) for bias in row_biases]
    params += [SamplingParams(temperature=0.0, logprobs=3), None]
    batch = pack_sampling(params, rows, list(range(rows)), [0] * rows)
    bias_ids, biases = pack_logit_bias(params, rows)
    out = sample_jit(logits, batch, **flags_of(batch), logit_bias_ids=bias_ids, logit_bias=biases)
    dense = np.stack([ref_bias(p, vocab) if p is not None else np.zeros(vocab) for p in params])
    np.testing.assert_array_equal(out.tokens, np.argmax(logits + dense, axis=-1))
    assert np.any(np.argmax(logits + dense, axis=-1) != np.argmax(logits, axis=-1))  # the biases moved tokens
    raw = np_log_softmax(logits)  # logprobs: the model's, whatever the bias
    np.testing.assert_allclose(out.logprob, raw[np.arange(rows), np.asarray(out.tokens)], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1)[:, :3])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bias_of_100_forces_a_token_and_minus_100_bans_one(temperature):
    rng = np.random.default_rng(12)
    rows, vocab = 64, 50
    logits = make_logits(rng, (rows, vocab), "normal")
    favourite = np.argmax(logits, axis=-1)
    forced = [SamplingParams(temperature=temperature, logit_bias={7: 100}) for _ in range(rows)]
    banned = [SamplingParams(temperature=temperature, logit_bias={int(t): -100}) for t in favourite]
    for params in (forced, banned):
        batch = pack_sampling(params, rows, list(range(rows)), [3] * rows)
        bias_ids, biases = pack_logit_bias(params, rows)
        tokens = np.asarray(sample_jit(logits, batch, **flags_of(batch), logit_bias_ids=bias_ids,
                                       logit_bias=biases).tokens)
        if params is forced:
            assert np.all(tokens == 7), tokens
        else:
            assert not np.any(tokens == favourite), tokens
            if temperature == 0.0:  # the second best instead
                np.testing.assert_array_equal(tokens, np.argsort(-logits, axis=-1)[:, 1])


def test_logit_bias_comes_before_the_penalties():
    """OpenAI's / vLLM's order: the bias is added to the raw logit, then the repetition penalty divides
    it. Penalising first would pick another token here."""
    logits = np.array([[2.0, -2.0, 1.0, 0.5, 2.5]], np.float32)
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 2.0, 1: 3.0})
    ids, is_output = pack_penalty_tokens([[0, 1]], [[]], 1)
    batch = pack_sampling([p], 1, [0], [0])
    bias_ids, biases = pack_logit_bias([p], 1)
    out = sample(jnp.asarray(logits), batch, needs_top_k_p_min_p=False, needs_penalties=True, num_logprobs=0,
                 penalty_ids=ids, penalty_is_output=is_output, logit_bias_ids=bias_ids, logit_bias=biases)
    # bias first: 0: (2+2)/2 = 2; 1: (-2+3)/2 = .5; 4: 2.5 (unseen, unbiased) wins.
    # penalties first: 0: 2/2+2 = 3 would win.
    np.testing.assert_allclose(ref_penalise(logits[0], p, [0, 1], []), [2.0, 0.5, 1.0, 0.5, 2.5])
    assert int(out.tokens[0]) == 4
    counts, prompt_mask = build_penalty_counts(jnp.asarray(ids), jnp.asarray(is_output), 5)
    processed = process_logits(jnp.asarray(logits), batch, needs_top_k_p_min_p=False, needs_penalties=True,
                               output_counts=counts, prompt_mask=prompt_mask,
                               logit_bias=build_logit_bias(jnp.asarray(bias_ids), jnp.asarray(biases), 5))
    np.testing.assert_allclose(np.asarray(processed)[0], [2.0, 0.5, 1.0, 0.5, 2.5])


def test_build_logit_bias_ignores_padding_and_adds_repeats():
    ids = np.array([[3, -1, 0, -1], [-1, -1, -1, -1], [2, 2, -1, 4]], np.int32)
    biases = np.array([[1.5, 50.0, -2.0, 7.0], [9.0, 9.0, 9.0, 9.0], [1.0, 0.25, 30.0, -100.0]], np.float32)
    dense = np.asarray(build_logit_bias(jnp.asarray(ids), jnp.asarray(biases), 5))
    np.testing.assert_array_equal(dense, [[-2.0, 0, 0, 1.5, 0], [0] * 5, [0, 0, 1.25, 0, -100.0]])
    ids, biases = pack_logit_bias([SamplingParams(logit_bias={"4": -1, 0: 2}), None], 3)
    assert ids.shape == biases.shape == (3, MAX_LOGIT_BIAS)
    assert ids[0, :3].tolist() == [4, 0, -1] and biases[0, :2].tolist() == [-1.0, 2.0]
    assert (ids[1:] == -1).all() and (biases[1:] == 0).all()


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("mode", ["normal", "grid", "neg_inf"])
def test_greedy_rows_equal_numpy_argmax(mode):
    rng = np.random.default_rng(1)
    logits = make_logits(rng, (8, 50), mode)
    params = [SamplingParams(temperature=0.0, top_k=3 * (i % 2), logprobs=None)
              for i in range(6)] + [None]  # plus one padding row and one empty slot
    batch = pack_sampling(params, 8, seeds=list(range(7)), steps=[3] * 7)
    flags = batch.static_flags()
    assert not flags.needs_top_k_p_min_p
    out = sample_jit(logits, batch, **flags._asdict())
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=-1))  # ties -> lowest


def test_greedy_rows_next_to_sampled_rows():
    rng = np.random.default_rng(2)
    logits = make_logits(rng, (4, 30), "grid")
    params = [SamplingParams(temperature=0), SamplingParams(top_k=5, top_p=0.5),
              SamplingParams(temperature=0, top_k=1, min_p=0.5), SamplingParams(min_p=0.2)]
    batch = pack_sampling(params, 4, seeds=[1, 2, 3, 4], steps=[0, 0, 0, 0])
    out = np.asarray(sample_jit(logits, batch, **flags_of(batch)).tokens)
    assert out[0] == np.argmax(logits[0]) and out[2] == np.argmax(logits[2])


# ----------------------------------------------------------------------------- distribution


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(temperature=0.8), [0, 1, 2, 3, 4, 5]),
    # renormalised top-4 mass before token 3 is .87 < .9
    (SamplingParams(temperature=1.3, top_k=4, top_p=0.9), [0, 1, 2, 3]),
    # mass before token 2 is .82 >= .8
    (SamplingParams(temperature=0.6, top_p=0.8), [0, 1]),
    # p / p_max = e^-1.5 = .22 >= .2 for token 3, e^-2 = .14 for token 4
    (SamplingParams(temperature=1.0, min_p=0.2), [0, 1, 2, 3]),
])
def test_empirical_distribution(params, keep):
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)
    assert ref_keep(logits.astype(np.float64), params) == set(keep)
    weights = np.exp(logits[keep] / params.temperature)
    expected_probs = weights / weights.sum()

    rows, steps = 4096, 5
    batch_logits = np.broadcast_to(logits, (rows, len(logits)))
    counts = np.zeros(len(logits))
    for step in range(steps):  # fixed seeds: the test is deterministic
        batch = pack_sampling([params] * rows, rows, seeds=list(range(rows)),
                              steps=[step] * rows)
        tokens = np.asarray(sample_jit(batch_logits, batch, **flags_of(batch)).tokens)
        counts += np.bincount(tokens, minlength=len(logits))
    n = rows * steps
    assert counts.sum() == n and counts[[i for i in range(6) if i not in keep]].sum() == 0
    expected = expected_probs * n
    chi2 = float(np.sum((counts[keep] - expected) ** 2 / expected))
    assert chi2 < 25.0, (chi2, counts[keep], expected)  # <= 5 dof: p ~ 1e-4


# ----------------------------------------------------------------------------- seeds


def test_seed_reproducible_alone_or_in_batch():
    rng = np.random.default_rng(3)
    vocab = 64
    target = SamplingParams(temperature=1.1)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, repetition_penalty=1.5),
              SamplingParams(top_p=0.3, min_p=0.1, logprobs=4), None,
              SamplingParams(temperature=2.0, presence_penalty=1.0),
              SamplingParams(frequency_penalty=-1.0), SamplingParams(top_k=1)]
    for seed in [0, 7, 2**31 + 5, 2**32 - 1, -3]:
        for step in [0, 1, 1000]:
            logits = rng.standard_normal((8, vocab)).astype(np.float32)
            alone = pack_sampling([target], 1, [seed], [step])
            token_alone = int(sample_jit(logits[5:6], alone, **flags_of(alone)).tokens[0])

            params = others[:5] + [target] + others[5:]
            seeds = list(rng.integers(0, 2**32, 8))
            seeds[5] = seed
            batch = pack_sampling(params, 8, seeds, [int(s) for s in rng.integers(0, 99, 8)])
            batch = batch._replace(step=batch.step.copy())
            batch.step[5] = step
            ids, is_output = pack_penalty_tokens([[1, 2]] * 8, [[3]] * 8, 8)
            out = sample_jit(logits, batch, **flags_of(batch), penalty_ids=ids,
                             penalty_is_output=is_output)
            assert int(out.tokens[5]) == token_alone

            # the same draw, derived on the host from the documented key
            key = jax.random.fold_in(jax.random.PRNGKey(seed % 2**32), step)
            gumbel = np.asarray(jax.random.gumbel(key, (vocab,), jnp.float32))
            assert token_alone == int(np.argmax(logits[5] / np.float32(1.1) + gumbel))


def test_different_steps_and_seeds_give_different_draws():
    logits = np.zeros((1, 1000), np.float32)
    draws = set()
    for step in range(20):
        batch = pack_sampling([SamplingParams()], 1, [42], [step])
        draws.add(int(sample_jit(logits, batch, **flags_of(batch)).tokens[0]))
    assert len(draws) >= 18
    batch = pack_sampling([SamplingParams()] * 20, 20, list(range(20)), [0] * 20)
    assert len(set(np.asarray(sample_jit(np.zeros((20, 1000), np.float32), batch,
                                         **flags_of(batch)).tokens))) >= 18


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((4, 100)) * 3).astype(np.float32)
    params = [SamplingParams(logprobs=0), SamplingParams(temperature=0.5, logprobs=7,
                                                         repetition_penalty=2.0, top_k=3),
              SamplingParams(temperature=0, logprobs=3), None]
    batch = pack_sampling(params, 4, [1, 2, 3, 0], [0, 0, 0, 0])
    flags = batch.static_flags()
    assert flags.num_logprobs == 7
    ids, is_output = pack_penalty_tokens([[5, 6]] * 3, [[7]] * 3, 4)
    out = sample_jit(logits, batch, **flags._asdict(), penalty_ids=ids,
                     penalty_is_output=is_output)
    ref = np_log_softmax(logits)
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprob, ref[np.arange(4), tokens], atol=1e-5)
    assert out.top_ids.shape == (4, 7) and out.top_logprobs.shape == (4, 7)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-ref, axis=-1)[:, :7])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, axis=-1)[:, ::-1][:, :7],
                               atol=1e-5)

    none = pack_sampling([SamplingParams()], 1, [0], [0])
    assert none.static_flags().num_logprobs == 0
    out = sample_jit(logits[:1], none, **flags_of(none))
    assert out.top_ids is None and out.top_logprobs is None


# ----------------------------------------------------------------------------- compile behaviour


def test_one_compile_for_many_parameter_values():
    traces = 0

    def counted(*args, **kwargs):
        nonlocal traces
        traces += 1
        return sample(*args, **kwargs)

    jitted = jax.jit(counted, static_argnames=(
        "needs_top_k_p_min_p", "needs_penalties", "num_logprobs", "needs_mask"))
    rng = np.random.default_rng(5)
    seen_flags = set()
    for _ in range(12):
        params = [SamplingParams(temperature=float(rng.uniform(0.1, 2)),
                                 top_k=int(rng.integers(0, 50)),
                                 top_p=float(rng.uniform(0.1, 1)),
                                 min_p=float(rng.uniform(0, 0.5)),
                                 repetition_penalty=float(rng.uniform(0.5, 2)),
                                 presence_penalty=float(rng.uniform(-2, 2)),
                                 frequency_penalty=float(rng.uniform(-2, 2)),
                                 logprobs=int(rng.integers(0, 4)))
                  for _ in range(3)] + [SamplingParams(top_k=3, repetition_penalty=1.2,
                                                       logprobs=3)]
        batch = pack_sampling(params, 4, list(rng.integers(0, 2**32, 4)),
                              list(rng.integers(0, 100, 4)))
        ids, is_output = pack_penalty_tokens([[1, 2, 3]] * 4, [[int(rng.integers(50))]] * 4, 4)
        flags = batch.static_flags()
        seen_flags.add(flags)
        jitted(rng.standard_normal((4, 50)).astype(np.float32), batch, **flags._asdict(),
               penalty_ids=ids, penalty_is_output=is_output)
    assert len(seen_flags) == 1
    assert traces == 1


def primitives(fn, *args):
    """Names of the primitives applied in fn's jaxpr (nested jaxprs included)."""
    return set(re.findall(r"= ([a-z][\w-]*)", str(jax.make_jaxpr(fn)(*args))))


def test_plain_paths_compile_without_sort():
    logits = jnp.zeros((2, 16), jnp.float32)

    def prims(params):
        batch = pack_sampling([params] * 2, 2, [1, 2], [0, 0])
        return primitives(functools.partial(sample, **flags_of(batch)), logits, batch)

    plain = prims(SamplingParams(temperature=0.7))
    assert "random_bits" in plain and "sort" not in plain
    assert not any(p.startswith("scatter") for p in plain)
    greedy = prims(SamplingParams(temperature=0))
    assert "sort" not in greedy  # greedy draws Gumbel noise too (one compiled variant), but never sorts
    assert "sort" in prims(SamplingParams(top_p=0.5))


# ----------------------------------------------------------------------------- host side


def test_pack_sampling_pads_with_greedy_defaults():
    params = [SamplingParams(temperature=0.5, top_k=-1, seed=9), None]
    batch = pack_sampling(params, 4, seeds=[-1, 5], steps=[3, 4])
    assert batch.temperature.tolist() == [0.5, 0.0, 0.0, 0.0]
    assert batch.top_k.tolist() == [0, 0, 0, 0]
    assert batch.seed.dtype == np.uint32 and batch.seed.tolist() == [2**32 - 1, 0, 0, 0]
    assert batch.step.tolist() == [3, 0, 0, 0]
    assert batch.logprobs.tolist() == [-1] * 4
    assert all(a.shape == (4,) for a in batch)
    assert batch.static_flags() == (False, False, 0, False)
    hash(batch.static_flags())
    with pytest.raises(ValueError):
        pack_sampling(params, 1, [0, 0], [0, 0])


def test_truncation_flag_ignores_greedy_rows():
    batch = pack_sampling([SamplingParams(temperature=0, top_k=5), SamplingParams()], 2,
                          [0, 0], [0, 0])
    assert not batch.static_flags().needs_top_k_p_min_p
    batch = pack_sampling([SamplingParams(temperature=0, repetition_penalty=1.1)], 1, [0], [0])
    assert batch.static_flags().needs_penalties


@pytest.mark.parametrize("field_name, value", [
    ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 101), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -3.0),
    ("logprobs", -1), ("logprobs", 21),
    ("stop_token_ids", [5, 100]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("stop", ["ok", 3]), ("stop", 5),
    ("seed", 1.5), ("seed", "42"),
    ("logit_bias", [1, 2]), ("logit_bias", {"abc": 1}), ("logit_bias", {"1.5": 1}), ("logit_bias", {"100": 1}),
    ("logit_bias", {"-1": 1}), ("logit_bias", {"1": 100.5}), ("logit_bias", {"1": -101}), ("logit_bias", {"1": "2"}),
    ("logit_bias", {"1": True}), ("logit_bias", {"1": float("nan")}), ("logit_bias", {"1": 1, 1: 2}),
    ("logit_bias", {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.5), ("min_tokens", None),
])
def test_validate_rejects(field_name, value):
    params = SamplingParams(**{field_name: value})
    with pytest.raises(ValueError, match=field_name):
        params.validate(vocab_size=100)
    with pytest.raises(ValueError, match=field_name):
        SamplingParams.from_dict({field_name: value}, vocab_size=100)


def test_validate_accepts_edges():
    for kwargs in [dict(), dict(temperature=0), dict(top_p=1.0, top_k=-1), dict(top_k=100),
                   dict(min_p=1.0), dict(presence_penalty=-2, frequency_penalty=2),
                   dict(logprobs=0), dict(logprobs=20), dict(seed=-5),
                   dict(stop_token_ids=[0, 99]), dict(logit_bias={}), dict(logit_bias={"0": -100, 99: 100}),
                   dict(logit_bias={str(t): 0.5 for t in range(MAX_LOGIT_BIAS)}, max_tokens=1, min_tokens=1),
                   dict(min_tokens=16), dict(min_tokens=0)]:
        SamplingParams(**kwargs).validate(vocab_size=MAX_LOGIT_BIAS)
    SamplingParams(top_k=10**6).validate()  # no vocab given: no upper bound


def test_validate_message_names_value_and_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5).validate()


def test_logit_bias_is_normalised_and_errors_name_their_field():
    p = SamplingParams(logit_bias={"5": 1, 7: -2.5})
    p.validate(vocab_size=10)
    assert p.logit_bias == {5: 1.0, 7: -2.5} and p.has_penalties  # the penalised sampling variant
    assert SamplingParams.from_dict({"logit_bias": {"3": 4}}).logit_bias == {3: 4.0}
    assert not SamplingParams(logit_bias={}).has_penalties
    with pytest.raises(SamplingParamError, match=r"logit_bias token ids must be in \[0, 10\), got '10'") as e:
        SamplingParams(logit_bias={"10": 1}).validate(vocab_size=10)
    assert e.value.param == "logit_bias"
    with pytest.raises(SamplingParamError, match=r"min_tokens must be in \[0, max_tokens \(4\)\], got 5") as e:
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert e.value.param == "min_tokens"


def test_stop_string_is_normalised():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams.from_dict({"stop": "END"}).stop == ["END"]


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 1, "top_k": 5, "seed": 3, "logprobs": None,
                                  "stop_token_ids": [1, 2], "ignore_eos": True})
    assert p.temperature == 1 and p.top_k == 5 and p.seed == 3 and p.ignore_eos
    with pytest.raises(ValueError, match="unknown.*best_of.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5, "best_of": 2, "top_k": 3})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams.from_dict({"ignore_eos": 1})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": "hot"})


def test_penalty_history_lengths_are_few_and_cover_every_history():
    from jtp.core.sampling_params import penalty_len, penalty_lengths

    assert penalty_lengths(40960) == (256, 1024, 4096, 16384, 40960)
    assert penalty_lengths(128) == (128,) and penalty_lengths(256) == (256,)
    for max_len in (100, 256, 1000, 4096, 40960):
        lengths = penalty_lengths(max_len)
        for longest in range(0, max_len + 1, 7):
            n = penalty_len(longest, max_len)
            assert n in lengths and n >= longest
            assert all(m < longest for m in lengths if m < n)  # the shortest that holds it
