"""A stand-in for the engine contract the server uses (submit, abort, stats, astream), replaying
one fixed output: for tests about the HTTP layer (reasoning split, intake limits), not the model."""
from __future__ import annotations

import asyncio
import itertools
import threading
import types

from jtp.engine.engine import EngineStats, TokenEvent


class ScriptedEngine:
    """Streams `output` in 3-character pieces (so tags arrive cut across events), then stops;
    `first_token_delay` seconds pass before the first piece (a long prompt prefilling)."""

    def __init__(self, tokenizer, output: str = "ok", max_model_len: int = 256, first_token_delay: float = 0.0):
        self.tokenizer, self.output, self.max_model_len = tokenizer, output, max_model_len
        self.first_token_delay = first_token_delay
        self.config = types.SimpleNamespace(max_waiting_requests=None)  # the one setting the server reads
        self.sampling_defaults = {}
        self.ready = threading.Event()
        self.ready.set()
        self._ids = itertools.count()
        self.aborted: list[str] = []  # the request ids the server aborted

    def submit(self, prompt_ids, params, request_id=None):
        return request_id or f"scripted-{next(self._ids)}"

    def abort(self, request_id):
        self.aborted.append(request_id)
        return False

    def stats(self):
        return EngineStats(0, 0, 0, 1)

    async def astream(self, request_id):
        pieces = [self.output[i:i + 3] for i in range(0, len(self.output), 3)]
        await asyncio.sleep(self.first_token_delay)
        for k, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = k == len(pieces) - 1
            yield TokenEvent(request_id, [0], piece, finished=last, finish_reason="stop" if last else None)


class RecordingEngine(ScriptedEngine):
    """Replays one output and keeps the prompts it was given, decoded (what the chat template rendered)."""

    def __init__(self, tokenizer, output: str, max_model_len: int = 2048):
        super().__init__(tokenizer, output, max_model_len)
        self.prompts: list[str] = []

    def submit(self, prompt_ids, params, request_id=None):
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        return super().submit(prompt_ids, params, request_id)
