"""--model ORG/NAME: a Hugging Face repo id resolved into the HF cache, as vLLM does.

Nothing is downloaded: each test builds an HF cache (models--org--name/snapshots/<commit>/... and
refs/<branch>) in its own HF_HOME and runs the real `jtp` command with HF_HUB_OFFLINE=1, or with
the Hub's endpoint pointed at a closed local port (the Hub unreachable).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from jtp.demo import ensure_demo_checkpoint
from jtp.config.hub import looks_like_repo_id

REPO = "tiny-org/tiny-qwen3"
MAIN, V1 = "a" * 40, "b" * 40  # commit hashes of the main branch and of the tag v1


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "demo-qwen3")


def populate_cache(hf_home, source, repo=REPO, refs=(("main", MAIN),)):
    """An HF hub cache holding `source`'s files as snapshots of `repo` (a copy per commit)."""
    org, name = repo.split("/")
    storage = hf_home / "hub" / f"models--{org}--{name}"
    for ref, commit in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
        shutil.copytree(source, storage / "snapshots" / commit, dirs_exist_ok=True)
    return storage


def run_jtp(tmp_path, *args, offline=True, **env_extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HOME=str(tmp_path / "hf"), **env_extra)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "JTP_DEBUG"):
        env.pop(key, None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "jtp.entrypoints.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("jtp: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    return errors[0]


def test_repo_id_from_the_offline_cache_generates_like_the_directory(tmp_path, demo_dir):
    populate_cache(tmp_path / "hf", demo_dir)
    flags = ("--max-tokens", "6", "--json", "The quick brown fox")
    by_id = run_jtp(tmp_path, "generate", "--model", REPO, *flags)
    assert by_id.returncode == 0, by_id.stderr
    by_dir = run_jtp(tmp_path, "generate", "--model", str(demo_dir), *flags)
    record = json.loads(by_id.stdout)
    assert record["model"] == REPO  # the name a client sees is the repo id, as in vLLM
    assert record["token_ids"] == json.loads(by_dir.stdout)["token_ids"]


def test_revision_picks_that_snapshot(tmp_path, demo_dir):
    storage = populate_cache(tmp_path / "hf", demo_dir, refs=(("main", MAIN), ("v1", V1)))
    (storage / "snapshots" / V1 / "config.json").write_text("{not json")  # tells the snapshots apart
    proc = run_jtp(tmp_path, "generate", "--model", REPO, "--revision", "v1", "Hi")
    assert f"snapshots/{V1}/config.json: not valid JSON" in one_error_line(proc)


def test_not_in_the_cache_offline(tmp_path):
    proc = run_jtp(tmp_path, "generate", "--model", "Qwen/Qwen3-0.6B", "Hi")
    line = one_error_line(proc)
    assert "--model Qwen/Qwen3-0.6B: no such directory, and not in the Hugging Face cache" in line
    assert "HF_HUB_OFFLINE=1" in line


def test_hub_unreachable(tmp_path):
    # Online, but the Hub's address is a closed local port: a connection error, nothing cached.
    proc = run_jtp(tmp_path, "generate", "--model", "Qwen/Qwen3-0.6B", "Hi", offline=False,
                   HF_ENDPOINT="http://127.0.0.1:9")
    assert "the Hugging Face Hub cannot be reached and the repo is not in its cache" in one_error_line(proc)


@pytest.mark.parametrize("model, repo_id", [
    ("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("org/name.v2", True),
    ("/abs/path", False), ("./rel", False), ("a/b/c", False), ("~/models/x", False), ("org--x/y", False),
])
def test_what_counts_as_a_repo_id(model, repo_id):
    assert looks_like_repo_id(model) is repo_id
