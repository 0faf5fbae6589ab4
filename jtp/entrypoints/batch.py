"""Offline batch generation: a JSONL file of prompts in, a JSONL file of completions out.

    jtp batch --input in.jsonl --output out.jsonl [--model DIR] [--limit N] [engine flags]
    python scripts/generate_offline.py ...         (same flags)

Input, one JSON object a line (blank lines are ignored):

    {"id": "a1", "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}
    {"id": 7, "messages": [{"role": "user", "content": "hi"}], "stop": ["\\n"], "seed": 1}

`id` is a string or an integer; exactly one of `prompt` (raw text, encoded as is) or
`messages` (rendered with the checkpoint's chat template, generation prompt added). Every
other key is a sampling parameter (`SamplingParams.from_dict`: unknown keys are errors).
A field a line leaves unset takes the checkpoint's generation config (`--generation-config`, as
`jtp serve` and `jtp generate` do: Qwen3's samples at temperature 0.6; `--generation-config vllm`
or `"temperature": 0` on a line decodes greedily), then SamplingParams' default; `max_tokens`
defaults to DEFAULT_MAX_TOKENS (64, not SamplingParams' 16: offline jobs usually want more). A
sampled line without a `seed` draws anew on every run (`--seed` seeds such lines, so a rerun
reproduces its results).

Output, one JSON object a line, flushed as each request finishes:

    {"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}
    (+ "logprobs" and, for logprobs > 0, "top_logprobs" when the line asked for them, and
     "prompt_logprobs": per prompt token None (the first) or {token id: logprob}, the top n and its own)
    {"id", "error"}      the line could not be served; the message says why

Rows come in completion order, not input order: match them up by id. A line with no usable id
gets the id "line:<n>" (1-based line number, as in every message). Ids must be unique, as
`custom_id` in an OpenAI batch: an input with a repeated id is refused before anything runs,
naming both lines, so every output row's id stands for one input line.

All requests go through the continuous-batching engine together, at most
`max_pending` (default 4 x max_num_seqs) submitted at a time so host memory stays bounded however
long the input is; a line the engine's waiting queue has no room for yet waits for it.

Resuming: rerunning with the same --output appends only what is missing. An input line is
done when the output already holds a row for it, result or error (errors are not retried:
they come from the line itself; delete an error row to retry that line). A half-written last
row (the process was killed mid-write) is cut off and its line generated again.

Progress goes to stderr: a bar on a terminal, otherwise a line every PROGRESS_LOG_SECONDS (so
a redirected log shows it too). Ctrl-C stops at the next step boundary, exits 130, and leaves
every finished row in the output for the rerun.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from jtp.config.engine_args import EngineArgs
from jtp.distributed.launcher import is_follower
from jtp.entrypoints.cli_support import (
    add_common_args,
    exit_if_a_failed_group_strands_the_step,
    interrupt_guard,
    interrupted,
    note,
    open_engine,
    raise_if_interrupted,
    run_command,
    run_follower,
    setup_logging,
)
from jtp.errors import ConfigError, QueueFullError, RequestError, WorkerGroupError

if TYPE_CHECKING:
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.engine import Engine
    from jtp.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 64
PROGRESS_LOG_SECONDS = 10.0  # without a terminal: one progress line this often
PENDING_PER_SEQ = 4  # submitted-but-unfinished requests per engine row
_RESERVED = ("id", "prompt", "messages")  # line keys that are not sampling parameters


@dataclasses.dataclass
class Job:
    """One servable input line."""

    id: str | int
    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class Stats:
    ok: int = 0
    errors: int = 0
    skipped: int = 0  # lines already in the output before this run
    tokens: int = 0  # generated this run
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.ok} ok, {self.errors} errors, {self.skipped} skipped (already in the output); "
            f"{self.tokens} tokens in {self.seconds:.1f} s = {self.tokens_per_s:.1f} tokens/s"
        )


# ----------------------------------------------------------------------------- input lines


def _key(row_id: Any) -> str:
    # JSON text as the key: the id 1 and the id "1" stay different.
    return json.dumps(row_id)


def parse_line(
    raw: bytes, lineno: int, tokenizer: Tokenizer, vocab_size: int, defaults: dict | None = None
) -> tuple[str | int, Job | str]:
    """(row id, Job) for a servable line, else (row id, error message). `defaults`: the sampling
    fields a line leaves unset (default: max_tokens DEFAULT_MAX_TOKENS)."""
    from jtp.core.sampling_params import SamplingParams

    fallback = f"line:{lineno}"
    where = f"line {lineno}"
    obj = _parse_json(raw)
    if isinstance(obj, JsonError):
        return fallback, f"{where}: {obj}"
    if not isinstance(obj, dict):
        return fallback, f"{where}: expected a JSON object, got {type(obj).__name__}"
    if "id" not in obj:
        return fallback, f"{where}: missing 'id'"
    row_id = obj["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        return fallback, f"{where}: 'id' must be a string or an integer, got {row_id!r}"

    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        got = "both" if has_prompt else "neither"
        return row_id, f"{where}: needs exactly one of 'prompt' or 'messages', got {got}"
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            return row_id, f"{where}: 'prompt' must be a string, got {type(obj['prompt']).__name__}"
        text = obj["prompt"]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return row_id, f"{where}: 'messages' must be a non-empty list of objects"
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template error is this line's problem, not the run's
            return row_id, f"{where}: chat template failed: {type(e).__name__}: {e}"

    sampling = {**(defaults or {"max_tokens": DEFAULT_MAX_TOKENS}),
                **{k: v for k, v in obj.items() if k not in _RESERVED}}
    try:
        params = SamplingParams.from_dict(sampling, vocab_size)
    except ValueError as e:
        return row_id, f"{where}: invalid sampling parameters: {e}"
    return row_id, Job(row_id, tokenizer.encode(text), params)


class JsonError(str):
    """Why a line is not JSON, in columns of that line (json's own "line 1" would name another line)."""


def _parse_json(raw: bytes):
    # the line's end is not part of a string it cuts short, nor is a byte-order mark (Windows editors write one)
    raw = raw.rstrip(b"\r\n").removeprefix(codecs.BOM_UTF8)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return JsonError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
    except json.JSONDecodeError as e:  # "Expecting value", "Unterminated string starting at", ...
        return JsonError(f"invalid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")


def _line_id(raw: bytes, lineno: int):
    """The id a line's row gets: its own when usable, else line:<n> (as parse_line gives it)."""
    obj = _parse_json(raw)
    row_id = obj.get("id") if isinstance(obj, dict) else None
    return row_id if isinstance(row_id, (str, int)) and not isinstance(row_id, bool) else f"line:{lineno}"


def scan_input(path: Path) -> int:
    """The input's request lines, counted before anything runs; a repeated id refuses the whole input."""
    first: dict[str, int] = {}
    repeats: list[tuple[str | int, int, int]] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                row_id = _line_id(raw, lineno)
                key = _key(row_id)
                if key in first:
                    repeats.append((row_id, lineno, first[key]))
                first.setdefault(key, lineno)
    if repeats:
        row_id, lineno, earlier = repeats[0]
        more = f" ({len(repeats) - 1} more repeated)" if len(repeats) > 1 else ""
        raise ConfigError(f"{path}: line {lineno} repeats the id {row_id!r} of line {earlier}{more}; ids must be "
                          "unique (as custom_id in an OpenAI batch), nothing was run")
    return len(first)


# ----------------------------------------------------------------------------- resume


def load_done(path: str | Path) -> Counter:
    """Rows per id already in the output; a half-written last row is dropped from the file first."""
    counts: Counter = Counter()
    path = Path(path)
    if not path.exists():
        return counts
    with open(path, "r+b") as f:
        good_end = 0  # byte offset after the last complete row
        tail = b""
        for raw in f:
            if not raw.endswith(b"\n"):
                tail = raw  # only the last line can lack its newline
                break
            good_end += len(raw)
            row_id = _row_id(raw)
            if row_id is not None:
                counts[_key(row_id)] += 1
            elif raw.strip():
                log.warning("%s: ignoring an unreadable row at byte %d", path, good_end - len(raw))
        if tail:
            row_id = _row_id(tail)
            if row_id is not None:  # a complete row whose newline never made it: keep it
                f.seek(0, 2)
                f.write(b"\n")
                counts[_key(row_id)] += 1
            else:
                log.warning("%s: dropping a half-written last row (%d bytes); its line runs again", path, len(tail))
                f.truncate(good_end)
    return counts


def _row_id(raw: bytes):
    row = _parse_json(raw)
    return row.get("id") if isinstance(row, dict) else None


# ----------------------------------------------------------------------------- the run


class _JsonlWriter:
    """Append-only JSONL writer; each row is flushed so a kill loses nothing written."""

    def __init__(self, f, stats: Stats):
        self.f, self.stats = f, stats

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.f.flush()
        if "error" in row:
            self.stats.errors += 1
        else:
            self.stats.ok += 1


class _Progress:
    """Rows done out of the input's, on stderr: a tqdm bar on a terminal, else a line every `every` s."""

    def __init__(self, total: int, stats: Stats, enabled: bool, every: float):
        self.total, self.stats, self.every = total, stats, every
        self.rows = 0
        on_terminal = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, unit="req", desc="batch", file=sys.stderr) if on_terminal else None
        self.log_lines = enabled and not on_terminal
        self.last_line = time.monotonic()

    def update(self, rows: int = 0) -> None:
        self.rows += rows
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix(tok_s=f"{self.stats.tokens_per_s:.0f}", refresh=False)
        elif self.log_lines and time.monotonic() - self.last_line >= self.every:
            self.last_line = time.monotonic()
            note(f"batch: {self.rows}/{self.total} rows, {self.stats.tokens} tokens generated, "
                 f"{self.stats.tokens_per_s:.1f} tokens/s")

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def run(
    engine: Engine,
    input_path: str | Path,
    output_path: str | Path,
    *,
    max_pending: int | None = None,
    limit: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
    progress_every: float = PROGRESS_LOG_SECONDS,
) -> Stats:
    """Serve every input line not already in the output; return the counts of this run.

    `engine` must be driven here (not `start()`ed). `limit` caps the new rows of this run
    (lines already in the output don't count): a way to try a few lines, or to stop early.
    """
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ConfigError("the model has no tokenizer.json: batch generation needs one to encode prompts")
    input_path, output_path = Path(input_path), Path(output_path)
    max_pending = max_pending or PENDING_PER_SEQ * engine.config.max_num_seqs * engine.config.args.data_parallel_size
    vocab_size = engine.cfg.vocab_size
    defaults = {**engine.sampling_defaults, "max_tokens": default_max_tokens}

    total = scan_input(input_path)  # before the output is touched: a repeated id runs nothing
    stats = Stats()
    done = load_done(output_path)
    inflight: dict[str, tuple[str | int, int]] = {}  # engine id -> (row id, prompt tokens)
    new_rows = 0
    start = time.monotonic()

    bar = _Progress(total, stats, progress, progress_every)
    with open(output_path, "a", encoding="utf-8") as f, open(input_path, "rb") as lines, bar:
        out = _JsonlWriter(f, stats)

        def finished(row: dict) -> None:
            out.write(row)
            bar.update(1)

        def step() -> None:
            raise_if_interrupted()  # a Ctrl-C swallowed inside a JAX callback still stops the run here
            events = engine.step()
            if not events and not engine.has_unfinished():
                raise RuntimeError(f"the engine went idle with {len(inflight)} requests unfinished")
            for ev in events:
                stats.tokens += len(ev.token_ids)
                if ev.finished and ev.request_id in inflight:
                    finished(_result_row(engine, ev.request_id, *inflight.pop(ev.request_id)))
            stats.seconds = time.monotonic() - start
            bar.update()

        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            row_id, job = parse_line(raw, lineno, tokenizer, vocab_size, defaults)
            if done[_key(row_id)]:
                stats.skipped += 1
                bar.update(1)
                continue
            if limit is not None and new_rows >= limit:
                break
            new_rows += 1
            if isinstance(job, str):
                finished({"id": row_id, "error": job})
                continue
            while len(inflight) >= max_pending:
                step()
            try:
                while (rid := _submit_or_none(engine, job)) is None:
                    step()  # the waiting queue is full: it drains as the steps run
            except WorkerGroupError:
                raise  # the engine failed, not the line: no error row (never retried), the rerun serves it
            except RequestError as e:
                finished({"id": row_id, "error": f"line {lineno}: {e}"})
                continue
            inflight[rid] = (row_id, len(job.prompt_ids))

        while inflight:
            step()
    stats.seconds = time.monotonic() - start
    return stats


