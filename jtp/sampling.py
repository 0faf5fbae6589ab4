"""On-device sampling with per-row parameters.

The engine's jitted step produces float32 logits [B, V]; `sample` turns them into
token ids on device, each row using its own parameters, so only ids (and
optional logprobs) come back to the host.

Processing order (per row; `process_logits` returns the result of steps 1-3):

1. Penalties, on the raw logits:
   - repetition (HF): for every token seen in the prompt or the output,
     logit > 0 -> logit / penalty, else logit * penalty;
   - frequency (OpenAI): logit -= frequency_penalty * count_in_output;
   - presence (OpenAI):  logit -= presence_penalty * (count_in_output > 0).
2. Temperature: logits / temperature. Rows with temperature < GREEDY_EPS are
   greedy: their token is the argmax of the penalised logits and steps 3-4 do
   not apply to them (`process_logits` returns their penalised logits as is).
3. Truncation, masked tokens set to -inf:
   - top-k keeps the tokens whose logit >= the k-th largest logit;
   - top-p, over the distribution renormalised to the top-k survivors, keeps
     the shortest prefix (in descending order) whose mass reaches top_p;
   - min-p keeps the tokens with p >= min_p * p_max.
   Thresholds are values, so tokens tied with the last kept one are kept too:
   the kept set depends only on the logit values, never on sort order. The
   most likely token always survives.
4. Sampling with the Gumbel-max trick, argmax(logits + Gumbel noise), the noise
   drawn from the row key fold_in(PRNGKey(seed), step): a row's draw depends
   only on its own seed and step, never on the rest of the batch.

Ties: argmax (greedy and Gumbel) picks the lowest token index.

Logprobs are of the raw model distribution (log_softmax of the logits before
penalties and temperature), like vLLM's default.

Compile-time flags (`SamplingBatch.static_flags()`) let the common case of
greedy / plain temperature skip the sort and the penalty inputs entirely.

Engine usage, per step:

    batch = pack_sampling(row_params, num_rows, seeds, steps)      # numpy, host
    flags = batch.static_flags()                                   # hashable
    extra = {}
    if flags.needs_penalties:
        ids, is_output = pack_penalty_tokens(prompts, outputs, num_rows)
        extra = dict(penalty_ids=ids, penalty_is_output=is_output)
    result = sample_jit(logits, batch, **flags._asdict(), **extra)
"""
from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtp.step_input import GREEDY_EPS, SamplingBatch, SamplingFlags  # noqa: F401 - numpy-only step inputs
MAX_LOGPROBS = 20


