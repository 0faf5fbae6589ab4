"""MTP speculative decoding: the checkpoint's multi-token-prediction head (mtp.*) drafts one token per
row (or k, chaining the head on its own output), through the engine's real step.

HF transformers does not run mtp.* (it drops the tensors), so the reference is assembled from HF
parts: the target's final-normed hidden states, the zero-centred RMSNorm and fc of the MTP input,
then a one-layer HF model of the same family (whose decoder layer and final norm are the MTP
layer and mtp.norm, and whose lm_head is the target's) run on those inputs. Every draft jtp
proposes must be that reference's argmax; the output with MTP speculation must equal the output
without it, token for token; tp=2 must draft what tp=1 drafts.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hf_hybrid as hh  # noqa: E402

from jtp.config.engine_args import EngineArgs
from jtp.config.speculative import SpeculativeConfig  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.core.scheduler import Scheduler  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402
from jtp.errors import ConfigError  # noqa: E402

KW = dict(dtype="float32", skip_tokenizer_init=True, num_blocks=160, block_size=4, max_num_seqs=8,
          max_num_batched_tokens=64, max_model_len=160, enable_prefix_caching=False)
MTP = '{"method": "mtp", "num_speculative_tokens": 1}'
EPS = 1e-6


def zero_centered_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w)


class MTPCheckpoint:
    """A tiny hybrid target, plus an MTP head: a one-layer full-attention model of the same family
    (its layer and final norm become mtp.layers.0.* and mtp.norm) and random fc / pre-fc norms."""

    def __init__(self, kind: str, path):
        self.target = hh.build_model(kind, **hh.SHALLOW)
        self.head = hh.build_model(kind, seed=1, num_hidden_layers=1, layer_types=["full_attention"],
                                   **({"mlp_only_layers": []} if kind == "qwen3_next" else {}))
        H = self.target.config.hidden_size
        g = torch.Generator().manual_seed(2)
        self.fc = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
        self.norm_e, self.norm_h = (0.1 * torch.randn(H, generator=g) for _ in range(2))
        with torch.no_grad():
            # Four tokens with long lm_head rows: the target and the head (which share the lm_head)
            # then mostly pick among them, so some drafts are accepted and some rejected.
            self.target.lm_head.weight[:4] *= 8
            self.head.lm_head.weight.copy_(self.target.lm_head.weight)
        extra = {"mtp.fc.weight": self.fc, "mtp.pre_fc_norm_embedding.weight": self.norm_e,
                 "mtp.pre_fc_norm_hidden.weight": self.norm_h}
        for name, value in self.head.state_dict().items():
            if name.startswith("model.layers.0."):
                extra["mtp.layers.0." + name[len("model.layers.0."):]] = value
        extra["mtp.norm.weight"] = self.head.model.norm.weight
        self.path = hh.save(self.target, path, extra={k: v.detach().numpy().copy() for k, v in extra.items()})
        config = json.loads((path / "config.json").read_text())
        config["num_nextn_predict_layers" if kind == "qwen3_next" else "mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(config))

    def draft_logits(self, context: list[int], chained: tuple[int, ...] = ()) -> np.ndarray:
        """The head's logits for the next draft after `context` and the drafts `chained` before it.

        First draft: at position n-2 the head takes the target's hidden state there and the last
        token, attending over positions 0..n-2 likewise. Each further one: one position on, its
        input is the previous draft and the head's own (final-normed) output at the previous position.
        """
        with torch.no_grad():
            ids = torch.tensor([context])
            hidden = self.target.model(ids).last_hidden_state[:, :-1]
            embedded = self.target.model.embed_tokens(ids[:, 1:])
            x = torch.cat([zero_centered_norm(embedded, self.norm_e), zero_centered_norm(hidden, self.norm_h)], -1) @ self.fc.T
            for draft in chained:
                out = self.head.model(inputs_embeds=x).last_hidden_state[:, -1:]
                e = self.target.model.embed_tokens(torch.tensor([[draft]]))
                step = torch.cat([zero_centered_norm(e, self.norm_e), zero_centered_norm(out, self.norm_h)], -1) @ self.fc.T
                x = torch.cat([x, step], 1)
            return self.head(inputs_embeds=x).logits[0, -1].numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> its MTPCheckpoint, built once per module."""
    made = {}

    def get(kind: str) -> MTPCheckpoint:
        if kind not in made:
            made[kind] = MTPCheckpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text"])
def checkpoint(request, checkpoints):
    """Both families' heads (their tensor names and configs differ): the drafting tests."""
    return checkpoints(request.param)