def _submit_or_none(engine: Engine, job) -> str | None:
    """The request's id, or None while the engine's waiting queue (max_waiting_requests) is full."""
    try:
        return engine.submit(job.prompt_ids, job.params)
    except QueueFullError:
        if not engine.has_unfinished():  # nothing of ours will make room
            raise
        return None


def _result_row(engine: Engine, rid: str, row_id, prompt_tokens: int) -> dict:
    done = engine.result(rid)
    engine.release(rid)
    if done.finish_reason == "error":
        return {"id": row_id, "error": f"generation failed: {done.error}"}
    row = {
        "id": row_id,
        "text": done.text,
        "token_ids": done.token_ids,
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(done.token_ids)},
    }
    if done.logprobs is not None:
        row["logprobs"] = done.logprobs
    if done.top_logprobs is not None:
        row["top_logprobs"] = [{str(t): lp for t, lp in top.items()} for top in done.top_logprobs]
    if done.prompt_logprobs is not None:
        row["prompt_logprobs"] = _prompt_logprobs(done.prompt_logprobs)
    return row


def _prompt_logprobs(scores) -> list[dict | None]:
    """Per prompt token, as vLLM's offline output: None for the first (nothing predicts it), else
    {token id: logprob} of the top tokens there and the prompt token itself."""
    return [None] + [{**{str(t): lp for t, lp in (scores.top[k] or {}).items()}, str(token): scores.logprobs[k]}
                     for k, token in enumerate(scores.token_ids) if k > 0]


