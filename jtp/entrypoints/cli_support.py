"""What every jtp command-line entry point shares (`jtp ...`, scripts/generate_offline.py).

- `run_command`: a failure is one `error: ...` line on stderr and a non-zero exit (2 for
  usage, configuration and input errors, 1 for anything else); the traceback only with
  `--debug` or JTP_DEBUG=1. Ctrl-C exits 130 and a closed stdout pipe 141, both quietly.
- `interrupt_guard()`: Ctrl-C is recorded as well as raised, because a KeyboardInterrupt
  raised inside a JAX callback can come out as another exception, or as an "Exception ignored"
  report and not at all. Long loops call `raise_if_interrupted()` between steps, and
  `run_command` exits 130 whatever came out.
- `open_engine`: build the engine from EngineArgs and report the devices, the mesh and the
  KV pool on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from jtp.errors import JtpError, WorkerGroupError

if TYPE_CHECKING:
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

EXIT_ERROR = 1
EXIT_USAGE = 2  # usage, configuration or input errors: the user can fix them
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `cmd | head` reports for a C program

_interrupted = False


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true",
                   help="print the full traceback of an error (also JTP_DEBUG=1)")
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging threshold (default: WARNING)")


def setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("JTP_DEBUG", "") not in ("", "0")


# ----------------------------------------------------------------------------- interrupts


def interrupted() -> bool:
    """True once Ctrl-C was pressed under `interrupt_guard`."""
    return _interrupted


def raise_if_interrupted() -> None:
    if _interrupted:
        raise KeyboardInterrupt


def _on_sigint(signum, frame) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_guard():
    """Record Ctrl-C (see the module docstring) from here on; entry points wrap all their work in it."""
    global _interrupted
    _interrupted = False
    default_hook = sys.unraisablehook

    def unraisable(info) -> None:  # a Ctrl-C that landed where it cannot propagate: recorded already
        if not issubclass(info.exc_type, KeyboardInterrupt):
            default_hook(info)

    previous = signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = default_hook
        _interrupted = False


# ----------------------------------------------------------------------------- errors


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, (JtpError, OSError))


def one_line(e: BaseException) -> str:
    """The error as one line: multi-line messages (a list of checkpoint problems) joined by '; '."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    if not _is_user_error(e):
        text = f"{type(e).__name__}: {text}"
    return "; ".join(line.strip() for line in text.splitlines() if line.strip()).replace(":; ", ": ")


def _quiet_stdout() -> None:
    # Later writes (and the interpreter's final flush) would raise again: send them nowhere.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a parsed command (under `interrupt_guard`); turn every way it can end into an exit status."""
    try:
        status = command(args)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        status = EXIT_BROKEN_PIPE
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit statuses
        if _interrupted:  # what Ctrl-C became inside a callback: still an interrupt
            status = EXIT_INTERRUPTED
        else:
            if debug_enabled(args):
                traceback.print_exc()
            user = _is_user_error(e)
            hint = "" if user or debug_enabled(args) else " (--debug or JTP_DEBUG=1 shows the traceback)"
            print(f"error: {one_line(e)}{hint}", file=sys.stderr)
            # A worker group that broke is no usage error (its message still reads as one line).
            status = EXIT_USAGE if user and not isinstance(e, WorkerGroupError) else EXIT_ERROR
            if isinstance(e, WorkerGroupError):  # an ordinary exit can hang on the dead peer (jax's atexit shutdown)
                exit_now(EXIT_INTERRUPTED if _interrupted else status)
    return EXIT_INTERRUPTED if _interrupted else status


# ----------------------------------------------------------------------------- engines


CACHE_ENV = "JTP_COMPILATION_CACHE"  # the persistent compilation cache's directory ("" turns it off)
CACHE_MAX_BYTES = 32 * 2**30  # least recently used entries go beyond it


def default_cache_dir() -> str:
    return os.environ.get(CACHE_ENV, str(Path.home() / ".cache" / "jtp" / "xla"))


def add_compile_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                   help=f"persistent XLA compilation cache, shared by every jtp process that names it (default: "
                        f"${CACHE_ENV}, else ~/.cache/jtp/xla; '' turns it off)")


def use_compile_cache_dir(args: argparse.Namespace) -> None:
    """--compile-cache-dir, through the environment so the processes jtp spawns (followers) use it too."""
    path = getattr(args, "compile_cache_dir", None)
    if path is not None:
        os.environ[CACHE_ENV] = path