def generate_recording_drafts(path, monkeypatch, **kw):
    """Greedy completions of three prompts, and every (context, drafts) the scheduler proposed."""
    proposals = []
    original = Scheduler._drafts

    def recording(self, r, room):
        drafts = original(self, r, room)
        if drafts:
            proposals.append((list(r.prompt_ids + r.output_ids), drafts))
        return drafts

    monkeypatch.setattr(Scheduler, "_drafts", recording)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 11, 23)]
    engine = Engine.from_args(EngineArgs(model=path, **{**KW, **kw}))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    stats = engine.stats()
    monkeypatch.setattr(Scheduler, "_drafts", original)
    return [o.token_ids for o in outs], proposals, stats


def assert_drafts_are_the_heads(checkpoint, proposals):
    for context, drafts in proposals:
        for j, draft in enumerate(drafts):
            logits = checkpoint.draft_logits(context, drafts[:j])
            assert logits[draft] >= logits.max() - 1e-4, (len(context), j, draft, int(logits.argmax()))


def test_mtp_drafts_are_the_heads_guesses_and_keep_every_output(checkpoint, monkeypatch):
    plain, _, _ = generate_recording_drafts(checkpoint.path, monkeypatch)
    spec, proposals, stats = generate_recording_drafts(checkpoint.path, monkeypatch, speculative_config=MTP)
    assert spec == plain  # exact: drafts only decide how many tokens a step yields
    assert len(proposals) >= 20 and stats.spec_decode_num_draft_tokens == sum(len(d) for _, d in proposals)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # both outcomes happen
    assert_drafts_are_the_heads(checkpoint, proposals)

    # The head sharded over two devices drafts the same tokens.
    spec2, proposals2, _ = generate_recording_drafts(
        checkpoint.path, monkeypatch, speculative_config=MTP, tensor_parallel_size=2)
    assert spec2 == plain and proposals2 == proposals


def test_chained_mtp_drafts(checkpoints, monkeypatch):
    """k = 3: the head chained on its own output; 16-token pages leave room for most chains. (One
    family: chaining runs the same head code for both, which the k = 1 test loads from each.)"""
    checkpoint = checkpoints("qwen3_5_text")
    kw = dict(block_size=16, num_blocks=48)
    plain, _, _ = generate_recording_drafts(checkpoint.path, monkeypatch, **kw)
    spec, proposals, stats = generate_recording_drafts(
        checkpoint.path, monkeypatch, speculative_config='{"method": "mtp", "num_speculative_tokens": 3}', **kw)
    assert spec == plain
    assert sum(len(d) == 3 for _, d in proposals) >= 10 and stats.spec_decode_num_accepted_tokens > 0
    assert_drafts_are_the_heads(checkpoint, proposals)


def test_mtp_needs_a_head(tmp_path):
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 1  # the one MTP layer
    with pytest.raises(ConfigError, match="1..16"):
        SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 17}')
    path = hh.save(hh.build_model("qwen3_5_text", **hh.SHALLOW), tmp_path / "no-mtp")
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP head"):
        Engine.from_args(EngineArgs(model=path, **KW, speculative_config=MTP))


def test_snapshots_carry_the_heads_kv_and_say_so(checkpoints, tmp_path):
    """With MTP on, a snapshot holds the head's K/V layer too: it loads into an engine drafting with
    MTP and continues as the live engine does, and an engine without the head refuses it (and the
    other way round) with a message that says why, instead of misplacing a cache layer. (One family:
    the head's K/V layer is the same in both.)"""
    checkpoint = checkpoints("qwen3_5_text")
    kw = {**KW, "enable_prefix_caching": True}
    prefix = np.random.default_rng(3).integers(0, 128, 13).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with Engine.from_args(EngineArgs(model=checkpoint.path, **kw, speculative_config=MTP)) as engine:
        engine.save_snapshots(tmp_path / "mtp", [engine.snapshot(tokens=prefix)])
        live = engine.generate([prefix + [5]], params)[0].token_ids
    with Engine.from_args(EngineArgs(model=checkpoint.path, **kw)) as plain:
        plain.save_snapshots(tmp_path / "plain", [plain.snapshot(tokens=prefix)])
        with pytest.raises(ConfigError, match="saved with the MTP head's K/V .*, this engine runs without it"):
            plain.load_snapshots(tmp_path / "mtp")
    with Engine.from_args(EngineArgs(model=checkpoint.path, **kw, speculative_config=MTP)) as engine:
        with pytest.raises(ConfigError, match="saved without it, this engine runs with the MTP head's K/V"):
            engine.load_snapshots(tmp_path / "plain")
        engine.load_snapshots(tmp_path / "mtp")
        assert engine.generate([prefix + [5]], params)[0].token_ids == live
