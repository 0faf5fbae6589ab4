"""Speculative decoding with n-gram (prompt-lookup) drafts, through the engine's real step.

Verification samples every position with the key of its own generation step and accepts drafts
while the target sampled them too, so with speculation on the output equals the output with it
off, token for token and logprob for logprob: greedy and seeded sampling, for Qwen3 at tp 1 and 2,
Qwen3-MoE and the hybrids, in staggered mixed batches where some rows speculate and some cannot (penalties,
opt-out). The drafts are counted: some are accepted and some rejected part-way, and the KV pool
shrinks back exactly to the accepted tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_engine import run_staggered

from jtp.config.engine_args import EngineArgs
from jtp.config.speculative import SpeculativeConfig, propose_ngram
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine
from jtp.errors import ConfigError

KW = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=160, block_size=4, max_num_seqs=8,
          max_num_batched_tokens=64, max_model_len=160)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


# ----------------------------------------------------------------------------- drafts and config


def test_propose_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2, max_n=3, min_n=1) == [7, 5]  # latest "1 2 3"
    assert propose_ngram([4, 5, 6, 4, 8, 5, 6], k=3, max_n=3, min_n=1) == [4, 8, 5]  # "5 6" beats "6"
    assert propose_ngram([4, 5, 6, 4, 8, 5, 6], k=3, max_n=3, min_n=3) == []  # no 3-gram repeats
    assert propose_ngram([7, 1, 7], k=5, max_n=2, min_n=1) == [1, 7]  # fewer than k left after the match
    assert propose_ngram([1, 2, 3], k=4, max_n=3, min_n=1) == []
    assert propose_ngram([3, 3, 3, 3], k=2, max_n=2, min_n=1) == [3]  # the match must leave a token after it


@pytest.mark.parametrize("seed", range(20))
def test_propose_ngram_against_brute_force(seed):
    """Drafts continue an earlier occurrence of the longest suffix that occurs, the latest one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 4, rng.integers(2, 40)).tolist()
    k, max_n, min_n = 3, 4, 1
    expected = []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[-n:]]
        if starts:
            expected = tokens[starts[-1] + n : starts[-1] + n + k]
            break
    assert propose_ngram(tokens, k, max_n, min_n) == expected


@pytest.mark.parametrize("spec, message", [
    ('{"method": "ngram", "k": 3}', "unknown key"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "1..16"),
    ('{"method": "eagle"}', "unknown"),
    ('{"num_speculative_tokens": 0}', "1..16"),
    ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "exceeds"),
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
])
def test_bad_speculative_config_is_refused_with_a_reason(spec, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(spec)
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="demo", speculative_config=spec).validate()


# ----------------------------------------------------------------------------- the engine


