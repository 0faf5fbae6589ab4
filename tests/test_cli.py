"""The `jtp` command line as a user meets it: real subprocesses on the demo checkpoint.

Every bad input ends in ONE `error: ...` line on stderr (start-up notes aside: they start with
`jtp: `), no traceback, and exit status 2 (usage / configuration / input) or 1. Ctrl-C exits
130 and a closed stdout 141, quietly. Most errors happen before anything compiles.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cpu_env import cpu_env
from safetensors.numpy import load_file, save_file

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.demo import DEMO_LABEL
from jtp.engine.engine import Engine
from jtp.entrypoints import cli
from jtp.entrypoints.cli_support import interrupt_guard, run_command

TENSOR = "model.layers.1.mlp.up_proj.weight"


def jtp_env(devices=1, **extra):
    env = cpu_env(devices)  # 1: what a user's shell has
    env.pop("JTP_DEBUG", None)
    return {**env, **extra}


def run_jtp(*args, stdin=None, devices=1, **env_extra):
    return subprocess.run(
        [sys.executable, "-m", "jtp.entrypoints.cli", *args], input=stdin, capture_output=True,
        env=jtp_env(devices, **env_extra), timeout=300,
    )


def assert_one_line_error(proc, expected: str, status: int = 2) -> str:
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if not line.startswith("jtp: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    assert expected in errors[0], err
    return errors[0]


# ----------------------------------------------------------------------------- the main job


def test_generate_json_matches_the_engine(demo_dir):
    # No sampling flags but a seed: the checkpoint's generation config samples (as `serve` does).
    proc = run_jtp("generate", "--json", "--max-tokens", "12", "--logprobs", "2", "--seed", "3", "Hello, world",
                   JTP_DEMO_DIR=str(demo_dir))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["note"] == DEMO_LABEL
    err = proc.stderr.decode()
    assert "jtp: devices: 1 x cpu" in err and "jtp: mesh: dp=1 x tp=1" in err and "jtp: KV pool:" in err
    engine = Engine.from_args(EngineArgs(model=demo_dir, num_blocks=64))
    assert out["prompt_token_ids"] == engine.tokenizer.encode("Hello, world")
    config = json.loads((demo_dir / "generation_config.json").read_text())
    asked = dict(temperature=config["temperature"], top_k=config["top_k"], top_p=config["top_p"])
    solo = engine.generate([out["prompt_token_ids"]], SamplingParams(max_tokens=12, seed=3, **asked))[0]
    assert out["token_ids"] == solo.token_ids
    assert out["text"] == solo.text
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]), "completion_tokens": len(solo.token_ids)}
    assert len(out["logprobs"]) == len(out["top_logprobs"]) == len(solo.token_ids)


def test_prompt_from_stdin_file_and_chat_template(demo_dir, tmp_path):
    model = ("--model", str(demo_dir), "--max-tokens", "5", "--temperature", "0")
    streamed = run_jtp("generate", *model, "--chat", "Hi")
    assert streamed.returncode == 0, streamed.stderr
    as_json = json.loads(run_jtp("generate", *model, "--chat", "--json", "-", stdin=b"Hi").stdout)
    tok = Engine.from_args(EngineArgs(model=demo_dir, num_blocks=16)).tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert as_json["prompt_token_ids"] == tok.encode(rendered)
    assert streamed.stdout.decode().rstrip("\n") == as_json["text"]

    (tmp_path / "prompt.txt").write_text("The sea\n", encoding="utf-8")  # taken exactly, newline too
    from_file = json.loads(run_jtp("generate", *model, "--json", "--prompt-file", str(tmp_path / "prompt.txt")).stdout)
    assert from_file["prompt_token_ids"] == tok.encode("The sea\n")


def test_max_model_len_caps_the_context(demo_dir):
    proc = run_jtp("generate", "--model", str(demo_dir), "--max-model-len", "64", "--max-tokens", "100", "Hi")
    assert_one_line_error(proc, "exceeds the model's context length (64)")
    assert "max_model_len 64" in proc.stderr.decode()


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def broken(demo_dir, tmp_path_factory):
    """Copies of the demo checkpoint, each broken one way."""
    root = tmp_path_factory.mktemp("broken")

    def copy(name, tensors=None, config=None):
        d = root / name
        d.mkdir()
        for f in demo_dir.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        if config:
            (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
        if tensors is None:
            (d / "model.safetensors").write_bytes((demo_dir / "model.safetensors").read_bytes())
        else:
            save_file(tensors, str(d / "model.safetensors"))
        return d

    weights = load_file(str(demo_dir / "model.safetensors"))
    dirs = {
        "llama": copy("llama", config={"model_type": "llama"}),
        "missing": copy("missing", {k: v for k, v in weights.items() if k != TENSOR}),
        "shape": copy("shape", {**weights, TENSOR: np.ascontiguousarray(weights[TENSOR][:-1])}),
        "truncated": copy("truncated"),
        "nan_eps": copy("nan_eps", config={"rms_norm_eps": float("nan")}),
        "tokenizer": copy("tokenizer"),
    }
    (dirs["tokenizer"] / "tokenizer.json").write_text("{garbage")
    data = (demo_dir / "model.safetensors").read_bytes()
    (dirs["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    return dirs


@pytest.mark.parametrize("flags, expected", [
    (["--num-blocks", "0"], "--num-blocks 0: must be at least 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: must be at least 1"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization 2.0: must be in (0, 1]"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be at least 1"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    (["--prompt-file", "/no/such/file"], "/no/such/file: No such file or directory"),
    (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ([], "give exactly one prompt"),
])
def test_bad_flags_fail_before_loading(flags, expected):
    args = ["generate", *flags] + ([] if "--prompt-file" in flags or not flags else ["Hi"])
    assert_one_line_error(run_jtp(*args), expected)


def test_non_utf8_prompt(tmp_path):
    latin1 = "café".encode("latin-1")
    (tmp_path / "p.txt").write_bytes(latin1)
    expected = "is not valid UTF-8 (byte 0xe9 at offset 3)"
    assert_one_line_error(run_jtp("generate", "-", stdin=latin1), "the prompt on stdin " + expected)
    assert_one_line_error(run_jtp("generate", "--prompt-file", str(tmp_path / "p.txt")), expected)
    assert_one_line_error(run_jtp("generate", os.fsdecode(latin1)), "the prompt argument " + expected)


@pytest.mark.parametrize("case, expected", [
    ("llama", "model_type 'llama' is not supported"),
    ("missing", f"1 expected tensor(s) are missing, e.g. '{TENSOR}'"),
    ("shape", f"1 tensor(s) have the wrong shape, e.g. '{TENSOR}' has shape [{{rows_1}}, {{cols}}] in the checkpoint, but the config implies "
              "[{rows}, {cols}]"),
    ("truncated", "lie past the end of the data"),
    ("nan_eps", "config.json: field 'rms_norm_eps' must be a finite number, got nan"),
    ("tokenizer", "tokenizer.json: not a readable tokenizers file"),
])
def test_broken_checkpoints(demo_dir, broken, case, expected):
    rows, cols = load_file(str(demo_dir / "model.safetensors"))[TENSOR].shape
    expected = expected.format(rows=rows, rows_1=rows - 1, cols=cols)
    line = assert_one_line_error(run_jtp("generate", "--model", str(broken[case]), "Hi"), expected)
    named = {"truncated": "model.safetensors", "nan_eps": "config.json", "tokenizer": "tokenizer.json"}
    if case in named:
        assert str(broken[case] / named[case]) in line


def test_bad_tensor_parallel_size(demo_dir):
    model = ("generate", "--model", str(demo_dir), "Hi")
    assert_one_line_error(run_jtp(*model, "-tp", "2"), "tensor_parallel_size=2 but 1 device(s) are visible (cpu); "
                          "on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 makes that many")
    assert_one_line_error(run_jtp(*model, "-tp", "3", devices=4),
                          "num_attention_heads (8) is not divisible by tensor_parallel_size=3")


def test_max_model_len_beyond_the_model(demo_dir):
    proc = run_jtp("generate", "--model", str(demo_dir), "--max-model-len", "100000", "Hi")
    assert_one_line_error(proc, "--max-model-len 100000: exceeds the model's max_position_embeddings (4096)")


@pytest.mark.parametrize("where", ["same", "inside", "not empty", "a file"])
def test_convert_refuses_an_output_that_would_clobber(demo_dir, tmp_path, where):
    """Checked before anything is written: the input stays as it was, one error line."""
    model = tmp_path / "model"
    shutil.copytree(demo_dir, model)
    before = sorted(p.name for p in model.rglob("*"))
    output, expected = {
        "same": (model, "is the --model directory"),
        "inside": (model / "converted", "lies inside the --model directory"),
        "not empty": (tmp_path / "other", "exists and is not empty"),
        "a file": (tmp_path / "file", "exists and is not a directory"),
    }[where]
    if where == "not empty":
        output.mkdir()
        (output / "keep.txt").write_text("mine")
    if where == "a file":
        output.write_text("mine")
    proc = run_jtp("convert", "--model", str(model), "--output", str(output))
    assert_one_line_error(proc, f"--output {output}: {expected}")
    assert sorted(p.name for p in model.rglob("*")) == before


def test_batch_file_errors(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    batch = ("batch", "--input", str(tmp_path / "in.jsonl"))
    assert_one_line_error(run_jtp(*batch, "--output", str(tmp_path / "no" / "out.jsonl")), "its directory does not exist")
    assert_one_line_error(run_jtp(*batch, "--output", str(tmp_path / "in.jsonl")), "are the same file")
    assert_one_line_error(run_jtp("batch", "--input", "/no/in.jsonl", "--output", "o.jsonl"), "no such file")


def test_debug_shows_the_traceback(broken):
    proc = run_jtp("generate", "--model", str(broken["llama"]), "Hi", JTP_DEBUG="1")
    assert proc.returncode == 2 and b"Traceback" in proc.stderr and b"error: " in proc.stderr


def test_unexpected_errors_exit_1_with_a_hint(capsys):
    with interrupt_guard():
        status = run_command(lambda args: 1 / 0, argparse.Namespace(debug=False))
    assert status == 1
    assert capsys.readouterr().err == (
        "error: ZeroDivisionError: division by zero (--debug or JTP_DEBUG=1 shows the traceback)\n"
    )


# ----------------------------------------------------------------------------- quiet exits


# The quiet-exit tests compile into a cache of their own: the suite's shared one has no lock, and a
# read racing another process's write makes JAX warn ("Error reading persistent compilation cache entry").
def test_ctrl_c_exits_130_quietly(demo_dir, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "generate", "--model", str(demo_dir), "--max-tokens", "2000", "Hello"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=jtp_env(JTP_COMPILATION_CACHE=str(tmp_path)),
    )
    for line in proc.stderr:  # interrupt once the engine is up: the first step is compiling now
        if line.startswith(b"jtp: KV pool"):
            break
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 130
    assert "Traceback" not in err and "error" not in err, err


def test_ctrl_c_swallowed_inside_a_callback_still_exits_130():
    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # what a JAX callback may do with it
        return 0

    with interrupt_guard():
        assert run_command(command, argparse.Namespace()) == 130


def test_closed_pipe_exits_quietly(demo_dir, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "jtp.entrypoints.cli", "generate", "--model", str(demo_dir), "--max-tokens", "8", "Hello"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=jtp_env(JTP_COMPILATION_CACHE=str(tmp_path)),
    )
    proc.stdout.close()  # like `| head -c0`: the first write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141
    assert "Traceback" not in err and "Exception ignored" not in err and "error" not in err, err


# ----------------------------------------------------------------------------- flags


def all_parsers():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {"jtp": parser, **{f"jtp {name}": p for name, p in subparsers.choices.items()}}
    from jtp.entrypoints.server import add_server_args

    parsers["jtp serve"] = cli.build_serve_parser(add_server_args)
    return parsers


def test_every_flag_has_help_text():
    for name, parser in all_parsers().items():
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help text"


def test_vllm_flag_names():
    flags = {s for a in all_parsers()["jtp serve"]._actions for s in a.option_strings}
    assert {"--model", "--tensor-parallel-size", "--dtype", "--max-model-len", "--gpu-memory-utilization",
            "--max-num-seqs", "--max-num-batched-tokens", "--served-model-name", "--seed", "--enable-expert-parallel",
            "--speculative-config", "--load-format"} <= flags
    gen = {s for a in all_parsers()["jtp generate"]._actions for s in a.option_strings}
    assert {"--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--stop", "--logprobs", "--seed",
            "--chat", "--json", "--prompt-file", "--repetition-penalty", "--presence-penalty", "--frequency-penalty",
            "--generation-config"} <= gen
    assert "--generation-config" in flags


def test_version_and_bench_help():
    from importlib.metadata import version

    proc = run_jtp("--version")
    assert proc.returncode == 0 and proc.stdout.decode().strip() == f"jtp {version('jtp')}"
    proc = run_jtp("bench", "--help")
    assert proc.returncode == 0 and b"--batch-sizes" in proc.stdout
