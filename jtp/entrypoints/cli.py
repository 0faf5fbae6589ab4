"""The `jtp` command line.

    jtp serve    [engine flags] [server flags]          OpenAI-compatible HTTP API
    jtp warmup   [engine flags]                         compile serve's step shapes into the cache, exit
    jtp generate [engine flags] [sampling flags] PROMPT  complete one prompt ('-' reads stdin)
    jtp batch    [engine flags] --input IN --output OUT  offline JSONL batch (jtp/entrypoints/batch.py)
    jtp convert  --model DIR --output DIR                HF safetensors -> Orbax
    jtp bench    [scripts/bench.py flags]                engine benchmark against rooflines

With no --model the embedded demo checkpoint is used (built on first use: under checkpoints/ in a
source checkout, else in ~/.cache/jtp/demo-qwen3).
Engine flags are EngineArgs' (jtp/config/engine_args.py), named like vLLM's. Errors are one line on
stderr with exit status 2 (usage, configuration, input) or 1; `--debug` or JTP_DEBUG=1 adds
the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from jtp.config.engine_args import DTYPES, EngineArgs
from jtp.distributed.launcher import is_follower
from jtp.entrypoints.cli_support import (
    EXIT_INTERRUPTED,
    add_common_args,
    add_compile_cache_arg,
    exit_if_a_failed_group_strands_the_step,
    exit_now,
    interrupt_guard,
    interrupted,
    note,
    open_engine,
    raise_if_interrupted,
    run_command,
    run_follower,
    setup_logging,
    use_compile_cache_dir,
)
from jtp.errors import ConfigError, RequestError

REPO_ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- generate


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: the argument, stdin for '-', or --prompt-file; exactly as given, UTF-8 only."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise ConfigError("give exactly one prompt: an argument, '-' for stdin, or --prompt-file FILE")
    if args.prompt_file is not None:
        data, source = Path(args.prompt_file).read_bytes(), args.prompt_file
    elif args.prompt == "-":
        data, source = sys.stdin.buffer.read(), "the prompt on stdin"
    else:
        try:
            args.prompt.encode("utf-8")
            return _checked(args.prompt)
        except UnicodeEncodeError:  # undecodable argv bytes arrive as lone surrogates
            data, source = os.fsencode(args.prompt), "the prompt argument"
    try:
        return _checked(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(f"{source} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _checked(text: str) -> str:
    if not text:
        raise RequestError("the prompt is empty")
    return text


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "logprobs")


def sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling fields the command line sets, checked (RequestError naming the flag); the engine's
    generation-config defaults fill the rest (`Engine.default_params`)."""
    from jtp.core.sampling_params import SamplingParamError, SamplingParams

    given = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}
    if args.stop:
        given["stop"] = args.stop
    try:
        SamplingParams(**given).validate()
    except SamplingParamError as e:  # "top_p must be in (0, 1], got 2.0": name the flag instead of the field
        raise RequestError(f"--{e.param.replace('_', '-')} {str(e).removeprefix(e.param + ' ')}") from None
    return given


