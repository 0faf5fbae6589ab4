"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` + `logprobs`) equal HF transformers'
teacher-forced log-softmax, through the engine's real steps: a prompt prefilled in several chunks,
beside other requests, with a warm prefix cache that such a request must not use.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_hybrid import SHALLOW, build_model, double, hf_logits, save  # noqa: E402
from hf_models import log_softmax, make_hf_checkpoint  # noqa: E402

from jtp.config.engine_args import EngineArgs  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402
from jtp.errors import RequestError  # noqa: E402

TOP = 5


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        model, path = make_hf_checkpoint("qwen3", path)
    else:
        model = build_model("qwen3_5_text", **SHALLOW)
        save(model, path)
        model = double(model)
    return request.param, model, path


def reference(model, prompt: list[int]) -> np.ndarray:
    """HF's log-distribution at every position (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].to(torch.float64).numpy()
    return log_softmax(logits)


def test_prompt_logprobs_equal_hf_teacher_forced(checkpoint):
    kind, model, path = checkpoint
    # 16 tokens a step: the 45-token prompt is scored over several chunked-prefill steps.
    engine = Engine.from_args(EngineArgs(model=path, dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4,
                                         max_num_batched_tokens=16))
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 128, 45).tolist()
    other = rng.integers(0, 128, 9).tolist()
    # The same prompt first, without prompt logprobs: its blocks are now in the prefix cache.
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    asked = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP)
    done, neighbour = engine.generate([prompt, other], [asked, SamplingParams(max_tokens=6, temperature=0)])
    ref = reference(model, prompt)
    scored = done.prompt_logprobs
    assert scored.logprobs[0] is None and scored.ranks[0] is None and scored.top[0] is None
    assert len(scored.logprobs) == len(prompt)
    expected = np.array([ref[p - 1, prompt[p]] for p in range(1, len(prompt))])
    scale = np.abs(ref).max()
    np.testing.assert_allclose(scored.logprobs[1:], expected, atol=1e-4 * scale, err_msg=kind)
    ranks = [1 + int((ref[p - 1] > ref[p - 1, prompt[p]] + 1e-9).sum()) for p in range(1, len(prompt))]
    assert scored.ranks[1:] == ranks, kind
    for p in range(1, len(prompt)):
        top = scored.top[p]
        assert list(top) == list(np.argsort(-ref[p - 1], kind="stable")[:TOP]), (kind, p)
        np.testing.assert_allclose(list(top.values()), ref[p - 1, list(top)], atol=1e-4 * scale)
    # Scoring changes nothing else: the same tokens as alone, and the neighbour's too.
    alone = engine.generate([prompt, other], SamplingParams(max_tokens=6, temperature=0))
    assert done.token_ids == alone[0].token_ids[:3] and neighbour.token_ids == alone[1].token_ids
    assert alone[0].prompt_logprobs is None


def test_prompt_logprobs_stream_on_the_first_event_and_are_range_checked(checkpoint):
    _, _, path = checkpoint
    engine = Engine.from_args(EngineArgs(model=path, dtype="float32", num_blocks=32, block_size=4, max_num_seqs=2,
                                         max_num_batched_tokens=16))
    rid = engine.submit([3, 1, 4, 1, 5], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    events = list(engine.stream(rid))
    assert len(events[0].prompt_logprobs.logprobs) == 5 and events[0].prompt_logprobs.top[1] == {}
    assert all(e.prompt_logprobs is None for e in events[1:])
    with pytest.raises(RequestError, match="prompt_logprobs must be None or in"):
        engine.submit([1, 2], SamplingParams(prompt_logprobs=21))
