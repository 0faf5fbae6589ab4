"""The OpenAI-compatible HTTP API (`jtp serve`): Starlette on uvicorn.

    protocol.py    request bodies checked and turned into jtp's terms
    serving.py     the endpoints: prompt -> engine requests -> response / SSE (completions, chat, and
                   Messages and Responses over the chat path), tokenize / detokenize
    generation.py  the n engine requests behind one API request, merged; aborts on disconnect
    choices.py     one response choice built from engine events (streamed and whole alike)
    logprobs.py    logprobs in the completions and chat shapes
    reasoning.py   Qwen3 <think>...</think> split into reasoning_content, streaming-safe
    tool_parsers.py  tool calls in the model's text (hermes, qwen3_coder) or forced by the grammar
    anthropic.py   Anthropic's Messages API: request shapes to a chat request, output as content blocks
    responses.py   OpenAI's Responses API: request shapes to a chat request, output items, stored responses
    shapes.py      the pydantic base and parser of those two request shapes
    metrics.py     Prometheus metrics under vLLM's names (jtp: prefix)
    errors.py      the OpenAI error body; jtp's RequestErrors mapped to statuses
    sse.py         server-sent events, with keep-alive comments while a stream is silent
    intake.py      bodies read with size and time limits; parse, render, tokenize on a thread pool
    limits.py      ServerLimits: what one client may ask (sizes, counts, timeouts)
    connections.py header timeout (slowloris) and the concurrency limit's 503
    app.py         routes, API key, build_app(engine, ...)
    launch.py      add_server_args / run_server for `jtp serve`
"""

from jtp.entrypoints.server.app import build_app
from jtp.entrypoints.server.launch import ServerArgs, add_server_args, run_server

__all__ = ["build_app", "ServerArgs", "add_server_args", "run_server"]
