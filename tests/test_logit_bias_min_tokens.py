"""logit_bias and min_tokens through the engine's real step and a live server.

The model is the demo checkpoint (a tiny trained model: greedy, it ends its answers with an
end-of-sequence token after a few words). Each expectation comes from a run without the feature:
a bias of +100 makes greedy decoding repeat one token and -100 removes the token greedy picked; a
biased row beside unbiased ones leaves their tokens as their solo runs give them. min_tokens keeps
the end-of-sequence token, a stop token id and a stop string that an unconstrained run hits early
from ending the output before it has min_tokens tokens, and lets them end it after; its rows' masks
are the grammar's (or ones) less the stop tokens, bit for bit as numpy unpacks them. Multi-step
decode and n-gram speculation give the tokens of one step per dispatch and no speculation, and
never run a row short of min_tokens past it under one mask. Through the real `openai` client,
logit_bias and min_tokens work on both endpoints, and bad values are 400s naming their field.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from loopback import serving

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from jtp.core.scheduler import Request, ScheduledRow, Status
from jtp.engine.engine import Engine
from jtp.engine.structured_output import token_masks
from jtp.entrypoints.server import build_app
from jtp.errors import RequestError

ARGS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, block_size=16,
            num_blocks=128, warmup=False)
PROMPTS = ["Tell me about a person:", "Once upon a time", "The cat"]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def engine(demo_dir):
    with Engine.from_args(EngineArgs(model=str(demo_dir), **ARGS)) as eng:
        yield eng


def tokens(engine, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    (c,) = engine.generate([engine.tokenizer.encode(prompt)], params)
    return c.token_ids, c.finish_reason


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **{"max_tokens": 16, **kwargs})


# ----------------------------------------------------------------------------- logit_bias


def test_a_bias_of_100_forces_its_token_every_step(engine):
    free, _ = tokens(engine, PROMPTS[0], greedy(ignore_eos=True))
    forced = next(t for t in range(300, 400) if t not in free)
    got, reason = tokens(engine, PROMPTS[0], greedy(ignore_eos=True, logit_bias={str(forced): 100}))
    assert got == [forced] * 16 and reason == "length"


def test_a_bias_of_minus_100_bans_its_token(engine):
    for prompt in PROMPTS:
        free, _ = tokens(engine, prompt, greedy(ignore_eos=True))
        banned = free[0]
        got, _ = tokens(engine, prompt, greedy(ignore_eos=True, logit_bias={banned: -100}))
        assert banned not in got and got != free, (prompt, free, got)
        # Sampled rows too, whatever their seed.
        params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, logit_bias={banned: -100}) for s in range(6)]
        ids = engine.tokenizer.encode(prompt)
        assert all(banned not in c.token_ids for c in engine.generate([ids] * 6, params))


def test_a_biased_row_leaves_its_neighbours_tokens_alone(engine):
    plain = [greedy(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.8, seed=7),
             SamplingParams(max_tokens=20, temperature=0.9, seed=3)]
    ids = engine.tokenizer.encode(PROMPTS[1])
    solo = [engine.generate([ids], [p])[0].token_ids for p in plain]
    biased = SamplingParams(max_tokens=20, temperature=0.9, seed=3, logit_bias={str(t): 5.0 for t in range(200, 260)})
    mixed = [c.token_ids for c in engine.generate([ids] * 3, [plain[0], biased, plain[1]])]
    assert [mixed[0], mixed[2]] == solo[:2]
    assert mixed[1] != solo[2]  # the bias changed the biased row's own tokens


def test_bad_logit_bias_and_min_tokens_are_request_errors_naming_the_field(engine):
    vocab = engine.cfg.vocab_size
    for bias in ({str(vocab): 1}, {"1": 100.5}, {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}, {"x": 1}):
        with pytest.raises(RequestError, match="logit_bias") as e:
            engine.submit([1, 2], SamplingParams(logit_bias=bias))
        assert e.value.param == "logit_bias"
    with pytest.raises(RequestError, match="min_tokens") as e:
        engine.submit([1, 2], SamplingParams(max_tokens=4, min_tokens=5))
    assert e.value.param == "min_tokens"


# ----------------------------------------------------------------------------- min_tokens


def test_min_tokens_keeps_eos_and_stop_tokens_back_then_lets_them_end(engine):
    free, reason = tokens(engine, PROMPTS[0], greedy(max_tokens=40))
    assert reason == "stop" and len(free) < 12 and free[-1] in engine.eos_ids  # greedy ends early on its own
    got, reason = tokens(engine, PROMPTS[0], greedy(max_tokens=40, min_tokens=12))
    assert len(got) >= 12 and not engine.eos_ids & set(got[:12]) and got[: len(free) - 1] == free[:-1]
    assert reason == "length" or got[-1] in engine.eos_ids

    stop = free[1]  # a stop token id greedy decoding hits at once
    early, reason = tokens(engine, PROMPTS[0], greedy(ignore_eos=True, stop_token_ids=[stop]))
    assert early == free[:2] and reason == "stop"
    got, _ = tokens(engine, PROMPTS[0], greedy(ignore_eos=True, stop_token_ids=[stop], min_tokens=10))
    assert len(got) >= 10 and stop not in got[:10]

    # Forced by a bias, the stop token is held back for exactly min_tokens tokens, then ends the output.
    for min_tokens in (0, 1, 5):
        got, reason = tokens(engine, PROMPTS[0], greedy(ignore_eos=True, stop_token_ids=[stop], min_tokens=min_tokens,
                                                        logit_bias={stop: 100}))
        assert len(got) == min_tokens + 1 and got[-1] == stop and stop not in got[:-1] and reason == "stop"
    eos = min(engine.eos_ids)
    got, reason = tokens(engine, PROMPTS[0], greedy(min_tokens=4, logit_bias={eos: 100}))
    assert len(got) == 5 and got[-1] == eos and reason == "stop"


def test_min_tokens_holds_stop_strings_back(engine):
    free, _ = tokens(engine, PROMPTS[0], greedy(ignore_eos=True))
    text = engine.tokenizer.decode(free)
    stop = text[1:4]  # ends the output within its first tokens
    ids = engine.tokenizer.encode(PROMPTS[0])
    (early,) = engine.generate([ids], greedy(ignore_eos=True, stop=[stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) < 8 and early.text == text[:1]
    (held,) = engine.generate([ids], greedy(ignore_eos=True, stop=[stop], min_tokens=8))
    assert len(held.token_ids) >= 8 and held.token_ids == free[: len(held.token_ids)]
    assert stop in held.text  # its early match ended nothing


def allowed(mask_row, vocab: int) -> np.ndarray:
    """bool[vocab] from a row of 32-token words, bit t % 32 of word t // 32 (numpy's own unpacking)."""
    return np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def test_rows_short_of_min_tokens_lose_their_stop_tokens_from_the_grammars_mask_or_from_ones(engine):
    vocab, eos = engine.cfg.vocab_size, set(engine.eos_ids)
    stops = frozenset(eos | {5})

    def row(min_tokens: int, generated: int, spec: dict | None = None) -> ScheduledRow:
        req = Request("r", [1, 2, 3], SamplingParams(max_tokens=16, min_tokens=min_tokens), 0, stops)
        req.output_ids, req.status = [300] * generated, Status.RUNNING
        if spec is not None:  # a grammar that has read one letter: it may end there
            req.grammar = engine.grammars.matcher(spec)
            assert req.grammar.consume_token(engine.tokenizer.encode("a")[-1])
        return ScheduledRow(req, 2 + generated, 1)

    rows = [row(5, 1, {"regex": "[a-z]+"}), row(3, 0), row(3, 3), row(0, 1, {"regex": "[a-z]+"})]
    masks = token_masks(engine.grammars, rows, engine.input_batch.mask_words)
    grammar = allowed(engine.grammars.fill([(rows[0].request.grammar, 0)], 1)[0], vocab)
    assert grammar[sorted(eos)].all() and 0.01 < grammar.mean() < 0.9  # the grammar allows some letters and eos
    stop = np.isin(np.arange(vocab), sorted(stops))
    np.testing.assert_array_equal(allowed(masks[0], vocab), grammar & ~stop)  # short, under a grammar
    np.testing.assert_array_equal(allowed(masks[1], vocab), ~stop)  # short
    assert allowed(masks[2], vocab).all()  # has its min_tokens: every token
    np.testing.assert_array_equal(allowed(masks[3], vocab), grammar)  # no min_tokens: the grammar's mask
    assert token_masks(engine.grammars, [rows[2]], engine.input_batch.mask_words) is None


