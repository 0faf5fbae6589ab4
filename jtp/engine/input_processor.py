"""Input processing: a caller's prompt and sampling parameters -> a validated `Request`.

Everything a request can be refused for without the device is checked here, at `submit`, so an
error reaches the caller at once (RequestError / ContextLengthError, HTTP 400) and nothing that
can never be served enters the queue.
"""

from __future__ import annotations

import random

from jtp.config.model_config import ModelConfig
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParamError, SamplingParams, request_seed
from jtp.core.scheduler import Request
from jtp.errors import ConfigError, ContextLengthError, RequestError


class InputProcessor:
    def __init__(self, cfg: ModelConfig, max_model_len: int, pool: PagePool, eos_ids: frozenset[int],
                 seed: int | None, sampling_defaults: dict | None = None, no_prompt_logprobs: str | None = None):
        """`no_prompt_logprobs`: what in this engine cannot score prompts (None: it can)."""
        self.cfg, self.max_model_len, self.pool, self.eos_ids = cfg, max_model_len, pool, eos_ids
        self.no_prompt_logprobs = no_prompt_logprobs
        # An engine seed makes the seeds of requests that bring none reproducible too.
        self._seeds = random.Random(seed) if seed is not None else None
        self.sampling_defaults = dict(sampling_defaults or {})
        try:
            SamplingParams.from_dict(self.sampling_defaults, cfg.vocab_size)
        except ValueError as e:
            raise ConfigError(f"the generation config's sampling defaults (--generation-config): {e}") from None

    def default_params(self, **given) -> SamplingParams:
        """SamplingParams of the fields given, the generation config's defaults for the rest."""
        return SamplingParams(**{**self.sampling_defaults, **given})

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab = self.cfg.vocab_size
        try:
            params.validate(vocab)
        except SamplingParamError as e:
            raise RequestError(str(e), param=e.param) from e
        if params.prompt_logprobs is not None and self.no_prompt_logprobs:
            raise RequestError(f"prompt_logprobs are not supported with {self.no_prompt_logprobs}")
        if not prompt_ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length ({self.max_model_len})"
            )
        if not self.pool.can_ever_fit(total):
            raise ContextLengthError(
                f"prompt + max_tokens = {total} tokens needs {self.pool.blocks_needed(total)} KV blocks but the "
                f"whole pool has {self.pool.total_blocks}; lower max_tokens or give the engine more blocks"
            )

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= self.eos_ids
        return frozenset(stop)

    def make_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """The request, its seed drawn (call under the intake lock: the engine's seed stream is shared)."""
        seed = self._seeds.randrange(2**32) if params.seed is None and self._seeds else request_seed(params)
        return Request(request_id, prompt_ids, params, seed, self.stop_ids(params))