def workload(vocab: int, seed: int):
    """Prompts that repeat themselves (so n-gram drafts exist) under mixed sampling settings."""
    rng = np.random.default_rng(seed)
    prompts = [(rng.integers(0, vocab, rng.integers(3, 7)).tolist() * 4)[: rng.integers(9, 24)] for _ in range(13)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=11, logprobs=3),
        dict(temperature=0.0, speculate=False),  # opted out
        dict(temperature=0.0, repetition_penalty=1.3),  # penalties: never drafted for
        dict(temperature=1.0, top_k=5, seed=3),
        dict(temperature=0.0, logprobs=2, stop_token_ids=[int(rng.integers(0, vocab))]),
    ]
    params = [SamplingParams(max_tokens=int(rng.integers(6, 30)), ignore_eos=True, **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    return prompts, params


def outputs(completions):
    return [(c.token_ids, c.finish_reason, c.logprobs, c.top_logprobs) for c in completions]


def assert_same(got, expected, atol=2e-5):
    for i, ((tokens, reason, lp, top), (tokens_e, reason_e, lp_e, top_e)) in enumerate(zip(got, expected)):
        assert tokens == tokens_e and reason == reason_e, f"request {i}"
        if lp_e is not None:
            np.testing.assert_allclose(lp, lp_e, atol=atol, err_msg=f"request {i}")
            assert [set(t) for t in top] == [set(t) for t in top_e], f"request {i}"


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import make_hf_checkpoint

    return make_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe-spec"))[1]


@pytest.fixture(scope="module")
def hybrid_paths(hybrid_qwen3_5_dir, tmp_path_factory):
    """Tiny Qwen3.5 (dense FFN) and Qwen3-Next (routed experts) checkpoints."""
    from hf_hybrid import SHALLOW, build_model, save

    return {"qwen3_5_text": hybrid_qwen3_5_dir,
            "qwen3_next": save(build_model("qwen3_next", seed=1, **SHALLOW), tmp_path_factory.mktemp("hybrid-spec"))}


@pytest.fixture(scope="module")
def dense_path():
    from jtp.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def oracle_drafts(sequences: list[list[int]], vocab: int):
    """A stand-in for propose_ngram that drafts the continuation of whichever of `sequences` the
    request's tokens begin, with one draft replaced by a wrong token every other call."""
    calls = iter(range(10**9))

    def propose(tokens, k, max_n, min_n):
        (full,) = [s for s in sequences if s[: len(tokens)] == tokens]
        drafts = full[len(tokens) : len(tokens) + k]
        i = next(calls)
        if i % 2 and drafts:
            j = i // 2 % len(drafts)
            drafts[j] = (drafts[j] + 1) % vocab
        return drafts

    return propose


def checkpoint_path(request, family: str):
    if family in ("qwen3_5_text", "qwen3_next"):
        return request.getfixturevalue("hybrid_paths")[family]
    return request.getfixturevalue("dense_path" if family == "qwen3" else "moe_path")


@pytest.fixture(scope="module")
def reference_runs(request):
    """family -> (prompts, params, outputs) of the workload without speculation, run once per
    family and shared by its tp cases."""
    runs = {}

    def get(family):
        if family not in runs:
            with Engine.from_args(EngineArgs(model=checkpoint_path(request, family), **KW)) as reference:
                prompts, params = workload(reference.cfg.vocab_size, seed=1)
                runs[family] = prompts, params, outputs(run_staggered(reference, prompts, params))
        return runs[family]

    return get


@pytest.mark.parametrize("family, tp", [("qwen3", 1), ("qwen3", 2), ("qwen3_moe", 1), ("qwen3_5_text", 1),
                                        ("qwen3_next", 2)])
def test_speculation_keeps_every_output(request, reference_runs, family, tp):
    """Hybrids too: a rejected draft rolls the Gated DeltaNet state back (counted), and the next
    tokens still equal the non-speculative run's. (One tp per hybrid: each tp compiles a few dozen
    step variants, and the state slots are per row, so tp does not touch the rollback.)"""
    path = checkpoint_path(request, family)
    prompts, params, expected = reference_runs(family)

    engine = Engine.from_args(EngineArgs(model=path, tensor_parallel_size=tp, **KW, speculative_config=NGRAM))
    if engine.states is not None:
        # Tiny random hybrids never repeat themselves, so every n-gram draft would be rejected at
        # once: draft the reference's own next tokens instead, with one made wrong half the time,
        # so rows accept all, some or none of their drafts.
        monkeypatch = request.getfixturevalue("monkeypatch")
        full = [p + list(e[0]) for p, e in zip(prompts, expected)]
        monkeypatch.setattr("jtp.core.scheduler.propose_ngram", oracle_drafts(full, engine.cfg.vocab_size))
    pool_sizes = []
    original_step = engine.step

    def step():  # the pool holds exactly each request's computed tokens, plus the drafts in flight
        events = original_step()
        in_flight = {row.request.id: len(row.drafts) for row in engine.inflight_rows}
        for r in engine.scheduler.running:
            pool_sizes.append((engine.pool.num_tokens(r.id), r.num_computed + in_flight.get(r.id, 0)))
        return events

    engine.step = step
    verified = []  # (drafts, accepted) of each verified row of a running request
    accepted = engine.scheduler.accepted

    def spy(row, num_accepted):
        if row.request.status.value == "running":
            verified.append((len(row.drafts), num_accepted))
        return accepted(row, num_accepted)

    engine.scheduler.accepted = spy
    # Hybrids: a verify row runs the DeltaNet chunk-wise where a decode row steps it token by
    # token; the fp32 sums differ in order, by ~1e-6 relative (the tokens are the same).
    assert_same(outputs(run_staggered(engine, prompts, params)), expected, 2e-5 if engine.states is None else 1e-4)
    stats = engine.stats()
    # Drafts were made, some accepted and some rejected part-way (the rollback ran).
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, stats
    assert stats.spec_decode_num_drafts > 0 and 1 < stats.spec_decode_mean_accepted_length
    assert pool_sizes and all(pool == expected for pool, expected in pool_sizes)
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    engine.pool.check_invariants()
    if engine.states is None:
        assert stats.spec_decode_num_state_rollbacks == 0
    else:  # a rollback for each row that rejected a draft (every row that did not accept them all)
        rejected_rows = sum(n < drafts for drafts, n in verified)
        assert stats.spec_decode_num_state_rollbacks == rejected_rows > 0, stats
        engine.states.check_invariants()
        held = [s for s in range(engine.states.num_slots) if engine.states.refs(s)]
        assert not held and engine.states.num_reserved == 0, "a state slot outlived its request"
    engine.close()


def test_rows_that_cannot_speculate_never_draft(dense_path):
    """Opted-out and penalised requests run as plain decode rows, and a request's last token is
    never drafted (max_tokens bounds the drafts)."""
    engine = Engine.from_args(EngineArgs(model=dense_path, **KW, speculative_config=NGRAM))
    seen = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        rows = schedule(*args, **kwargs)
        seen.extend((row.request.params, row.request.num_generated, len(row.drafts)) for row in rows)
        return rows

    engine.scheduler.schedule = spy
    start = [5, 6, 7, 8]  # then the model's own continuation and `start` again: drafts to be had
    prompt = start + engine.generate([start], SamplingParams(max_tokens=8, temperature=0))[0].token_ids + start
    engine.generate([prompt] * 3, [SamplingParams(max_tokens=12, temperature=0, speculate=False),
                                   SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.5),
                                   SamplingParams(max_tokens=12, temperature=0)])
    assert all(drafts == 0 for params, _, drafts in seen if not params.speculate or params.has_penalties)
    assert any(drafts for *_, drafts in seen)
    assert all(generated + 1 + drafts <= params.max_tokens for params, generated, drafts in seen if drafts)
    engine.close()


# ----------------------------------------------------------------------------- the server


def test_server_speculates_and_reports_it(dense_path):
    """`jtp serve --speculative-config`, through the openai client: a request that opts out
    (`speculate: false`) and one that speculates return the same text, and /metrics counts the
    drafts (vLLM's spec_decode names)."""
    import re

    import httpx
    import openai
    from test_server import start_serve

    proc, url, log = start_serve(1, "--speculative-config", NGRAM)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        # A tokenizer for the prompt only: the model's own continuation, repeated
        engine = Engine.from_args(EngineArgs(model=dense_path, **(KW | dict(skip_tokenizer_init=False))))
        start = engine.tokenizer.encode("Once upon a time")
        again = start + engine.generate([start], SamplingParams(max_tokens=12, temperature=0))[0].token_ids + start
        engine.close()
        prompt = engine.tokenizer.decode(again)

        def complete(**extra):
            return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=16,
                                             temperature=0, extra_body=extra).choices[0].text

        plain, speculated = complete(speculate=False), complete()
        assert speculated == plain
        metrics = httpx.get(url + "/metrics").text
        counts = {name: float(v) for name, v in re.findall(r"^(jtp:spec_decode_\w+?)(?:_total)?\{[^}]*\} (\S+)$",
                                                            metrics, re.M)}
        assert counts["jtp:spec_decode_num_draft_tokens"] > 0 and counts["jtp:spec_decode_num_drafts"] > 0, counts
        assert counts["jtp:spec_decode_num_accepted_tokens"] <= counts["jtp:spec_decode_num_draft_tokens"]
        assert 0 <= counts["jtp:spec_decode_acceptance_rate"] <= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_warmup_compiles_the_verify_steps(dense_path):
    """After warm-up a speculating workload (no penalties or logprobs, which compile on first use)
    compiles nothing more: the verify steps' [1 + k, B] sampling shapes are warmed too."""
    small = KW | dict(max_num_batched_tokens=16, max_model_len=64, block_size=16, num_blocks=64)  # few shapes
    engine = Engine.from_args(EngineArgs(model=dense_path, **small, speculative_config=NGRAM))
    engine.warmup()
    before = engine.runner.compilations
    prompts, params = workload(engine.cfg.vocab_size, seed=5)
    plain = [SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, seed=p.seed,
                            ignore_eos=True) for p in params]
    run_staggered(engine, prompts, plain)
    assert engine.stats().spec_decode_num_drafts > 0
    assert engine.runner.compilations == before
    engine.close()