def enable_compilation_cache() -> None:
    """Persist every compiled step across runs (min compile time 0: on a CPU most steps compile in
    under a second, and a start-up compiles hundreds), so a second start loads instead of compiling.

    A size bound makes JAX take a file lock around every read and write of an entry, so processes
    sharing the directory (a server and `jtp warmup`, a group's leader and followers) never read an
    entry another one is still writing. Without the bound JAX skips the lock (an entry read while
    being written fails its zlib/zstd check: a warning and a compile). Each write under the bound
    scans the whole directory for eviction, so a bound given in JAX_COMPILATION_CACHE_MAX_SIZE
    (-1: none) stands, for a directory of many thousand entries (the test suite's).
    """
    import jax

    path = default_cache_dir()
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
            jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)


def exit_now(status: int) -> None:
    """End the process at once, quietly: for a stop while warm-up threads are inside XLA, where an
    ordinary interpreter exit would abort under them (or wait for them)."""
    sys.stdout.flush()
    sys.stderr.write("\n")  # past a progress bar's line
    sys.stderr.flush()
    os._exit(status)


STRANDED_STEP_GRACE_S = 15.0


def exit_if_a_failed_group_strands_the_step(engine, *notes: str) -> None:
    """Manual mode in a multi-process group (jtp batch, jtp generate step the engine themselves):
    when the group fails, the caller's step raises WorkerGroupError -- unless it is blocked in a
    collective on the dead peer, a wait gloo never fails. Then, after a grace period, end the
    process with the lines the step's error would have printed (rows already written are kept)."""
    group = getattr(engine, "group", None)
    if group is None:
        return

    def end_later(reason: str) -> None:
        def end() -> None:
            time.sleep(STRANDED_STEP_GRACE_S)
            for line in notes:
                note(line)
            print(f"error: the worker group failed ({reason}); retry the request", file=sys.stderr)
            exit_now(EXIT_ERROR)

        threading.Thread(target=end, name="jtp-stranded-step", daemon=True).start()

    group.on_failure(end_later)


def note(message: str) -> None:
    """A start-up / progress line for the user, on stderr so stdout stays the output."""
    print(f"jtp: {message}", file=sys.stderr, flush=True)


def open_engine(engine_args: EngineArgs) -> Engine:
    """Validate, load and report: devices, mesh, KV pool, and whether the pool caps the context."""
    engine_args.validate()
    from jtp.engine.warmup import compile_workers

    compile_workers()  # a bad $JTP_COMPILE_WORKERS fails before anything loads
    if engine_args.is_demo:
        from jtp.demo import DEMO_LABEL

        note(DEMO_LABEL)
    enable_compilation_cache()
    from jtp.engine.data_parallel import build_engine

    engine = build_engine(engine_args)  # an Engine, or N of them behind one (--data-parallel-size)
    for line in describe_engine(engine):
        note(line)
    return engine


def run_follower(engine_args: EngineArgs) -> int:
    """This process is a follower of a launch across machines (--process-id >= 1): whatever the
    command, it runs the leader's steps until told to stop."""
    from jtp.distributed.follower import run_follower as follow
    from jtp.distributed.launcher import LaunchSpec

    enable_compilation_cache()
    return follow(engine_args, LaunchSpec.resolve(engine_args))


def describe_engine(engine: Engine) -> list[str]:
    replicas = getattr(engine, "replicas", None)  # a DataParallelEngine: report its first replica, all are alike
    first = replicas[0] if replicas else engine
    mesh = first.runner.mesh
    devices = list(mesh.devices.flat)
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    platform = devices[0].platform
    pool = first.pool
    pool_tokens = pool.total_blocks * pool.block_size
    per_device = pool.total_blocks * first.runner.bytes_per_block() / 2**20
    lines = [
        f"devices: {len(devices)} x {kinds}" + ("" if kinds == platform else f" ({platform})"),
        "mesh: " + " x ".join(f"{name}={size}" for name, size in mesh.shape.items()),
        f"KV pool: {pool.total_blocks:,} blocks x {pool.block_size} = {pool_tokens:,} tokens "
        f"({per_device:,.1f} MiB per device); max_model_len {engine.max_model_len:,}",
        f"batch: up to {first.config.max_num_seqs:,} sequences and {first.config.max_num_batched_tokens:,} tokens a "
        "step (--max-num-seqs, --max-num-batched-tokens)",
    ]
    plan = getattr(first.runner, "memory_plan", None)
    if plan is not None:
        lines.insert(3, f"memory plan: {plan.summary()}")
    if replicas:
        lines.insert(0, f"data parallel: {len(replicas)} replicas, each with the devices, mesh and KV pool below")
    if pool_tokens < engine.max_model_len:
        lines.append(
            f"KV pool holds {pool_tokens:,} tokens < max_model_len {engine.max_model_len:,}: longer requests are "
            "refused (raise --num-blocks / --gpu-memory-utilization or lower --max-model-len)"
        )
    return lines