def workload(engine):
    """Greedy and seeded requests whose min_tokens fall before, at and after where they would end."""
    params = [SamplingParams(max_tokens=24, temperature=t, seed=s, min_tokens=m)
              for t, s in ((0.0, None), (0.8, 11)) for m in (0, 4, 8, 9, 12, 20)]
    ids = [engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(len(params))]
    return ids, params


@pytest.fixture(scope="module")
def one_step_outputs(engine):
    ids, params = workload(engine)
    return [(c.token_ids, c.finish_reason) for c in engine.generate(ids, params)]


def record_schedule(engine) -> list:
    """Each scheduled row that samples, as it is scheduled: (the output index of its first sampled
    token, how many tokens it samples, its request's min_tokens)."""
    seen = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        rows = schedule(*args, **kwargs)
        for row in rows:
            req = row.request
            if row.picks_next_token:
                seen.append((req.num_generated, len(row.drafts) + row.steps, req.params.min_tokens))
        return rows

    engine.scheduler.schedule = spy
    return seen


@pytest.mark.parametrize("kind", ["multi-step", "ngram"])
def test_min_tokens_with_multi_step_and_speculation(demo_dir, engine, one_step_outputs, kind):
    """One mask serves a row's every step and draft position: a row short of min_tokens never runs past
    it in one dispatch, and the outputs are those of one step per dispatch without speculation."""
    extra = dict(num_scheduler_steps=4) if kind == "multi-step" else dict(speculative_config=NGRAM)
    with Engine.from_args(EngineArgs(model=str(demo_dir), **ARGS, **extra)) as eng:
        seen = record_schedule(eng)
        ids, params = workload(eng)
        got = [(c.token_ids, c.finish_reason) for c in eng.generate(ids, params)]
        assert got == one_step_outputs
        assert any(n > 1 for _, n, m in seen)  # several tokens per dispatch happened...
        assert any(n > 1 for g, n, m in seen if g < m)  # ...for rows short of min_tokens too
        assert all(g + n <= m for g, n, m in seen if g < m)  # never past min_tokens
    for (token_ids, reason), p in zip(got, params):
        assert len(token_ids) >= p.min_tokens and not eng.eos_ids & set(token_ids[: p.min_tokens])