def test_seeded_sampling_keeps_its_distribution(dense_path):
    """Speculation must not change what sampling draws from. 240 seeded requests with speculation
    on against 240 other seeds with it off, at temperature 3 over the top 4 tokens: for each of the
    tokens after the first (the ones drafts stand in for), a chi-square two-sample test of their
    counts. Fixed seeds, so the verdict is the same on every run; accepted drafts are counted so
    the verify path is known to have drawn some of these tokens."""
    from scipy.stats import chi2_contingency

    small = KW | dict(max_num_batched_tokens=128, max_num_seqs=16, block_size=16, num_blocks=128)
    n, steps, T = 240, 4, 3.0
    engine = Engine.from_args(EngineArgs(model=dense_path, **small))
    # A text, what the model samples after it, and the text again: prompt lookup then drafts what
    # followed the text the first time, which the model often samples again.
    greedy = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    text = [5, 6, 7, 8] + [t for t in greedy if t not in engine.eos_ids]
    after = engine.generate([text], SamplingParams(max_tokens=6, temperature=T, top_k=4, seed=0, ignore_eos=True))[0].token_ids
    prompt = text + after + text
    engine.close()

    def sample(seeds, speculative):
        engine = Engine.from_args(EngineArgs(model=dense_path, **small, speculative_config=NGRAM if speculative else None))
        params = [SamplingParams(max_tokens=steps, temperature=T, top_k=4, seed=s, ignore_eos=True) for s in seeds]
        tokens = np.array([c.token_ids for c in engine.generate([prompt] * n, params)])
        stats = engine.stats()
        engine.close()
        return tokens, stats

    with_spec, stats = sample(range(n), True)
    without, _ = sample(range(n, 2 * n), False)
    assert stats.spec_decode_num_accepted_tokens > n // 4, stats  # many tokens came through verification
    for j in range(1, steps):
        values = sorted(set(with_spec[:, j]) | set(without[:, j]))
        table = [[int((col == v).sum()) for v in values] for col in (with_spec[:, j], without[:, j])]
        p = chi2_contingency(table).pvalue
        print(f"token {j}: p = {p:.3f}, counts {table}")
        assert p > 1e-3, f"token {j}: speculation changed its distribution (p = {p:.2g}, counts {table})"
