"""The output processor without an engine: a step's tokens reach a request's consumer with one
wake-up, in order, and the finished event carries the reason the tokens gave."""
import threading

from jtp.core.sampling_params import SamplingParams
from jtp.core.scheduler import Request, Status
from jtp.engine.output_processor import OutputProcessor


class CountingLoop:
    """Stands in for an asyncio loop: counts the wake-ups the stream sends a consumer."""

    def __init__(self):
        self.calls = 0

    def call_soon_threadsafe(self, fn):
        self.calls += 1
        fn()


class Flag:
    def set(self):
        pass


def processor():
    return OutputProcessor(None, threading.Condition(), pump=lambda: False, abort=lambda rid: False)


def test_one_wake_up_per_request_per_step():
    outputs = processor()
    req = Request("r", [1, 2], SamplingParams(max_tokens=8), 0, frozenset({9}))
    req.status = Status.RUNNING
    stream = outputs.add(req)
    loop = CountingLoop()
    stream.add_waker(loop, Flag())

    for token in (5, 6, 7, 8):  # what a 4-step decode hands over in one step
        event, reason = outputs.append_token(req, token, None, 0)
        assert reason is None
    assert loop.calls == 0 and not stream.has_events(), "nothing is delivered before the step ends"
    outputs.publish()
    assert loop.calls == 1
    assert [stream.get_nowait().token_ids for _ in range(4)] == [[5], [6], [7], [8]]
    outputs.publish()  # an idle step wakes nobody
    assert loop.calls == 1


def test_finish_delivers_the_held_events_with_the_finished_one():
    outputs = processor()
    req = Request("r", [1], SamplingParams(max_tokens=8), 0, frozenset({9}))
    req.status = Status.RUNNING
    stream = outputs.add(req)
    loop = CountingLoop()
    stream.add_waker(loop, Flag())
    outputs.append_token(req, 3, None, 0)
    event, reason = outputs.append_token(req, 9, None, 0)  # a stop token
    assert reason == "stop"
    req.status = Status.FINISHED  # what the scheduler's remove does
    outputs.finish(stream, reason, event)
    assert loop.calls == 1 and stream.done.is_set()
    got = [stream.get_nowait() for _ in range(2)]
    assert [e.token_ids for e in got] == [[3], [9]]
    assert [e.finished for e in got] == [False, True] and got[1].finish_reason == "stop"
    assert req.output_ids == [3, 9]


def test_length_ends_at_max_tokens():
    outputs = processor()
    req = Request("r", [1], SamplingParams(max_tokens=2), 0, frozenset())
    outputs.add(req)
    assert outputs.append_token(req, 4, None, 0)[1] is None
    assert outputs.append_token(req, 4, None, 0)[1] == "length"


def test_skip_special_tokens_false_keeps_them_in_the_streamed_text(demo_dir):
    """vLLM's skip_special_tokens (default true), from the API's field to the streamed text: the
    text adds up to the tokenizers library's decode of the same ids, special tokens kept or not."""
    import tokenizers

    from jtp.engine.tokenizer import Tokenizer
    from jtp.entrypoints.server.protocol import parse_completion_request, sampling_params

    raw = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    ids = raw.encode("<|im_start|>héllo😀<|im_end|>\n<|im_start|>x").ids
    assert ids.count(raw.token_to_id("<|im_start|>")) == 2
    for skip in (True, False):
        req = parse_completion_request({"prompt": "x", "skip_special_tokens": skip})
        params = sampling_params(req, max_tokens=len(ids), choice=0, defaults={})
        outputs = OutputProcessor(Tokenizer.from_dir(demo_dir), threading.Condition(), pump=lambda: False,
                                  abort=lambda rid: False)
        request = Request("r", [1], params, 0, frozenset())
        stream = outputs.add(request)
        text = [outputs.append_token(request, t, None, 0)[0].text for t in ids[:-1]]
        event, reason = outputs.append_token(request, ids[-1], None, 0)
        request.status = Status.FINISHED
        outputs.finish(stream, reason, event)
        assert "".join(text) + event.text == raw.decode(ids, skip_special_tokens=skip), skip
