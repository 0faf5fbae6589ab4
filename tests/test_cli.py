"""The README's main job: `jtp generate` on the demo checkpoint, as a real subprocess."""

import json
import os
import subprocess
import sys

import pytest

from jtp.demo import DEMO_LABEL, ensure_demo_checkpoint
from jtp.engine import Engine
from jtp.sampling import SamplingParams


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-qwen3")


def run_jtp(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("XLA_FLAGS", None)  # one CPU device, like a user's shell
    return subprocess.run([sys.executable, "-m", "jtp.cli", *args], capture_output=True, text=True, env=env, timeout=300)


def test_generate_json_matches_the_engine(demo_dir):
    proc = run_jtp("generate", "--json", "--max-tokens", "12", "Hello, world", env_extra={"JTP_DEMO_DIR": str(demo_dir)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["note"] == DEMO_LABEL
    engine = Engine(demo_dir, num_blocks=64)
    assert out["prompt_token_ids"] == engine.tokenizer.encode("Hello, world")
    solo = engine.generate([out["prompt_token_ids"]], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out["token_ids"] == solo.token_ids
    assert out["text"] == solo.text
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]), "completion_tokens": len(solo.token_ids)}


def test_generate_streams_text_and_chat_template(demo_dir):
    proc = run_jtp("generate", "--model", str(demo_dir), "--chat", "--max-tokens", "5", "Hi")
    assert proc.returncode == 0, proc.stderr
    proc_json = run_jtp("generate", "--model", str(demo_dir), "--chat", "--json", "--max-tokens", "5", "Hi")
    out = json.loads(proc_json.stdout)
    tok = Engine(demo_dir, num_blocks=16).tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert out["prompt_token_ids"] == tok.encode(rendered)
    assert proc.stdout.rstrip("\n") == out["text"]


def test_bad_request_is_a_clear_error(demo_dir):
    proc = run_jtp("generate", "--model", str(demo_dir), "--max-tokens", "999999", "Hi")
    assert proc.returncode == 2
    assert "exceeds the model's context length" in proc.stderr
