"""Stop strings and streamed text on a real tokenizer (the demo checkpoint's BPE).

The reference is the same request without the stop string: its text, cut at the first
occurrence of the stop string, is what the stopped request must return and stream.
"""

import pytest

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.demo import ensure_demo_checkpoint
from jtp.engine.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    demo = ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "d")
    return Engine.from_args(EngineArgs(model=str(demo), num_blocks=128, max_num_seqs=4))


def streamed(engine, prompt, params):
    """The streamed events of one run, and the Completion of a second, unstreamed run (seeded: equal)."""
    events = list(engine.stream(engine.submit(prompt, params)))
    return events, engine.result(engine.submit(prompt, params))


def test_stop_string_cuts_text_and_stream(engine):
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")
    base = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    full = engine.generate([prompt], base)[0].text
    assert len(full) > 12, full
    stop = full[6:9]
    cut = full[: full.index(stop)]
    events, done = streamed(engine, prompt, SamplingParams(**{**base.__dict__, "stop": [stop]}))
    assert done.finish_reason == "stop"
    assert done.text == cut
    assert "".join(e.text for e in events) == cut  # nothing of the stop string was streamed
    assert [e.finished for e in events].count(True) == 1 and events[-1].finished


def test_stream_without_stop_equals_final_text(engine):
    tok = engine.tokenizer
    prompt = tok.encode("Bonjour, 世界! 🙂")
    events, done = streamed(engine, prompt, SamplingParams(max_tokens=25, temperature=1.0, seed=11, ignore_eos=True))
    assert "".join(e.text for e in events) == done.text == tok.decode(done.token_ids)
    assert sum(len(e.token_ids) for e in events) == len(done.token_ids) == 25