# ----------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def served(engine):
    engine.start()  # the step loop a server runs on (warm-up skipped: ready by hand)
    engine.ready.set()
    with serving(build_app(engine, "demo")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_logit_bias_and_min_tokens_through_the_openai_client(served, engine):
    token = engine.tokenizer.encode(" cat")[-1]
    completion = served.completions.create(model="demo", prompt="Once", max_tokens=5, temperature=0,
                                           logit_bias={str(token): 100})
    assert completion.choices[0].text == engine.tokenizer.decode([token] * 5)
    chat = served.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(token): 100})
    assert chat.choices[0].message.content == engine.tokenizer.decode([token] * 4)
    assert chat.choices[0].finish_reason == "length"

    free = served.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 12
    held = served.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                     extra_body={"min_tokens": 12})
    assert held.usage.completion_tokens >= 12 and held.choices[0].text.startswith(free.choices[0].text)
    chat = dict(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0)
    free = served.chat.completions.create(**chat)
    assert free.choices[0].finish_reason == "stop"
    held = served.chat.completions.create(**chat, extra_body={"min_tokens": free.usage.completion_tokens + 5})
    assert held.usage.completion_tokens >= free.usage.completion_tokens + 5


def test_bad_logit_bias_and_min_tokens_are_400s_naming_their_field(served, engine):
    vocab = engine.cfg.vocab_size
    chat = dict(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    for bias in ({str(vocab): 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)},
                 {"one": 1}, {"1.0": 1}, {"1": "2"}):
        with pytest.raises(openai.BadRequestError) as e:
            served.chat.completions.create(**chat, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias" and "logit_bias" in e.value.body["message"], (bias, e.value.body)
        with pytest.raises(openai.BadRequestError) as e:
            served.completions.create(model="demo", prompt="Hi", max_tokens=4, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias", (bias, e.value.body)
    for extra in ({"min_tokens": 5}, {"min_tokens": -1}, {"min_tokens": 1.5}):
        with pytest.raises(openai.BadRequestError) as e:
            served.chat.completions.create(**chat, extra_body=extra)
        assert e.value.body["param"] == "min_tokens", (extra, e.value.body)
    assert served.chat.completions.create(**chat).choices[0].finish_reason in ("stop", "length")  # still serving
