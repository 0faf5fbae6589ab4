"""Offline batch generation (jtp/entrypoints/batch.py, scripts/generate_offline.py) on the demo checkpoint.

The batch results are checked against independent runs: each prompt alone through a fresh
`engine.generate` call, tokenized by a separately loaded Tokenizer.
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_env import cpu_env

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.demo import ensure_demo_checkpoint
from jtp.engine.engine import Engine
from jtp.engine.tokenizer import Tokenizer
from jtp.entrypoints import batch
from jtp.errors import ConfigError, WorkerGroupError

REPO = Path(__file__).resolve().parents[1]
WORDS = "the sea is wide and deep it sings sailors off to sleep rain in Spain stays mainly on plain".split()
BAD_JSON_LINE, BAD_TEMP_LINE = 17, 60  # 1-based lines of the two bad inputs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("batch") / "demo-qwen3")


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine.from_args(EngineArgs(model=ckpt, num_blocks=512, max_num_seqs=16))


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


def make_requests(n=100, seed=0):
    """Greedy requests of mixed lengths; every 10th is a chat; two lines are bad."""
    rng = random.Random(seed)
    lines = []
    for i in range(1, n + 1):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        req = {"id": f"r{i}", "max_tokens": rng.randint(1, 24), "temperature": 0}
        if i % 10 == 0:
            req["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{i}: {words}"}]
        else:
            req["prompt"] = f"{i}: {words}"  # the number keeps prompts unique
        if i == BAD_TEMP_LINE:
            req["temperature"] = -1
        lines.append(json.dumps(req) if i != BAD_JSON_LINE else '{"id": "r17", "prompt": "cut short')
    return lines


def prompt_text(req, tok):
    if "messages" in req:
        return tok.apply_chat_template(req["messages"], add_generation_prompt=True)
    return req["prompt"]


def read_rows(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def write_lines(path, lines):
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def full_run(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    lines = make_requests()
    inp = write_lines(d / "in.jsonl", lines)
    # Watch the engine: requests must really run together, and no more than max_pending at once.
    peak = {"running": 0, "outstanding": 0}
    real_step = engine.step

    def watched_step():
        sched = engine.scheduler
        peak["running"] = max(peak["running"], len(sched.running))
        peak["outstanding"] = max(peak["outstanding"], len(sched.running) + len(sched.waiting))
        return real_step()

    engine.step = watched_step
    try:
        stats = batch.run(engine, inp, d / "out.jsonl", max_pending=24)
    finally:
        del engine.step  # back to the class method
    assert peak == {"running": 16, "outstanding": 24}
    return lines, stats, read_rows(d / "out.jsonl")


def test_results_match_solo_runs(full_run, engine, tok):
    lines, stats, rows = full_run
    assert (stats.ok, stats.errors, stats.skipped) == (98, 2, 0)
    assert stats.tokens == sum(r["usage"]["completion_tokens"] for r in rows if "error" not in r) > 0
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows) == 100

    errors = {r["id"]: r["error"] for r in rows if "error" in r}
    assert set(errors) == {f"line:{BAD_JSON_LINE}", f"r{BAD_TEMP_LINE}"}
    assert errors[f"line:{BAD_JSON_LINE}"].startswith(f"line {BAD_JSON_LINE}: invalid JSON")
    assert "temperature must be a finite number >= 0, got -1" in errors[f"r{BAD_TEMP_LINE}"]

    reqs = [json.loads(line) for i, line in enumerate(lines, 1) if i not in (BAD_JSON_LINE, BAD_TEMP_LINE)]
    eos = set(tok.eos_token_ids)
    for req in reqs:
        row = by_id[req["id"]]
        ids = tok.encode(prompt_text(req, tok))
        assert row["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(row["token_ids"])}
        assert 1 <= len(row["token_ids"]) <= req["max_tokens"]
        stopped = row["token_ids"][-1] in eos
        assert row["finish_reason"] == ("stop" if stopped else "length")
        assert stopped or len(row["token_ids"]) == req["max_tokens"]
        assert row["text"] == tok.decode(row["token_ids"])

    # Solo greedy reruns: a sample with the shortest/longest budgets and both input kinds.
    sample = sorted(reqs, key=lambda r: r["max_tokens"])[:3] + sorted(reqs, key=lambda r: r["max_tokens"])[-3:]
    sample += [r for r in reqs if "messages" in r][:2] + random.Random(1).sample(reqs, 4)
    for req in sample:
        ids = tok.encode(prompt_text(req, tok))
        solo = engine.generate([ids], SamplingParams(max_tokens=req["max_tokens"], temperature=0))[0]
        assert by_id[req["id"]]["token_ids"] == solo.token_ids, req["id"]


def test_messages_get_the_chat_template(full_run, tok):
    lines, _, rows = full_run
    by_id = {r["id"]: r for r in rows}
    req = json.loads(lines[9])  # line 10 is a chat
    rendered = tok.apply_chat_template(req["messages"], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n") and "be brief" in rendered
    assert by_id[req["id"]]["usage"]["prompt_tokens"] == len(tok.encode(rendered))
    assert len(tok.encode(rendered)) > len(tok.encode(req["messages"][1]["content"])) + 5


def test_resume_after_interruption(full_run, engine, tok, tmp_path, monkeypatch):
    lines, _, full_rows = full_run
    expected = {r["id"]: r for r in full_rows}
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"

    first = batch.run(engine, inp, out, limit=40)
    assert first.ok + first.errors == 40
    # Simulate a kill mid-write: the last row is cut in half (no newline).
    data = out.read_bytes()
    rows_before = data.splitlines()
    last_start = len(data) - len(rows_before[-1]) - 1
    out.write_bytes(data[: last_start + len(rows_before[-1]) // 2])
    kept = {json.loads(r)["id"] for r in rows_before[:-1]}
    cut_id = json.loads(rows_before[-1])["id"]

    prompt_to_id = {}
    for line in lines:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        prompt_to_id[tuple(tok.encode(prompt_text(req, tok)))] = req["id"]
    submitted = []
    real_submit = engine.submit

    def counting_submit(prompt_ids, params=None, request_id=None):
        submitted.append(prompt_to_id[tuple(prompt_ids)])
        return real_submit(prompt_ids, params, request_id)

    monkeypatch.setattr(engine, "submit", counting_submit)
    second = batch.run(engine, inp, out)
    servable = {r["id"] for r in full_rows if "error" not in r}
    assert sorted(submitted) == sorted(servable - kept)  # only the missing ones, each once
    assert cut_id in submitted or cut_id not in servable
    assert second.skipped == len(kept)

    final = read_rows(out)  # every line parses: the half row is gone
    assert sorted(r["id"] for r in final) == sorted(expected)  # exactly one row per input id
    for r in final:  # greedy: the same rows as the uninterrupted run
        assert r == expected[r["id"]]

    submitted.clear()
    third = batch.run(engine, inp, out)
    assert submitted == [] and (third.ok, third.errors, third.skipped) == (0, 0, 100)
    assert len(read_rows(out)) == 100


def test_bad_lines_become_error_rows(engine, tmp_path):
    good = {"prompt": "the sea", "max_tokens": 3, "temperature": 0}
    lines = [
        json.dumps({"id": "ok1", **good}),
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
        json.dumps({"id": "neither", "max_tokens": 3}),
        json.dumps({"id": "unknown", "prompt": "a", "beam_width": 4}),
        json.dumps({"id": "too-long", "prompt": "a", "max_tokens": 5000}),
        json.dumps({"id": "empty", "prompt": ""}),
        json.dumps({"id": ["list"], "prompt": "a"}),
        json.dumps(["not", "an", "object"]),
        "",  # blank lines are skipped, not errors
        '{"id": "cut", "prompt": "the s',  # malformed: cut short
        json.dumps({"id": 7, "messages": "hi"}),
        json.dumps({"id": "ok2", **good, "stop": ["zz"], "logprobs": 2}),
    ]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    stats = batch.run(engine, inp, tmp_path / "out.jsonl")
    rows = read_rows(tmp_path / "out.jsonl")
    assert (stats.ok, stats.errors) == (2, 10) and len(rows) == 12
    err = {r["id"]: r["error"] for r in rows if "error" in r}
    assert err["line:2"] == "line 2: missing 'id'"
    assert "exactly one of 'prompt' or 'messages', got both" in err["both"]
    assert "got neither" in err["neither"]
    assert "unknown sampling parameter(s): beam_width" in err["unknown"]
    assert err["too-long"].startswith("line 6: prompt") and "exceeds the model's context length" in err["too-long"]
    assert "prompt is empty" in err["empty"]
    assert "'id' must be a string or an integer" in err["line:8"]
    assert "expected a JSON object, got list" in err["line:9"]
    assert err[7] == "line 12: 'messages' must be a non-empty list of objects"
    # One line number in a malformed line's row, 1-based, in its id and its message alike (json's
    # own "line 1 column 23" named another line).
    assert err["line:11"] == "line 11: invalid JSON (Unterminated string starting at column 25)"
    ok2 = next(r for r in rows if r["id"] == "ok2")
    assert len(ok2["logprobs"]) == len(ok2["token_ids"]) and all(len(t) == 2 for t in ok2["top_logprobs"])

    assert len({r["id"] for r in rows}) == len(rows)
    # Resume: nothing is missing, so nothing is written.
    again = batch.run(engine, inp, tmp_path / "out.jsonl")
    assert (again.ok, again.errors, again.skipped) == (0, 0, 12)


def test_prompt_logprobs_reach_the_row(engine, tok, tmp_path):
    """A line that asks for prompt_logprobs gets them (they were computed, then dropped): per prompt
    token, None for the first, else {token id: logprob} holding the prompt token and the top n, as
    the engine scores the same prompt alone."""
    line = {"id": "p", "prompt": "the sea is wide", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    batch.run(engine, write_lines(tmp_path / "in.jsonl", [json.dumps(line)]), tmp_path / "out.jsonl")
    (row,) = read_rows(tmp_path / "out.jsonl")
    ids = tok.encode(line["prompt"])
    (solo,) = engine.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    scores = solo.prompt_logprobs
    assert len(row["prompt_logprobs"]) == len(ids) > 1 and row["prompt_logprobs"][0] is None
    for k in range(1, len(ids)):
        expected = {str(t): lp for t, lp in scores.top[k].items()} | {str(ids[k]): scores.logprobs[k]}
        assert row["prompt_logprobs"][k] == pytest.approx(expected, abs=1e-5), k


def test_more_pending_lines_than_the_waiting_queue_holds(ckpt, engine, tok, tmp_path):
    """Pending lines (4 x max_num_seqs) past max_waiting_requests (--max-num-seqs 300 against the
    default 1024) must wait for room, not become "retry later" error rows that a rerun keeps."""
    small = Engine.from_args(EngineArgs(model=ckpt, num_blocks=64, max_num_seqs=2, max_waiting_requests=3))
    lines = [json.dumps({"id": i, "prompt": f"the sea {i}", "max_tokens": 2, "temperature": 0}) for i in range(10)]
    try:
        stats = batch.run(small, write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl")
    finally:
        small.close()
    assert (stats.ok, stats.errors) == (10, 0)
    for row in read_rows(tmp_path / "out.jsonl"):
        (solo,) = engine.generate([tok.encode(f"the sea {row['id']}")], SamplingParams(max_tokens=2, temperature=0))
        assert row["token_ids"] == solo.token_ids


def test_half_row_with_complete_json_is_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "text": ""}\n{"id": "b", "error": "x"}', encoding="utf-8")
    assert batch.load_done(out) == {'"a"': 1, '"b"': 1}
    assert out.read_text().endswith('"x"}\n')
    out.write_text('{"id": "a", "text": ""}\n{"id": "b", "te', encoding="utf-8")
    assert batch.load_done(out) == {'"a"': 1}
    assert out.read_text() == '{"id": "a", "text": ""}\n'


def test_script_end_to_end(ckpt, engine, tok, tmp_path):
    reqs = [
        {"id": "s1", "prompt": "The rain in Spain", "max_tokens": 5, "temperature": 0},
        {"id": 2, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0},
        {"id": "s3", "prompt": "x", "top_p": 0},
    ]
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in reqs])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, str(REPO / "scripts" / "generate_offline.py"), "--model", str(ckpt),
           "--input", str(inp), "--output", str(out), "--max-num-seqs", "4", "--num-blocks", "64"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "2 ok, 1 errors" in proc.stderr and "tokens/s" in proc.stderr
    rows = {r["id"]: r for r in read_rows(out)}
    assert "top_p must be in (0, 1]" in rows["s3"]["error"]
    for req in reqs[:2]:
        ids = tok.encode(prompt_text(req, tok))
        solo = engine.generate([ids], SamplingParams(max_tokens=req["max_tokens"], temperature=0))[0]
        assert rows[req["id"]]["token_ids"] == solo.token_ids


def test_cli_has_batch_subcommand(capsys):
    from jtp.entrypoints import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(["batch", "--help"])
    assert exc.value.code == 0
    assert "--input" in capsys.readouterr().out


def test_repeated_ids_are_refused_before_running(engine, tmp_path):
    """As custom_id in an OpenAI batch: ids are unique, or nothing runs (no row could say which line it is)."""
    lines = [json.dumps({"id": i, "prompt": f"the sea {n}", "max_tokens": 3}) for n, i in enumerate("abac")]
    lines.append("not json")  # its row would be line:5 ...
    lines.append(json.dumps({"id": "line:5", "prompt": "x"}))  # ... which this id takes already
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    with pytest.raises(ConfigError) as e:
        batch.run(engine, inp, out)
    assert str(e.value) == (f"{inp}: line 3 repeats the id 'a' of line 1 (1 more repeated); ids must be unique "
                            "(as custom_id in an OpenAI batch), nothing was run")
    assert not out.exists()
    write_lines(inp, lines[:2] + lines[3:4])
    assert batch.run(engine, inp, out).ok == 3


def test_non_utf8_line_names_its_column(engine, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"id": "ok", "prompt": "the sea", "max_tokens": 2}\n{"id": "caf\xe9"}\n')
    batch.run(engine, inp, tmp_path / "out.jsonl")
    err = {r["id"]: r["error"] for r in read_rows(tmp_path / "out.jsonl") if "error" in r}
    assert err == {"line:2": "line 2: not valid UTF-8 (byte 0xe9 at column 12)"}


def test_a_byte_order_mark_opens_the_input(engine, tmp_path):
    """UTF-8 with a BOM (what Windows PowerShell's utf8 writes): the first line is a request like the rest."""
    lines = [json.dumps({"id": i, "prompt": f"the sea {i}", "max_tokens": 3, "temperature": 0}) for i in "ab"]
    plain = write_lines(tmp_path / "plain.jsonl", lines)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    rows = {}
    for inp in (plain, marked):
        batch.run(engine, inp, tmp_path / f"{inp.stem}-out.jsonl")
        rows[inp.stem] = {r["id"]: r for r in read_rows(tmp_path / f"{inp.stem}-out.jsonl")}
    assert rows["marked"] == rows["plain"] and set(rows["plain"]) == {"a", "b"}
    assert all("error" not in r for r in rows["plain"].values())


def test_unset_fields_take_the_generation_config(engine, tok, ckpt, tmp_path):
    line = {"id": "g", "prompt": "The rain in Spain", "max_tokens": 8, "seed": 5}  # no temperature, top-k, top-p
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(line)])
    batch.run(engine, inp, tmp_path / "out.jsonl")
    row = read_rows(tmp_path / "out.jsonl")[0]
    config = json.loads((Path(ckpt) / "generation_config.json").read_text())
    asked = SamplingParams(max_tokens=8, seed=5, temperature=config["temperature"], top_k=config["top_k"],
                           top_p=config["top_p"])
    assert asked.temperature > 0  # the demo's config samples, so a greedy default would differ
    solo = engine.generate([tok.encode(line["prompt"])], asked)[0]
    assert row["token_ids"] == solo.token_ids
    plain = engine.generate([tok.encode(line["prompt"])], SamplingParams(max_tokens=8, seed=5))[0]
    assert plain.token_ids != solo.token_ids  # SamplingParams' own defaults would have given other tokens


