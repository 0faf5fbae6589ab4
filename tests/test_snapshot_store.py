"""Snapshots on disk (jtp.engine.snapshot_store): saved by one engine, loaded by a fresh one after a
"restart", a restore continues with exactly the tokens the uninterrupted run gives and prefills
only the tail; an engine of another model, weights, dtype, block size or mesh is refused with a
clear error and left exactly as it was; a failed save leaves nothing behind."""

import json
import shutil

import numpy as np
import pytest

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine
from jtp.engine.snapshot_store import load_snapshots, read_metadata, save_snapshots
from jtp.errors import ConfigError, RequestError
from jtp.worker.kv_cache import METADATA_FILE

KW = dict(dtype="float32", num_blocks=96, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
          skip_tokenizer_init=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(path, **over) -> Engine:
    engine = Engine.from_args(EngineArgs(model=path, **{**KW, **over}))
    if getattr(engine, "model_dir", None) is None:  # until Engine records it itself
        engine.model_dir = path
    return engine


def generate_and_snapshot(engine: Engine, prompt: list[int]) -> tuple[list[int], str]:
    """Greedy tokens for `prompt`, and a snapshot of prompt + output taken as it finishes."""
    rid, out, sid = engine.submit(prompt, GREEDY), [], None
    for event in engine.stream(rid):
        out += event.token_ids
        if event.finished:
            sid = engine.snapshot(rid)
    return out, sid


def restore_tokens(engine: Engine, sid: str, extra: list[int]):
    """Tokens of a greedy continuation from the snapshot plus `extra`, and its finished event."""
    events = list(engine.stream(engine.restore(sid, extra, GREEDY)))
    return [t for e in events for t in e.token_ids], events[-1]


def state(engine: Engine):
    """Everything a refused load must leave as it was."""
    states = None
    if engine.states is not None:
        states = (engine.states.available(), engine.states.num_cached, engine.states.num_reserved)
    return engine.pool.usage(), [(s.id, s.blocks, s.state_slot) for s in engine.list_snapshots()], states


@pytest.fixture(scope="module")
def demo(demo_dir):
    return demo_dir


@pytest.fixture(scope="module")
def saved(demo, tmp_path_factory):
    """Engine A (kept open for the save tests): a generation, two snapshots sharing a prefix, A's
    own continuations from them, and the snapshots saved to disk."""
    engine = make_engine(demo)
    prompt = list(range(10, 40))
    out, sid = generate_and_snapshot(engine, prompt)
    short = engine.snapshot(tokens=prompt[:17])  # 16 cached tokens: the first 4 blocks of `sid`'s
    extra = [5, 6, 7]
    ref, _ = restore_tokens(engine, sid, extra)
    ref_short, _ = restore_tokens(engine, short, extra)
    snaps = {s.id: s for s in engine.list_snapshots()}
    path = save_snapshots(engine, tmp_path_factory.mktemp("saved") / "snaps")
    yield dict(engine=engine, path=path, prompt=prompt, out=out, extra=extra, ids=[sid, short], refs=[ref, ref_short],
               snaps=[snaps[sid], snaps[short]])
    engine.close()


def test_restore_after_restart_continues_exactly(demo, saved):
    engine = make_engine(demo)
    ids = load_snapshots(engine, saved["path"])
    assert ids == saved["ids"]  # the saved ids are kept (this engine has none of those names)
    loaded = {s.id: s for s in engine.list_snapshots()}
    for sid, before in zip(ids, saved["snaps"]):
        assert loaded[sid].tokens == before.tokens
        assert loaded[sid].num_cached_tokens == before.num_cached_tokens > 0
    # Shared blocks are saved and loaded once: the short snapshot's blocks are the long one's first.
    long, short = (loaded[i] for i in ids)
    assert short.blocks == long.blocks[: len(short.blocks)]
    assert engine.pool.num_used_blocks == len(long.blocks)
    engine.pool.check_invariants()

    seq = saved["prompt"] + saved["out"] + saved["extra"]
    tokens, finished = restore_tokens(engine, ids[0], saved["extra"])
    assert tokens == saved["refs"][0]
    assert finished.cached_tokens == long.num_cached_tokens
    assert engine.stats().prompt_tokens_computed == len(seq) - long.num_cached_tokens
    tokens, finished = restore_tokens(engine, ids[1], saved["extra"])
    assert tokens == saved["refs"][1]
    assert finished.cached_tokens == short.num_cached_tokens

    # ... and it is the uninterrupted, uncached run's continuation.
    plain = make_engine(demo, enable_prefix_caching=False)
    assert plain.generate([seq], GREEDY)[0].token_ids == saved["refs"][0]
    plain.close()
    for sid in ids:
        engine.drop(sid)
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0
    engine.close()


def test_load_twice_shares_blocks_and_issues_new_ids(demo, saved):
    engine = make_engine(demo)
    first = load_snapshots(engine, saved["path"])
    used = engine.pool.num_used_blocks
    second = load_snapshots(engine, saved["path"])
    assert not set(first) & set(second) and len(engine.list_snapshots()) == 4
    assert engine.pool.num_used_blocks == used  # everything was already cached: nothing new written
    engine.pool.check_invariants()
    for sid in first + second:
        engine.drop(sid)
    assert engine.pool.num_used_blocks == 0
    engine.pool.check_invariants()
    engine.close()


@pytest.fixture(scope="module")
def other_models(demo, tmp_path_factory):
    """Copies of the demo checkpoint: one with another config, one with other weights (same shapes)."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("others")
    config_dir, weights_dir = root / "config", root / "weights"
    shutil.copytree(demo, config_dir)
    shutil.copytree(demo, weights_dir)
    cfg = json.loads((config_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (config_dir / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(weights_dir / "model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
    tensors[name] = (tensors[name] * 1.01).astype(tensors[name].dtype)  # a "fine-tune" of one tensor
    save_file(tensors, weights_dir / "model.safetensors", metadata={"format": "pt"})
    return {"config": config_dir, "weights": weights_dir}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("dtype", r"saved with dtype float32, this engine runs bfloat16"),
        ("block_size", r"saved with block_size 4, this engine uses 8"),
        ("tp", r"saved on a mesh of dp=1 x tp=1 \(1 process\), this engine runs on dp=1 x tp=2"),
        ("config", r"saved from a different model config \(rms_norm_eps: saved 1e-06, this engine 1e-05\)"),
        ("weights", r"saved from different weights"),
    ],
)
def test_load_into_a_different_engine_is_refused(demo, saved, other_models, case, expected):
    path = {"config": other_models["config"], "weights": other_models["weights"]}.get(case, demo)
    over = {"dtype": {"dtype": "bfloat16"}, "block_size": {"block_size": 8}, "tp": {"tensor_parallel_size": 2}}
    engine = make_engine(path, **over.get(case, {}))
    pinned = engine.snapshot(tokens=list(range(50, 60))) if case == "weights" else None  # a busy engine
    before = state(engine)
    with pytest.raises(ConfigError, match=expected) as err:
        load_snapshots(engine, saved["path"])
    assert str(saved["path"]) in str(err.value)
    assert state(engine) == before
    engine.pool.check_invariants()
    if pinned:
        engine.drop(pinned)
    engine.close()


def test_load_refused_when_it_cannot_fit(demo, saved, tmp_path, monkeypatch):
    engine = make_engine(demo, num_blocks=16, snapshot_budget_bytes=1 << 30)
    engine.pool.reserve(("someone", 0), 40)  # 10 of 16 blocks promised elsewhere; the load needs 9
    before = state(engine)
    with pytest.raises(RequestError, match="cannot take 9 more blocks now"):
        load_snapshots(engine, saved["path"])
    assert state(engine) == before
    engine.pool.free(("someone", 0))
    engine.pool.check_invariants()
    engine.close()

    # A device failure while writing the pages undoes the allocation: nothing half-made.
    engine = make_engine(demo, snapshot_budget_bytes=1 << 30)
    before = state(engine)

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "scatter_pages", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        load_snapshots(engine, saved["path"])
    assert state(engine) == before
    engine.pool.check_invariants()
    monkeypatch.undo()
    assert len(load_snapshots(engine, saved["path"])) == 2  # and a later load works
    engine.close()

    engine = make_engine(demo, max_snapshots=1)
    with pytest.raises(RequestError, match="exceed the engine's snapshot limits"):
        load_snapshots(engine, saved["path"])
    assert len(engine.list_snapshots()) == 0 and engine.pool.num_used_blocks == 0
    with pytest.raises(ConfigError, match="not a saved snapshot directory"):
        load_snapshots(engine, tmp_path)
    engine.close()


def test_save_is_atomic(saved, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    engine = saved["engine"]
    with pytest.raises(FileExistsError):
        save_snapshots(engine, saved["path"])

    target = tmp_path / "snaps"

    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ocp.StandardCheckpointer, "save", broken)
        with pytest.raises(OSError, match="disk full"):
            save_snapshots(engine, target)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staging directory

    # One snapshot, then replace it with both: the metadata says exactly what is there.
    save_snapshots(engine, target, [saved["ids"][1]])
    meta = read_metadata(target)
    assert [s["id"] for s in meta["snapshots"]] == [saved["ids"][1]] and len(meta["blocks"]) == 4
    save_snapshots(engine, target, overwrite=True)
    meta = read_metadata(target)
    assert [s["id"] for s in meta["snapshots"]] == saved["ids"]
    assert meta["snapshots"][1]["blocks"] == meta["snapshots"][0]["blocks"][:4]  # shared blocks saved once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snaps"]
    assert (target / METADATA_FILE).is_file()


# ----------------------------------------------------------------------------- integrity on disk


def tampered_copies(engine: Engine, prompt: list[int], root) -> dict:
    """Two saves of one 4-block snapshot each (different tokens, same array shapes), and copies of
    the first with the second's arrays, with the second's metadata, and with its metadata edited."""
    own, other = engine.snapshot(tokens=prompt[:17]), engine.snapshot(tokens=list(range(100, 117)))
    first = save_snapshots(engine, root / "first", [own])
    second = save_snapshots(engine, root / "second", [other])
    engine.drop(other)
    engine.drop(own)
    copies = {}
    for name in ("arrays", "metadata", "edited", "v1"):
        copies[name] = root / name
        shutil.copytree(first, copies[name])
    shutil.rmtree(copies["arrays"] / "arrays")
    shutil.copytree(second / "arrays", copies["arrays"] / "arrays")
    shutil.copy(second / METADATA_FILE, copies["metadata"] / METADATA_FILE)
    for name, edit in (("edited", {"created": 0.0}), ("v1", {})):
        meta = json.loads((copies[name] / METADATA_FILE).read_text())
        meta["snapshots"][0].update(edit)
        if name == "v1":  # what a save from before the digests looks like
            meta = {k: v for k, v in meta.items() if k not in ("files", "digest")} | {"version": 1}
        (copies[name] / METADATA_FILE).write_text(json.dumps(meta))
    return copies


def test_tampered_snapshot_directory_is_refused_and_the_cache_stays_clean(demo, saved, tmp_path):
    a, prompt = saved["engine"], saved["prompt"]
    copies = tampered_copies(a, prompt, tmp_path)
    follow = prompt[:17] + [5, 6, 7]  # starts with the 4 blocks the tampered saves claim to hold
    solo, _ = run(a, follow)

    b = make_engine(demo)
    before = state(b)
    refusals = {
        "arrays": (copies["arrays"] / "arrays", "copied from another save"),
        "metadata": (copies["metadata"] / "arrays", "copied from another save"),
        "edited": (copies["edited"] / METADATA_FILE, "do not match its digest"),
        "v1": (copies["v1"] / METADATA_FILE, "format version 1, saved before snapshots carried digests"),
    }
    for name, (named, reason) in refusals.items():
        with pytest.raises(ConfigError, match=reason) as err:
            load_snapshots(b, copies[name])
        assert str(named) in str(err.value), name
        assert state(b) == before and b.pool.num_cached_blocks == 0, name
    tokens, finished = run(b, follow)
    assert finished.cached_tokens == 0 and tokens == solo
    b.close()


def test_malformed_snapshot_metadata_names_the_file(saved, tmp_path):
    from jtp.core.snapshot_digests import metadata_digest

    path = shutil.copytree(saved["path"], tmp_path / "bad")
    file = path / METADATA_FILE
    file.write_bytes(b"\xff not json")
    with pytest.raises(ConfigError, match="unreadable") as err:
        read_metadata(path)
    assert str(file) in str(err.value)
    meta = json.loads((saved["path"] / METADATA_FILE).read_text())
    meta["snapshots"][0]["tokens"] = "abc"
    meta["blocks"][0] = "not hex"
    meta["digest"] = metadata_digest(meta)  # resealed: the types are still checked
    file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"malformed field\(s\) blocks, snapshots\[0\]") as err:
        read_metadata(path)
    assert str(file) in str(err.value)


def test_hybrid_restore_after_restart(hybrid_qwen3_5_dir, tmp_path):
    model_dir = hybrid_qwen3_5_dir
    rng = np.random.default_rng(3)
    prompt, extra = rng.integers(0, 128, 23).tolist(), rng.integers(0, 128, 5).tolist()

    a = make_engine(model_dir)
    out, sid = generate_and_snapshot(a, prompt)
    snap = a.list_snapshots()[0]
    assert snap.state_slot >= 0 and snap.num_cached_tokens > 0
    ref, _ = restore_tokens(a, sid, extra)
    path = save_snapshots(a, tmp_path / "snaps")
    a.close()

    b = make_engine(model_dir)
    free_slots = b.states.available()
    (loaded,) = load_snapshots(b, path)
    got = b.list_snapshots()[0]
    assert (got.tokens, got.num_cached_tokens) == (snap.tokens, snap.num_cached_tokens) and got.state_slot >= 0
    assert b.states.available() == free_slots - 1
    tokens, finished = restore_tokens(b, loaded, extra)
    assert tokens == ref
    assert finished.cached_tokens == snap.num_cached_tokens
    assert b.stats().prompt_tokens_computed == len(prompt + out + extra) - snap.num_cached_tokens
    b.drop(loaded)
    b.pool.check_invariants()
    b.states.check_invariants()
    assert b.pool.num_used_blocks == 0 and b.states.available() == b.states.num_slots

    # A hybrid engine of another dtype is refused before anything is touched.
    c = make_engine(model_dir, dtype="bfloat16")
    before = state(c)
    with pytest.raises(ConfigError, match="saved with dtype float32, this engine runs bfloat16"):
        load_snapshots(c, path)
    assert state(c) == before
    c.close()


# ----------------------------------------------------------------------------- the warm prefix cache


def run(engine: Engine, prompt: list[int]):
    """Greedy tokens for `prompt` and its finished event."""
    events = list(engine.stream(engine.submit(prompt, GREEDY)))
    return [t for e in events for t in e.token_ids], events[-1]


@pytest.fixture(scope="module")
def warm(demo, tmp_path_factory):
    """Engine A serves prompts sharing prefixes, pins one snapshot, and saves with its prefix cache;
    then (after the save) A answers a follow-up that extends one of its prompts, for reference."""
    a = make_engine(demo)
    base, other = list(range(10, 40)), list(range(60, 85))
    prompts = [base + [1, 2, 3], base + [4, 5, 6, 7, 8], other]
    outs = [c.token_ids for c in a.generate(prompts, GREEDY)]
    sid = a.snapshot(tokens=base[:17])  # pins 4 blocks that are also plain cache entries of the prompts
    cached = a.pool.cached_blocks()
    snap_keys = [cached[b] for b in a.list_snapshots()[0].blocks]
    root = tmp_path_factory.mktemp("warm")
    path = a.save_snapshots(root / "warm", include_prefix_cache=True)
    plain_path = save_snapshots(a, root / "plain")  # the default: snapshots only
    follow = prompts[2] + outs[2] + [7, 7]  # no snapshot covers any of it
    ref, ref_finished = run(a, follow)
    a.close()
    yield dict(path=path, plain_path=plain_path, sid=sid, cached=list(cached.values()), snap_keys=snap_keys,
               loose=[k for k in cached.values() if k not in snap_keys], follow=follow, ref=ref,
               ref_cached=ref_finished.cached_tokens, extend=prompts[1] + outs[1] + [9, 9])


def test_save_with_prefix_cache_writes_every_cached_block_once(warm):
    meta = read_metadata(warm["path"])
    assert meta["prefix_cache"] is True and meta["states"] == []
    # Every cached block once: the snapshot's rows first, then the rest least recently used first.
    assert meta["blocks"] == [k.hex() for k in warm["snap_keys"] + warm["loose"]]
    assert [s["id"] for s in meta["snapshots"]] == [warm["sid"]] and meta["snapshots"][0]["blocks"] == [0, 1, 2, 3]
    plain = read_metadata(warm["plain_path"])
    assert plain["prefix_cache"] is False and plain["blocks"] == meta["blocks"][:4]


def test_prefix_cache_survives_restart(demo, warm):
    b = make_engine(demo)
    loaded = load_snapshots(b, warm["path"])
    n = len(warm["loose"])
    assert loaded == [warm["sid"]] and n > 8
    assert (loaded.cache_blocks_saved, loaded.cache_blocks_loaded, loaded.cache_states_saved) == (n, n, 0)
    # Unpinned: only the snapshot holds blocks; the cache entries sit on the free list, in A's LRU order.
    assert b.pool.num_used_blocks == 4 and b.pool.num_cached_blocks == len(warm["cached"])
    assert list(b.pool.cached_blocks().values())[:n] == warm["loose"]
    b.pool.check_invariants()

    # A request extending one of A's prompts starts from the loaded cache, as it would have on A...
    tokens, finished = run(b, warm["follow"])
    assert finished.cached_tokens == warm["ref_cached"] > 0
    assert b.stats().prompt_tokens_computed == len(warm["follow"]) - finished.cached_tokens
    assert tokens == warm["ref"]
    # ... and continues exactly as an engine without any cache does.
    plain = make_engine(demo, enable_prefix_caching=False)
    assert plain.generate([warm["follow"]], GREEDY)[0].token_ids == tokens
    extended, finished = run(b, warm["extend"])  # the snapshot's blocks and loose ones after them
    assert finished.cached_tokens > 16
    assert plain.generate([warm["extend"]], GREEDY)[0].token_ids == extended
    plain.close()
    b.pool.check_invariants()

    # Loading again finds everything cached: nothing new is written, every entry counts as loaded.
    used = b.pool.num_used_blocks
    again = load_snapshots(b, warm["path"])
    assert again.cache_blocks_loaded == n and b.pool.num_used_blocks == used
    for sid in loaded + again:
        b.drop(sid)
    assert b.pool.num_used_blocks == 0
    b.pool.check_invariants()
    b.close()


def test_prefix_cache_load_takes_only_what_is_free(demo, warm, monkeypatch):
    # A small pool: its own snapshot pinned, a running request's reservation, then the load.
    b = make_engine(demo, num_blocks=16)
    own = b.snapshot(tokens=list(range(90, 100)))  # 2 blocks pinned
    own_blocks = b.list_snapshots()[0].blocks
    b.pool.reserve(("someone", 0), 20)  # 5 blocks promised to a "running request"
    loaded = load_snapshots(b, warm["path"])
    assert len(loaded) == 1 and loaded[0] != own  # the saved id is taken here: a new one
    fit = 16 - 2 - 5 - 4  # what is left after the snapshot's 4 blocks
    assert loaded.cache_blocks_loaded == fit < loaded.cache_blocks_saved
    # The most recently used entries, nothing else: the pin, the promise and the snapshot are intact.
    unpinned = {k for blk, k in b.pool.cached_blocks().items() if blk not in own_blocks} - set(warm["snap_keys"])
    assert unpinned == set(warm["loose"][-fit:])
    assert {s.id: s.blocks for s in b.list_snapshots()}[own] == own_blocks
    assert b.pool.num_reserved_blocks == 5
    b.pool.check_invariants()
    b.pool.append_slots(("someone", 0), 20)  # the promise holds (evicting loaded entries is fine)
    b.pool.free(("someone", 0))
    b.pool.check_invariants()
    b.close()

    # A device failure while writing undoes everything: no half-written entry is registered.
    b = make_engine(demo)
    before = state(b)

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(b.runner, "scatter_pages", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        load_snapshots(b, warm["path"])
    assert state(b) == before and b.pool.num_cached_blocks == 0
    b.pool.check_invariants()
    monkeypatch.undo()
    # And the cache entries are optional: left out on request.
    loaded = b.load_snapshots(warm["path"], include_prefix_cache=False)
    assert b.pool.num_cached_blocks == 4 and loaded.cache_blocks_saved == 0
    b.close()


def test_hybrid_prefix_cache_survives_restart(hybrid_qwen3_5_dir, tmp_path):
    model_dir = hybrid_qwen3_5_dir
    rng = np.random.default_rng(5)
    prompt, extra = rng.integers(0, 128, 23).tolist(), rng.integers(0, 128, 5).tolist()

    a = make_engine(model_dir)
    out, _ = run(a, prompt)
    checkpoints = a.states.num_cached
    assert checkpoints > 0
    path = save_snapshots(a, tmp_path / "warm", include_prefix_cache=True)
    follow = prompt + out + extra
    ref, ref_finished = run(a, follow)
    a.close()
    meta = read_metadata(path)
    assert meta["snapshots"] == [] and len(meta["states"]) == checkpoints

    b = make_engine(model_dir)
    loaded = load_snapshots(b, path)
    assert loaded == [] and loaded.cache_states_loaded == loaded.cache_states_saved == checkpoints
    assert b.states.num_cached == checkpoints and b.states.available() == b.states.num_slots  # none held
    assert b.pool.num_used_blocks == 0
    tokens, finished = run(b, follow)
    assert finished.cached_tokens == ref_finished.cached_tokens > 0
    assert b.stats().prompt_tokens_computed == len(follow) - finished.cached_tokens
    assert tokens == ref
    b.pool.check_invariants()
    b.states.check_invariants()
    b.close()
    plain = make_engine(model_dir, enable_prefix_caching=False)
    assert plain.generate([follow], GREEDY)[0].token_ids == ref
    plain.close()
