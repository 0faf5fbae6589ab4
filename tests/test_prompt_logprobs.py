"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` + `logprobs`) equal HF transformers'
teacher-forced log-softmax, through the engine's real steps: a prompt prefilled in several chunks,
beside other requests, with a warm prefix cache that such a request must not use.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_hybrid import SHALLOW, build_model, double, save  # noqa: E402
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


# ----------------------------------------------------------------------------- through the API

@pytest.fixture(scope="module")
def api(demo_dir):
    """A live server on the demo checkpoint, the real openai client, and HF's copy of the model."""
    import openai
    import transformers
    from loopback import serving

    from jtp.entrypoints.server import build_app

    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512, block_size=16, num_blocks=64,
                warmup=False)
    with Engine.from_args(EngineArgs(model=str(demo_dir), **args)) as engine:
        engine.start()
        engine.ready.set()
        with serving(build_app(engine, "demo")) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), engine, hf


PROMPT = "The sea is wide and deep, it sings the sailors off to sleep; the rain in Spain stays on the plain."


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(api):
    client, engine, hf = api
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 32  # more than one step's tokens: scored over chunked-prefill steps
    ref = reference(hf, ids)
    r = client.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [ref[p - 1, ids[p]] for p in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=2e-4)
    assert all(len(top) >= 2 and max(top.values()) == pytest.approx(ref[p - 1].max(), abs=2e-4)
               for p, top in enumerate(lp.top_logprobs[1:], 1))
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]

    # echo with generation: the prompt, then the same tokens as without echo (streamed too)
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    stream = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed.choices[0].text


def test_vllm_prompt_logprobs_field_on_completions_and_chat(api):
    client, engine, hf = api
    ids = engine.tokenizer.encode(PROMPT)
    ref = reference(hf, ids)
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for p in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[p].items()}
        assert entry[ids[p]]["logprob"] == pytest.approx(ref[p - 1, ids[p]], abs=2e-4)
        assert entry[ids[p]]["rank"] == 1 + int((ref[p - 1] > ref[p - 1, ids[p]] + 1e-6).sum())
        ranked = sorted((v["rank"], t) for t, v in entry.items() if t != ids[p] or v["rank"] <= 3)
        assert [t for _, t in ranked[:3]] == list(np.argsort(-ref[p - 1], kind="stable")[:3])

    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    chat_entries = chat.model_extra["prompt_logprobs"]
    assert len(chat_entries) == len(chat_ids)
    chat_ref = reference(hf, chat_ids)
    assert [e[str(chat_ids[p])]["logprob"] for p, e in enumerate(chat_entries) if p] == pytest.approx(
        [chat_ref[p - 1, chat_ids[p]] for p in range(1, len(chat_ids))], abs=2e-4)


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_400s_naming_the_field(api, body, param):
    import openai

    client, _, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="Hi", max_tokens=2, extra_body=body)
    assert e.value.body["param"] == param