def test_progress_lines_without_a_terminal(engine, tmp_path, capsys):
    lines = [json.dumps({"id": n, "prompt": "the sea", "max_tokens": 2}) for n in range(3)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    batch.run(engine, inp, tmp_path / "out.jsonl", progress_every=0)  # capsys' stderr is no terminal
    err = capsys.readouterr().err
    assert "jtp: batch: 3/3 rows" in err and "tokens/s" in err


def test_interrupt_swallowed_by_a_callback_still_stops_the_run(engine, tmp_path, monkeypatch):
    """Ctrl-C landing inside a JAX callback may never reach us as KeyboardInterrupt: the run stops anyway."""
    import signal

    from jtp.entrypoints.cli_support import interrupt_guard

    lines = [json.dumps({"id": n, "prompt": f"the sea {n}", "max_tokens": 4}) for n in range(40)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    real_step, steps = engine.step, []

    def step_that_swallows_ctrl_c():
        steps.append(1)
        if len(steps) == 12:  # some rows are written by then
            try:
                os.kill(os.getpid(), signal.SIGINT)  # the handler raises here, inside "the callback"...
            except KeyboardInterrupt:
                pass  # ...which turns it into nothing
        return real_step()

    monkeypatch.setattr(engine, "step", step_that_swallows_ctrl_c)
    with interrupt_guard(), pytest.raises(KeyboardInterrupt):
        batch.run(engine, inp, out, max_pending=4)
    monkeypatch.undo()
    engine.stop()  # drop what the interrupted run left in flight
    written = len(read_rows(out))
    assert 0 < written < 40
    rest = batch.run(engine, inp, out)
    assert rest.skipped == written and sorted(r["id"] for r in read_rows(out)) == list(range(40))


def test_a_failed_worker_group_stops_the_run_instead_of_writing_error_rows(engine, tmp_path, monkeypatch):
    """A group that fails between steps refuses the next submit (WorkerGroupError): the engine failed,
    not the line, so the run stops there and a rerun serves the rest (error rows are never retried)."""
    lines = [json.dumps({"id": n, "prompt": f"the sea {n}", "max_tokens": 4}) for n in range(40)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    real_submit, calls = engine.submit, []

    def submit_until_the_group_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) > 12:
            raise WorkerGroupError("the worker group failed (follower 1 (pid 4242) killed by SIGKILL); retry the request")
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(engine, "submit", submit_until_the_group_fails)
    with pytest.raises(WorkerGroupError):
        batch.run(engine, inp, out, max_pending=4)
    monkeypatch.undo()
    engine.stop()  # drop what the failed run left in flight
    written = read_rows(out)
    assert len(written) < 40 and not [r for r in written if "error" in r]
    rest = batch.run(engine, inp, out)
    rows = read_rows(out)
    assert rest.skipped == len(written) and sorted(r["id"] for r in rows) == list(range(40))
    assert not [r for r in rows if "error" in r]


def test_ctrl_c_exits_130_and_the_rerun_finishes(ckpt, tmp_path):
    import signal
    import time

    lines = [json.dumps({"id": n, "prompt": f"the sea {n}", "max_tokens": 24, "ignore_eos": True}) for n in range(64)]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "jtp.entrypoints.cli", "batch", "--model", str(ckpt), "--input", str(inp), "--output", str(out),
           "--max-num-seqs", "2", "--num-blocks", "64"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=cpu_env(1), text=True)
    deadline = time.monotonic() + 240
    while not (out.exists() and out.read_text().count("\n") >= 2):  # interrupt mid-run
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted: the rows written so far are in" in err
    written = len(read_rows(out))
    assert 2 <= written < 64

    proc = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(1), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{written} skipped" in proc.stderr
    assert sorted(r["id"] for r in read_rows(out)) == list(range(64))