def cmd_generate(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.warmup = False  # one request compiles only the shapes it needs
    engine_args.validate()  # bad flags and prompts fail before anything loads
    use_compile_cache_dir(args)
    if is_follower(engine_args):
        return run_follower(engine_args)
    text = read_prompt(args)
    given = sampling_flags(args)
    images = [read_image(path) for path in args.image or ()]  # before loading: a missing file fails fast
    with open_engine(engine_args) as engine:  # closed on every way out, Ctrl-C included
        exit_if_a_failed_group_strands_the_step(engine)
        return _generate(engine, engine_args, args, text, engine.default_params(**given), images)


def read_image(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"--image {path}: cannot read it ({e.strerror or e})") from None


def _generate(engine, engine_args: EngineArgs, args: argparse.Namespace, text: str, params,
              images: list[bytes] = ()) -> int:
    tok = engine.tokenizer
    if tok is None:
        raise ConfigError(f"{engine_args.model_dir()}: no tokenizer.json, so text prompts cannot be encoded")
    extra = {}
    if images:  # one user turn: the images, then the text (through the chat template, as the server does)
        from jtp.engine.multimodal_input import image_chat_prompt

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt_ids, extra["images"] = image_chat_prompt(tok, getattr(engine, "vision", None),
                                                        [{"role": "user", "content": content}], images)
    else:
        if args.chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt_ids = tok.encode(text)
    rid = engine.submit(prompt_ids, params, **extra)
    if args.json:
        print(json.dumps(_json_record(engine_args, engine.result(rid), prompt_ids), ensure_ascii=False))
        return 0
    for event in engine.stream(rid):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _json_record(engine_args: EngineArgs, done, prompt_ids: list[int]) -> dict:
    record = {
        "model": engine_args.model_name(),
        "text": done.text,
        "token_ids": done.token_ids,
        "prompt_token_ids": prompt_ids,
        "finish_reason": done.finish_reason,
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(done.token_ids)},
    }
    if done.logprobs is not None:
        record["logprobs"] = done.logprobs
    if done.top_logprobs is not None:
        record["top_logprobs"] = [{str(t): lp for t, lp in top.items()} for top in done.top_logprobs]
    if engine_args.is_demo:
        from jtp.demo import DEMO_LABEL

        record["note"] = DEMO_LABEL
    return record


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt text; '-' reads it from stdin (exactly, final newline included)")
    p.add_argument("--prompt-file", help="read the prompt from this file (exactly, final newline included)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template as a user turn")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image file (PNG, JPEG, ... anything Pillow reads) before the prompt in its user turn; "
                        "repeat for several; implies --chat; models with a vision tower only")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, prompt_token_ids, finish_reason, usage) "
                        "instead of streaming text")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    # Unset flags take the checkpoint's generation config (--generation-config), as the server does.
    unset = "default: the generation config's, else "
    s.add_argument("--temperature", type=float, help=f"0 = greedy ({unset}1)")
    s.add_argument("--top-p", type=float, help=f"nucleus sampling mass in (0, 1] ({unset}1, off)")
    s.add_argument("--top-k", type=int, help=f"sample among the k most likely tokens ({unset}0, off)")
    s.add_argument("--min-p", type=float, help=f"drop tokens below min_p x the top probability ({unset}0)")
    s.add_argument("--repetition-penalty", type=float,
                   help=f"HF repetition penalty over prompt and output, > 0 ({unset}1, off)")
    s.add_argument("--presence-penalty", type=float, help="OpenAI presence penalty in [-2, 2] (default: 0)")
    s.add_argument("--frequency-penalty", type=float, help="OpenAI frequency penalty in [-2, 2] (default: 0)")
    s.add_argument("--stop", action="append", metavar="TEXT", help="stop before this text; repeat for several")
    s.add_argument("--logprobs", type=int, metavar="N", default=None,
                   help="with --json: each token's logprob and the N most likely alternatives")


# ----------------------------------------------------------------------------- the other commands