# ----------------------------------------------------------------------------- command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The batch-only flags (the engine flags come from EngineArgs)."""
    p.add_argument("--input", required=True, help="JSONL file, one request a line")
    p.add_argument("--output", required=True, help="JSONL file; appended to, lines already in it are skipped")
    p.add_argument("--limit", type=int, default=None, help="write at most N new rows this run")


def run_args(args: argparse.Namespace) -> int:
    """Build the engine from parsed flags, run the batch, print the summary."""
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.warmup = False  # the batch compiles the shapes it meets
    if is_follower(engine_args):  # across machines: this host follows the leader's batch
        return run_follower(engine_args)
    if not Path(args.input).is_file():
        raise ConfigError(f"--input {args.input}: no such file")
    if Path(args.input).resolve() == Path(args.output).resolve():
        raise ConfigError("--input and --output are the same file")
    if not Path(args.output).resolve().parent.is_dir():
        raise ConfigError(f"--output {args.output}: its directory does not exist")
    resume_note = f"the rows written so far are in {args.output}; rerun the same command to resume"
    try:
        with open_engine(engine_args) as engine:
            exit_if_a_failed_group_strands_the_step(engine, resume_note)
            stats = run(engine, args.input, args.output, limit=args.limit)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) or interrupted():
            note(f"interrupted: the rows written so far are in {args.output}; rerun the same command to resume")
        elif isinstance(e, WorkerGroupError):
            note(resume_note)
        raise
    note(f"batch: {stats.summary()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Offline batch generation: JSONL prompts in, JSONL completions out (sampling as the "
                    "generation config says unless a line sets its fields); resumable: rerun with the same --output."
    )
    EngineArgs.add_cli_args(parser, serving=False)
    add_arguments(parser)
    add_common_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    with interrupt_guard():
        args = build_parser().parse_args(argv)
        setup_logging(args)
        return run_command(run_args, args)


if __name__ == "__main__":
    sys.exit(main())