# ----------------------------------------------------------------------------- host side


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF semantics, over prompt + generated tokens
    presence_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0  # [-2, 2]; OpenAI semantics, over generated tokens
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # host-side stop strings
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None => none; n >= 0 => chosen logprob + top-n
    speculate: bool = True  # False: never draft for this request (when the engine speculates)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field, its value and the allowed range."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _is_type(value, kinds):
                raise ValueError(f"{name} must be {_type_names(kinds)}, got {value!r}")

        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        check("max_tokens", self.max_tokens >= 1, ">= 1")
        check("temperature", math.isfinite(self.temperature) and self.temperature >= 0,
              "a finite number >= 0")
        check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]")
        if vocab_size is None:
            check("top_k", self.top_k >= -1, "-1, 0 (disabled) or >= 1")
        else:
            check("top_k", -1 <= self.top_k <= vocab_size,
                  f"-1, 0 (disabled) or in [1, {vocab_size}] (the vocab size)")
        check("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        check("repetition_penalty",
              math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "> 0")
        check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]")
        check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]")
        if self.logprobs is not None:
            check("logprobs", 0 <= self.logprobs <= MAX_LOGPROBS,
                  f"None or in [0, {MAX_LOGPROBS}]")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings only, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_type(t, (int,)) or t < 0 or (vocab_size is not None and t >= vocab_size):
                allowed = "ints >= 0" if vocab_size is None else f"ints in [0, {vocab_size})"
                raise ValueError(f"stop_token_ids must hold {allowed}, got {t!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], vocab_size: int | None = None) -> "SamplingParams":
        """Build from JSON-like input: unknown keys and wrong types are errors."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}; "
                             f"allowed: {', '.join(_FIELD_TYPES)}")
        for name, value in d.items():
            if not _is_type(value, _FIELD_TYPES[name]):
                raise ValueError(f"{name} must be {_type_names(_FIELD_TYPES[name])}, "
                                 f"got {value!r}")
        params = cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})
        params.validate(vocab_size)
        return params


# field -> accepted types; `float` fields also take ints (JSON has one number type)
_FIELD_TYPES: dict[str, tuple] = {
    "max_tokens": (int,),
    "temperature": (float,),
    "top_p": (float,),
    "top_k": (int,),
    "min_p": (float,),
    "repetition_penalty": (float,),
    "presence_penalty": (float,),
    "frequency_penalty": (float,),
    "seed": (int, type(None)),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "logprobs": (int, type(None)),
    "speculate": (bool,),
}
assert set(_FIELD_TYPES) == {f.name for f in dataclasses.fields(SamplingParams)}


def _is_type(value: Any, kinds: tuple) -> bool:
    if isinstance(value, bool):  # bool is an int subclass; only accept it where asked
        return bool in kinds
    if isinstance(value, (int, np.integer)):
        return int in kinds or float in kinds
    if isinstance(value, (float, np.floating)):
        return float in kinds
    return isinstance(value, kinds)


def _type_names(kinds: tuple) -> str:
    names = {int: "an int", float: "a number", bool: "a bool", str: "a string",
             list: "a list", type(None): "null"}
    return " or ".join(names[k] for k in kinds)


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: the user's, else a fresh random one."""
    return params.seed if params.seed is not None else secrets.randbits(32)


def pack_sampling(params: Sequence[SamplingParams | None], num_rows: int,
                  seeds: Sequence[int], steps: Sequence[int]) -> SamplingBatch:
    """Pack per-request params into arrays padded to `num_rows` (the row bucket).

    `params[i]` is None for an empty row; rows past len(params) are padding.
    Both get greedy, penalty-free defaults. `seeds[i]` is the request's seed
    (see `request_seed`), `steps[i]` how many tokens it has generated so far.
    """
    n = len(params)
    if n > num_rows or len(seeds) != n or len(steps) != n:
        raise ValueError(f"pack_sampling: {n} params, {len(seeds)} seeds, {len(steps)} steps "
                         f"for {num_rows} rows")

    def column(get, default, dtype):
        out = np.full((num_rows,), default, dtype)
        for i, p in enumerate(params):
            if p is not None:
                out[i] = get(p, i)
        return out

    return SamplingBatch(
        temperature=column(lambda p, i: p.temperature, 0.0, np.float32),
        top_p=column(lambda p, i: p.top_p, 1.0, np.float32),
        top_k=column(lambda p, i: max(p.top_k, 0), 0, np.int32),
        min_p=column(lambda p, i: p.min_p, 0.0, np.float32),
        repetition_penalty=column(lambda p, i: p.repetition_penalty, 1.0, np.float32),
        presence_penalty=column(lambda p, i: p.presence_penalty, 0.0, np.float32),
        frequency_penalty=column(lambda p, i: p.frequency_penalty, 0.0, np.float32),
        seed=column(lambda p, i: seeds[i] % 2**32, 0, np.uint32),
        step=column(lambda p, i: steps[i], 0, np.int32),
        logprobs=column(lambda p, i: -1 if p.logprobs is None else p.logprobs, -1, np.int32),
    )


def pack_penalty_tokens(prompts: Sequence[Sequence[int] | None],
                        outputs: Sequence[Sequence[int] | None], num_rows: int,
                        min_length: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Token history for penalties: (penalty_ids i32[B, L], penalty_is_output bool[B, L]).

    Row i holds prompts[i] then outputs[i], padded with -1. L is rounded up to
    a power of two (>= min_length) so the step compiles for few lengths.
    """
    rows = [(list(p or ()), list(o or ())) for p, o in zip(prompts, outputs, strict=True)]
    longest = max((len(p) + len(o) for p, o in rows), default=0)
    length = max(min_length, 1 << max(0, longest - 1).bit_length())
    ids = np.full((num_rows, length), -1, np.int32)
    is_output = np.zeros((num_rows, length), bool)
    for i, (p, o) in enumerate(rows):
        ids[i, :len(p) + len(o)] = p + o
        is_output[i, len(p):len(p) + len(o)] = True
    return ids, is_output


# ----------------------------------------------------------------------------- device side


class SampleResult(NamedTuple):
    tokens: jax.Array  # i32[B]
    logprob: jax.Array  # f32[B], raw log_softmax at the chosen token
    top_ids: jax.Array | None  # i32[B, num_logprobs], None when num_logprobs == 0
    top_logprobs: jax.Array | None  # f32[B, num_logprobs]
    draft: jax.Array | None = None  # i32[B, k]: MTP speculation's drafts for each row's next step (-1: none)


def build_penalty_counts(penalty_ids: jax.Array, penalty_is_output: jax.Array,
                         vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(output_counts i32[B, V], prompt_mask bool[B, V]) from padded ids (-1 ignored)."""
    batch = penalty_ids.shape[0]
    valid = penalty_ids >= 0
    # invalid ids point one past the vocab and are dropped by the scatter
    cols = jnp.where(valid, penalty_ids, vocab_size)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], cols.shape)
    is_output = penalty_is_output.astype(bool)
    output_counts = jnp.zeros((batch, vocab_size), jnp.int32).at[rows, cols].add(
        (valid & is_output).astype(jnp.int32), mode="drop")
    prompt_mask = jnp.zeros((batch, vocab_size), bool).at[rows, cols].max(
        valid & ~is_output, mode="drop")
    return output_counts, prompt_mask


