"""Issue 4 in the engine: hybrid (DeltaNet) models under continuous batching, and the
recurrent-state slots the scheduler hands out.

Batch invariance: staggered, mixed-length requests (prompts chunked across steps, chunk
boundaries anywhere relative to DeltaNet's 64-token chunks) produce exactly the greedy tokens
each produces alone, at tp = 1, 2 and 4, and the tokens HF generates.
"""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jtp.page_pool import PagePool
from jtp.sampling import SamplingParams
from jtp.scheduler import Request, Scheduler, Status

ENGINE_KW = dict(dtype="float32", num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=192)


def workload(seed: int, num: int):
    rng = np.random.default_rng(seed)
    lens = rng.integers(3, 110, num)
    news = rng.integers(1, 10, num)
    return [(rng.integers(0, 128, n).tolist(), int(m)) for n, m in zip(lens, news)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_hybrid import build_model, save

    model = build_model("qwen3_5_text_hk4", seed=1)  # 4 key heads, 4 KV heads: tp 1, 2, 4 all split
    return model, save(model, tmp_path_factory.mktemp("hk4"))


def run_all(path, tp, work):
    from jtp.engine import Engine
    from test_engine import run_staggered

    engine = Engine(path, tp, **ENGINE_KW, tokenizer=False)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work]
    batched = run_staggered(engine, [p for p, _ in work], params, waves=(3, 2, 3), gaps=(2, 3, 1))
    solo = [engine.generate([p], sp)[0] for (p, _), sp in zip(work, params)]
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    assert sorted(engine.scheduler.free_seq_slots) == list(range(ENGINE_KW["max_num_seqs"]))
    assert engine.states.available() == engine.states.num_slots, "a state slot leaked"
    return [c.token_ids for c in batched], [c.token_ids for c in solo]


def test_hybrid_batch_invariance_across_tp(hybrid):
    from hf_hybrid import hf_generate

    model, path = hybrid
    work = workload(seed=5, num=10)
    base_batched, base_solo = run_all(path, 1, work)
    assert base_batched == base_solo
    for (prompt, n), tokens in list(zip(work, base_batched))[:3]:
        assert tokens == hf_generate(model, prompt, n)
    for tp in (2, 4):
        batched, solo = run_all(path, tp, work)
        assert batched == base_batched, f"tp={tp}"
        assert solo == base_solo, f"tp={tp}"


class SlotMachine(RuleBasedStateMachine):
    """Random submit / step / finish / abort against the real Scheduler and PagePool:
    every state slot is owned by exactly one running request or free, never both, never lost."""

    @initialize(max_seqs=st.integers(1, 5), num_blocks=st.integers(4, 40))
    def setup(self, max_seqs, num_blocks):
        self.max_seqs = max_seqs
        self.sched = Scheduler(PagePool(num_blocks, 4), max_seqs, max_seqs + 8, max_model_len=64)
        self.ids = 0

    @rule(prompt=st.integers(1, 30), max_tokens=st.integers(1, 20))
    def submit(self, prompt, max_tokens):
        if not self.sched.pool.can_ever_fit(prompt + max_tokens):
            return
        self.ids += 1
        self.sched.add(Request(f"r{self.ids}", [1] * prompt, SamplingParams(max_tokens=max_tokens), 0, frozenset()))

    @rule()
    def step(self):
        for row in self.sched.schedule():  # what the engine does at dispatch and on the result
            req = row.request
            req.num_computed += row.num_tokens
            if row.samples:
                req.output_ids.append(7)
                if len(req.output_ids) >= req.params.max_tokens:
                    self.sched.remove(req)

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        reqs = list(self.sched.running) + list(self.sched.waiting)
        self.sched.remove(data.draw(st.sampled_from(reqs)))

    @invariant()
    def slots_are_owned_once(self):
        if not hasattr(self, "sched"):
            return
        owned = [r.state_slot for r in self.sched.running]
        assert len(set(owned)) == len(owned), "a slot is held by two running requests"
        assert not set(owned) & set(self.sched.free_slots), "a slot is both free and owned"
        assert sorted(owned + self.sched.free_slots) == list(range(self.max_seqs)), "a slot leaked"
        assert all(r.state_slot == -1 and r.status is Status.WAITING for r in self.sched.waiting)
        self.sched.pool.check_invariants()

    def teardown(self):
        if hasattr(self, "sched"):
            for r in list(self.sched.running) + list(self.sched.waiting):
                self.sched.remove(r)
            assert sorted(self.sched.free_slots) == list(range(self.max_seqs))
            assert self.sched.pool.num_free_blocks == self.sched.pool.total_blocks


TestStateSlots = SlotMachine.TestCase
TestStateSlots.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
