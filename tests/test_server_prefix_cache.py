"""Automatic prefix caching through the HTTP API, against live uvicorn servers on loopback.

Two engines on the demo checkpoint serve the same requests: one with prefix caching (the
default), one started with --no-enable-prefix-caching. Every request goes to both through the
real `openai` client (temperature 0), and the test checks that
* the outputs are identical (the cache changes no result),
* `usage.prompt_tokens_details.cached_tokens` is exactly what the block arithmetic predicts from
  token ids computed here with the checkpoint's own tokenizer and chat template: the longest
  whole-block prefix of the prompt that an earlier request computed, capped at
  (len(prompt) - 1) // block_size blocks (the last prompt token is always computed),
* /metrics counts every prompt token and hit: jtp:prefix_cache_queries_total / _hits_total equal
  the sums of usage's prompt_tokens / cached_tokens, the hit rate is their ratio, and
  jtp:prefix_cache_blocks is the number of distinct whole blocks the requests computed.

"Computed" is the subtle part: a request that ends by length never feeds its last sampled token
back, so its cacheable sequence is prompt + output[:-1]. Every request sets ignore_eos so it
ends by length and that sequence is exact (an end-of-sequence stop may or may not have had the
stop token's K/V written, depending on the step pipeline). The pool is large enough that
nothing is evicted during the module (checked), so the cache holds every computed block.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses

import httpx
import pytest
from loopback import serving
from test_server import Served, parse_sse, start_engine

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.demo import ensure_demo_checkpoint
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints.server import build_app

BLOCK = 32
# Few buckets keep the compiled shapes few (one token bucket; blocks per row 1 or 4), and 256
# blocks are far more than the module ever uses. No warm-up: only the shapes used are compiled.
FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-model-len", str(4 * BLOCK),
         "--block-size", str(BLOCK), "--num-blocks", "256", "--no-warmup"]

HISTORY = [
    {"role": "system", "content": "Answer in short sentences."},
    {"role": "user", "content": "What does the pool keep?"},
    {"role": "assistant", "content": "The whole blocks of finished requests."},
    {"role": "user", "content": "And a new request?"},
    {"role": "assistant", "content": "It starts from them."},
]


# ----------------------------------------------------------------------------- the cache, predicted


@dataclasses.dataclass
class CacheModel:
    """What the caching engine's prefix cache holds: every whole block each request computed."""

    block: int
    computed: list[list[int]] = dataclasses.field(default_factory=list)

    def predict(self, prompt: list[int]) -> int:
        """Cached tokens for `prompt`: its longest whole-block prefix some request computed,
        leaving at least the last prompt token to compute."""
        limit = (len(prompt) - 1) // self.block
        best = 0
        for seq in self.computed:
            n = 0
            while n < limit and (n + 1) * self.block <= len(seq) and \
                    seq[n * self.block:(n + 1) * self.block] == prompt[n * self.block:(n + 1) * self.block]:
                n += 1
            best = max(best, n)
        return best * self.block

    def add(self, prompt: list[int], output: list[int]) -> None:
        self.computed.append(prompt + output[:-1])  # ended by length: the last token was never fed

    def num_blocks(self) -> int:
        return len({tuple(seq[:(i + 1) * self.block]) for seq in self.computed
                    for i in range(len(seq) // self.block)})


@dataclasses.dataclass
class Reply:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclasses.dataclass
class Pair:
    """The caching server and the plain one; every request goes to both and is checked."""

    cached: Served
    plain: Served
    tokenizer: Tokenizer  # from the checkpoint directory, not the engines'
    model: CacheModel
    prompt_tokens: int = 0  # sums over every request the caching server answered
    hit_tokens: int = 0

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def chat(self, messages: list[dict], max_tokens: int, stream: bool = False, check: bool = True) -> Reply:
        return self._both(self.chat_ids(messages), max_tokens, check,
                          lambda served: _chat(served, messages, max_tokens, stream))

    def complete(self, prompt_ids: list[int], max_tokens: int, stream: bool = False, check: bool = True) -> Reply:
        return self._both(prompt_ids, max_tokens, check,
                          lambda served: _complete(served, prompt_ids, max_tokens, stream))

    def _both(self, ids: list[int], max_tokens: int, check: bool, send) -> Reply:
        """`check`: compare cached_tokens with the prediction (False for concurrent requests,
        whose admission order decides which of them finds the other's blocks)."""
        expected = self.model.predict(ids)
        got, plain = send(self.cached), send(self.plain)
        # The engine's own output gives the token ids the caching engine computed.
        ref = self.plain.engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True))[0]
        assert got.text == plain.text == ref.text
        assert got.prompt_tokens == plain.prompt_tokens == len(ids)
        assert got.completion_tokens == plain.completion_tokens == len(ref.token_ids) == max_tokens
        assert plain.cached_tokens == 0
        assert got.cached_tokens % BLOCK == 0 and got.cached_tokens < len(ids)
        if check:
            assert got.cached_tokens == expected, (got.cached_tokens, expected, len(ids))
        self.model.add(ids, ref.token_ids)
        self.prompt_tokens += got.prompt_tokens
        self.hit_tokens += got.cached_tokens
        return got


def _usage(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens


def _chat(served: Served, messages: list[dict], max_tokens: int, stream: bool) -> Reply:
    body = dict(model=served.model, messages=messages, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
    if not stream:
        r = served.client().chat.completions.create(**body)
        assert r.choices[0].finish_reason == "length"
        return Reply(r.choices[0].message.content or "", *_usage(r.usage))
    chunks = list(served.client().chat.completions.create(**body, stream=True,
                                                          stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    return Reply("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), *_usage(chunks[-1].usage))


def _complete(served: Served, prompt_ids: list[int], max_tokens: int, stream: bool) -> Reply:
    body = dict(model=served.model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True})
    if not stream:
        r = served.client().completions.create(**body)
        assert r.choices[0].finish_reason == "length"
        return Reply(r.choices[0].text, *_usage(r.usage))
    chunks = list(served.client().completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return Reply("".join(c.choices[0].text for c in chunks if c.choices), *_usage(chunks[-1].usage))


@pytest.fixture(scope="module")
def pair():
    with contextlib.ExitStack() as stack:
        served = []
        for flags, caching in (([], True), (["--no-enable-prefix-caching"], False)):  # on by default
            parser = argparse.ArgumentParser()
            EngineArgs.add_cli_args(parser)
            args = EngineArgs.from_cli_args(parser.parse_args(FLAGS + flags))
            assert args.enable_prefix_caching is caching
            engine = start_engine(args)
            stack.callback(engine.close)
            engine.ready.set()
            url = stack.enter_context(serving(build_app(engine, args.model_name())))
            served.append(Served(engine, url, args.model_name()))
        tokenizer = Tokenizer.from_dir(ensure_demo_checkpoint())
        yield Pair(*served, tokenizer, CacheModel(BLOCK))


def words(n_tokens: int, tokenizer: Tokenizer, salt: str) -> list[int]:
    """A prompt of exactly n_tokens ids, unlike any other test's (salt goes first)."""
    text = f"{salt}: " + " ".join(["the prefix cache keeps whole blocks of keys and values"] * n_tokens)
    ids = tokenizer.encode(text)[:n_tokens]
    assert len(ids) == n_tokens
    return ids


# ----------------------------------------------------------------------------- requests


def test_a_conversation_sent_again_reuses_every_whole_block_but_the_last_token(pair):
    messages = HISTORY + [{"role": "user", "content": "What does a second one compute?"}]
    ids = pair.chat_ids(messages)
    assert len(ids) > 3 * BLOCK
    first = pair.chat(messages, max_tokens=6)
    assert first.cached_tokens == 0
    again = pair.chat(messages, max_tokens=6)
    assert again.cached_tokens == (len(ids) - 1) // BLOCK * BLOCK > 0


def test_turn_two_reuses_turn_one_and_its_answer(pair):
    turn1 = HISTORY[:3] + [{"role": "user", "content": "Which ones?"}]
    answer = pair.chat(turn1, max_tokens=16)
    turn2 = turn1 + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": "Why?"}]
    ids1, ids2 = pair.chat_ids(turn1), pair.chat_ids(turn2)
    reply = pair.chat(turn2, max_tokens=6)  # checks cached_tokens against the block arithmetic
    # Turn 1's prompt, re-rendered inside turn 2, is a prefix of it: its whole blocks at least hit.
    assert ids2[:len(ids1)] == ids1
    assert reply.cached_tokens >= len(ids1) // BLOCK * BLOCK > 0


def test_token_id_turns_hit_exactly_the_blocks_turn_one_computed(pair):
    tok = pair.tokenizer

    def answer(prompt, max_tokens):
        return pair.plain.engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                   ignore_eos=True))[0].token_ids

    # Turn 1 computes 30 prompt + 39 output tokens (the 40th is never fed): 2 whole blocks, the
    # second made of generated tokens only. Turn 2 resends all 70 and a question.
    p1 = words(30, tok, "turn one")
    assert pair.complete(p1, max_tokens=40).cached_tokens == 0
    r2 = pair.complete(p1 + answer(p1, 40) + tok.encode(" And then?"), max_tokens=4)
    assert r2.cached_tokens == 2 * BLOCK

    # Prompt + output exactly 2 blocks: the final token of the second block (the last one sampled)
    # was never computed, so that block is not cached although turn 2 shares all of it.
    p3 = words(2 * BLOCK - 14, tok, "aligned")
    pair.complete(p3, max_tokens=14)
    assert pair.complete(p3 + answer(p3, 14) + tok.encode(" More."), max_tokens=4).cached_tokens == BLOCK

    # A block-aligned prompt sent again: its last block is recomputed for the last token.
    p5 = words(2 * BLOCK, tok, "exact")
    pair.complete(p5, max_tokens=1)
    assert pair.complete(p5, max_tokens=1).cached_tokens == BLOCK


def test_streaming_usage_reports_the_same_cached_tokens(pair):
    messages = HISTORY + [{"role": "user", "content": "And when streaming?"}]
    pair.chat(messages, max_tokens=5)
    whole = pair.chat(messages, max_tokens=5)
    streamed = pair.chat(messages, max_tokens=5, stream=True)
    assert streamed.text == whole.text and streamed.cached_tokens == whole.cached_tokens > 0

    ids = words(3 * BLOCK + 5, pair.tokenizer, "streamed")
    pair.complete(ids, max_tokens=3, stream=True)
    whole = pair.complete(ids, max_tokens=3)
    streamed = pair.complete(ids, max_tokens=3, stream=True)
    assert streamed.text == whole.text and streamed.cached_tokens == whole.cached_tokens == 3 * BLOCK

    # Raw SSE: the usage chunk's field, as sent.
    body = dict(prompt=ids, max_tokens=3, temperature=0, ignore_eos=True, stream_options={"include_usage": True})
    texts, usages = [], []
    for served in (pair.cached, pair.plain):
        events = parse_sse(served.stream_raw("/v1/completions", {**body, "model": served.model}))
        texts.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
        usages.append(events[-1]["usage"])
    assert texts[0] == texts[1] == whole.text
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": 0}
    out = pair.plain.engine.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    pair.model.add(ids, out.token_ids)
    pair.prompt_tokens += len(ids)
    pair.hit_tokens += 3 * BLOCK


# ----------------------------------------------------------------------------- metrics


def test_metrics_count_every_prompt_token_and_hit(pair):
    before = pair.cached.metrics()
    # Concurrent requests sharing a document: whichever is admitted later may find the blocks of
    # the others, so only the totals are checked here.
    doc = words(3 * BLOCK, pair.tokenizer, "shared document")
    prompts = [doc + pair.tokenizer.encode(f" Question {i}?") for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda p: pair.complete(p, max_tokens=3, check=False), prompts))
    after = pair.cached.metrics()

    def grew(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("jtp:prefix_cache_queries_total") == sum(r.prompt_tokens for r in replies)
    assert grew("jtp:prefix_cache_hits_total") == sum(r.cached_tokens for r in replies)
    assert grew("jtp:prompt_tokens_total") == sum(r.prompt_tokens for r in replies)

    # Since start: everything this module sent (every request went through `pair`).
    assert after["jtp:prefix_cache_queries_total"] == pair.prompt_tokens
    assert after["jtp:prefix_cache_hits_total"] == pair.hit_tokens > 0
    assert after["jtp:prefix_cache_hit_rate"] == pytest.approx(pair.hit_tokens / pair.prompt_tokens)
    assert after["jtp:prefix_cache_blocks"] == pair.model.num_blocks() == pair.cached.engine.pool.num_cached_blocks
    assert after["jtp:num_snapshots"] == 0
    assert pair.cached.engine.pool.num_evicted == 0  # so the cache still holds all it was given

    # Without prefix caching nothing is looked up, hit or kept.
    plain = pair.plain.metrics()
    for name in ("jtp:prefix_cache_queries_total", "jtp:prefix_cache_hits_total", "jtp:prefix_cache_hit_rate",
                 "jtp:prefix_cache_blocks", "jtp:num_snapshots"):
        assert plain[name] == 0, name
    assert plain["jtp:prompt_tokens_total"] == pair.prompt_tokens


def test_metrics_text_types_and_snapshot_gauge(pair):
    text = httpx.get(pair.cached.url + "/metrics").text
    assert "# TYPE jtp:prefix_cache_queries_total counter" in text
    assert "# TYPE jtp:prefix_cache_hits_total counter" in text
    for gauge in ("prefix_cache_hit_rate", "prefix_cache_blocks", "num_snapshots"):
        assert f"# TYPE jtp:{gauge} gauge" in text

    engine = pair.cached.engine
    snapshot = engine.snapshot(tokens=words(3 * BLOCK, pair.tokenizer, "shared document"))
    assert pair.cached.metrics()["jtp:num_snapshots"] == 1
    engine.drop(snapshot)
    assert pair.cached.metrics()["jtp:num_snapshots"] == 0