def apply_penalties(logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array,
                    prompt_mask: jax.Array) -> jax.Array:
    """Repetition, then frequency and presence penalties (identity for neutral rows)."""
    rep = jnp.asarray(batch.repetition_penalty, jnp.float32)[:, None]
    freq = jnp.asarray(batch.frequency_penalty, jnp.float32)[:, None]
    pres = jnp.asarray(batch.presence_penalty, jnp.float32)[:, None]
    in_output = output_counts > 0
    seen = prompt_mask | in_output
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - freq * output_counts.astype(jnp.float32)
    return logits - pres * in_output.astype(jnp.float32)


def _truncation_mask(scaled: jax.Array, batch: SamplingBatch) -> jax.Array:
    """True for tokens that survive top-k, then top-p, then min-p (value thresholds)."""
    vocab = scaled.shape[-1]
    top_k = jnp.asarray(batch.top_k, jnp.int32)[:, None]
    top_p = jnp.asarray(batch.top_p, jnp.float32)[:, None]
    min_p = jnp.asarray(batch.min_p, jnp.float32)[:, None]

    descending = -jnp.sort(-scaled, axis=-1)  # the one sort per row
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(descending, k - 1, axis=-1)
    in_top_k = descending >= kth_value  # a prefix of `descending`, ties included

    # top-p over the top-k survivors, renormalised
    probs = jax.nn.softmax(jnp.where(in_top_k, descending, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p == 1 keeps everything; don't let cumsum rounding cut the tail
    in_top_p = in_top_k & ((mass_before < top_p) | (top_p >= 1.0))
    num_kept = jnp.maximum(jnp.sum(in_top_p, axis=-1, keepdims=True), 1)  # >= 1 anyway
    cutoff = jnp.take_along_axis(descending, num_kept - 1, axis=-1)

    # min-p in log space: p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
    min_p_cutoff = descending[:, :1] + jnp.log(min_p)  # log(0) = -inf keeps all
    return scaled >= jnp.maximum(cutoff, min_p_cutoff)


def _greedy_rows(batch: SamplingBatch) -> jax.Array:
    return jnp.asarray(batch.temperature, jnp.float32) < GREEDY_EPS


def process_logits(logits: jax.Array, batch: SamplingBatch, *, needs_top_k_p_min_p: bool,
                   needs_penalties: bool, output_counts: jax.Array | None = None,
                   prompt_mask: jax.Array | None = None) -> jax.Array:
    """Steps 1-3 of the module docstring: penalised, scaled, masked (-inf) logits.

    Greedy rows come back penalised only (no temperature, no mask); their token
    is the argmax of this output.
    """
    logits = logits.astype(jnp.float32)
    if needs_penalties:
        if output_counts is None or prompt_mask is None:
            raise ValueError("needs_penalties requires output_counts and prompt_mask")
        logits = apply_penalties(logits, batch, output_counts, prompt_mask)
    greedy = _greedy_rows(batch)[:, None]
    temperature = jnp.asarray(batch.temperature, jnp.float32)[:, None]
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    if needs_top_k_p_min_p:
        scaled = jnp.where(greedy | _truncation_mask(scaled, batch), scaled, -jnp.inf)
    return scaled


def row_keys(batch: SamplingBatch) -> jax.Array:
    """Per-row PRNG keys fold_in(key(seed), step); same bits as PRNGKey(seed)."""
    seeds = jnp.asarray(batch.seed).astype(jnp.uint32)
    steps = jnp.asarray(batch.step, jnp.int32)
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def sample(logits: jax.Array, batch: SamplingBatch, *, needs_top_k_p_min_p: bool,
           needs_penalties: bool, num_logprobs: int,
           penalty_ids: jax.Array | None = None, penalty_is_output: jax.Array | None = None,
           output_counts: jax.Array | None = None,
           prompt_mask: jax.Array | None = None) -> SampleResult:
    """Sample one token per row. Pass the flags from `batch.static_flags()` as static.

    With needs_penalties, give either penalty_ids/penalty_is_output (see
    `pack_penalty_tokens`) or prebuilt output_counts/prompt_mask [B, V].
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if needs_penalties and output_counts is None:
        if penalty_ids is None or penalty_is_output is None:
            raise ValueError("needs_penalties requires penalty_ids and penalty_is_output "
                             "(or output_counts and prompt_mask)")
        output_counts, prompt_mask = build_penalty_counts(penalty_ids, penalty_is_output, vocab)
    processed = process_logits(logits, batch, needs_top_k_p_min_p=needs_top_k_p_min_p,
                               needs_penalties=needs_penalties, output_counts=output_counts,
                               prompt_mask=prompt_mask)

    greedy_tokens = jnp.argmax(processed, axis=-1).astype(jnp.int32)  # ties -> lowest id
    # Gumbel noise costs B x V random numbers, well under 1% of a decode step; drawing it for
    # all-greedy batches too saves a compiled variant of every step shape.
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(row_keys(batch))
    sampled = jnp.argmax(processed + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(_greedy_rows(batch), greedy_tokens, sampled)

    log_probs = jax.nn.log_softmax(logits, axis=-1)  # raw model distribution
    logprob = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    top_ids = top_logprobs = None
    if num_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(log_probs, num_logprobs)
        top_ids = top_ids.astype(jnp.int32)
    return SampleResult(tokens, logprob, top_ids, top_logprobs)


# flags are Python values baked into the trace: one compile per (flags, shapes)
sample_jit = jax.jit(sample, static_argnames=(
    "needs_top_k_p_min_p", "needs_penalties", "num_logprobs"))