def cmd_serve(args: argparse.Namespace, serve_argv: list[str]) -> int:
    """Parse serve's flags here, so the server (and its imports) load only for `jtp serve`."""
    try:
        from jtp.entrypoints.server import add_server_args, run_server
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("jtp.entrypoints.server"):
            raise ConfigError("this jtp has no HTTP server (jtp.entrypoints.server is missing)") from None
        raise
    vars(args).update(vars(build_serve_parser(add_server_args).parse_args(serve_argv)))  # --debug reaches run_command
    setup_logging(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.validate()  # bad flags fail before the port is bound
    use_compile_cache_dir(args)
    return run_server(engine_args, args)  # opens the engine with the compilation cache (open_engine)


def build_serve_parser(add_server_args, prog: str = "jtp serve", description: str = (
        "Serve the OpenAI completions and chat completions API (Starlette on uvicorn).")) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_common_args(parser)
    EngineArgs.add_cli_args(parser)
    add_compile_cache_arg(parser)
    add_server_args(parser)
    return parser


WARMUP_DESCRIPTION = (
    "Compile every step shape `jtp serve` with the same engine flags would compile, into the persistent "
    "compilation cache, and exit: a later `jtp serve` with those flags and that cache loads them instead of "
    "compiling (build a deployment's cache once, e.g. in its image, with --compile-cache-dir).")


def cmd_warmup(args: argparse.Namespace, warmup_argv: list[str]) -> int:
    """`jtp warmup`: serve's engine flags (so the same shape set), no server."""
    parser = build_serve_parser(lambda p: None, prog="jtp warmup", description=WARMUP_DESCRIPTION)
    vars(args).update(vars(parser.parse_args(warmup_argv)))
    setup_logging(args)
    engine_args = EngineArgs.from_cli_args(args)
    if not engine_args.warmup:
        raise ConfigError("jtp warmup --no-warmup: nothing to do (warm-up is what this command runs)")
    engine_args.validate()
    use_compile_cache_dir(args)
    if is_follower(engine_args):
        return run_follower(engine_args)
    with open_engine(engine_args) as engine:
        try:
            engine.warmup(progress=True, interrupted=interrupted)
            raise_if_interrupted()
        except KeyboardInterrupt:
            if engine.runner.compiles_ahead:  # compile threads may be inside XLA
                exit_now(EXIT_INTERRUPTED)
            raise
        note(engine.warmup_report.summary())
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from jtp.entrypoints.batch import run_args

    use_compile_cache_dir(args)

    return run_args(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from jtp.config.hub import resolve_model

    model = resolve_model(args.model, args.revision)
    check_convert_output(Path(model), Path(args.output))  # before anything is written
    from jtp.loading.weights import convert_to_orbax

    out = convert_to_orbax(model, args.output, None if args.dtype == "auto" else args.dtype)
    print(f"wrote {out}")
    return 0


def check_convert_output(model: Path, output: Path) -> None:
    """The output must be a new (or empty) directory outside the model's: never overwrite the input."""
    model, target = model.resolve(), output.resolve()
    if target == model:
        raise ConfigError(f"--output {output}: is the --model directory; write the converted model to a new one")
    if target.is_relative_to(model):
        raise ConfigError(f"--output {output}: lies inside the --model directory {model}; pick one outside it")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--output {output}: exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        raise ConfigError(f"--output {output}: exists and is not empty; pick a new directory or empty it")


def cmd_bench(args: argparse.Namespace, bench_argv: list[str]) -> int:
    """scripts/bench.py's main, so `jtp bench` and the script are the same program."""
    import runpy

    script = REPO_ROOT / "scripts" / "bench.py"
    if not script.is_file():
        raise ConfigError(f"jtp bench runs scripts/bench.py of a source checkout, and {script} is not there "
                          "(an installed jtp does not ship scripts/): run it from a clone of the repository")
    return runpy.run_path(str(script), run_name="jtp_bench")["main"](bench_argv)


# ----------------------------------------------------------------------------- parser


def _version() -> str:
    try:
        return version("jtp")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jtp", description="JAX/XLA inference for the Qwen3 family")
    parser.add_argument("--version", action="version", version=f"jtp {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    add_common_args(common)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to run")

    # serve, warmup and bench parse their own flags (everything after the command word): see cmd_serve.
    serve = sub.add_parser("serve", add_help=False, help="OpenAI-compatible HTTP API (--help lists its flags)")
    serve.set_defaults(func=cmd_serve)
    warm = sub.add_parser("warmup", add_help=False, help="compile serve's step shapes into the persistent cache "
                          "and exit (--help lists its flags)")
    warm.set_defaults(func=cmd_warmup)

    gen = sub.add_parser("generate", parents=[common], help="complete one prompt",
                         description="Complete one prompt; the text streams to stdout.")
    EngineArgs.add_cli_args(gen, serving=False)
    add_compile_cache_arg(gen)
    add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)

    from jtp.entrypoints.batch import add_arguments as add_batch_args

    batch = sub.add_parser("batch", parents=[common], help="offline batch: JSONL prompts in, JSONL completions out",
                           description="Offline batch generation (sampling as the generation config says unless a line sets its fields); "
                                       "resumable: rerun with the same --output.")
    EngineArgs.add_cli_args(batch, serving=False)
    add_compile_cache_arg(batch)
    add_batch_args(batch)
    batch.set_defaults(func=cmd_batch)

    conv = sub.add_parser("convert", parents=[common], help="HF safetensors -> Orbax checkpoint directory",
                          description="Write a model directory whose weights are an Orbax checkpoint.")
    conv.add_argument("--model", required=True, help="Hugging Face model directory (or repo id) to read")
    conv.add_argument("--revision", default=None, help="with a repo id: its branch, tag or commit (default: main)")
    conv.add_argument("--output", required=True, help="model directory to write: new or empty, outside --model")
    conv.add_argument("--dtype", choices=DTYPES, default="auto", help="dtype to store (auto: the checkpoint's)")
    conv.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", add_help=False, help="engine benchmark (scripts/bench.py; --help lists its flags)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    with interrupt_guard():
        try:
            parser = build_parser()
            args, rest = parser.parse_known_args(argv)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        if args.command in ("serve", "warmup", "bench"):  # every flag after the command word is theirs
            return run_command(lambda a: a.func(a, rest), args)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        setup_logging(args)
        return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
