"""Tiny HF checkpoints for parity tests: random (seeded) weights, every parameter perturbed.

    hf_model, path = make_hf_checkpoint("qwen3", tmp_path / "qwen3")

kind is one of "qwen3", "qwen3_moe", "qwen2". The model comes back in eval mode, float32,
and is saved with `save_pretrained(path)` (no tokenizer). `overrides` replace config fields.
Every norm weight is perturbed too, so a wrong "1 + w" / "w" convention shows up.

What jtp is compared on is what it serves: `run_step` runs a plan through `ModelRunner.dispatch`
(the jitted step the engine calls) with greedy sampling and 20 logprobs, and the parity tests
compare those logprobs and tokens with HF's logits (`logprob_error`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jtp.parallel.collectives import step_collectives

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=3,
    intermediate_size=96,
    max_position_embeddings=512,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # nothing stops a generation early unless a test asks for it
    pad_token_id=None,
)

MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
)

KINDS = ("qwen3", "qwen3_moe", "qwen2")


def make_config(kind: str, **overrides):
    import transformers

    if kind == "qwen3":
        cls, extra = transformers.Qwen3Config, {}
    elif kind == "qwen3_moe":
        cls, extra = transformers.Qwen3MoeConfig, dict(MOE)
    elif kind == "qwen2":
        cls, extra = transformers.Qwen2Config, {}
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    kwargs = {**TINY, **extra, **overrides}
    rope_theta = kwargs.pop("rope_theta")
    cfg = cls(**kwargs)
    # transformers 5 keeps rope settings in rope_parameters; older versions read rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    cfg.rope_theta = rope_theta
    return cfg


def make_hf_checkpoint(kind: str, path, **overrides):
    """Build, perturb and save a tiny HF model of `kind`; returns (hf_model, path)."""
    import torch
    import transformers

    cfg = make_config(kind, **overrides)
    torch.manual_seed(0)
    model_cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[kind]
    model = model_cls(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return model, path


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """HF greedy generation of exactly max_new_tokens tokens (EOS cannot end it early)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


# ----------------------------------------------------------------------------- the serving step's outputs


class StepOutput(NamedTuple):
    """What the serving step returns for some rows: greedy tokens and the top-20 logprobs."""

    tokens: np.ndarray  # i32[N]
    top_ids: np.ndarray  # i32[N, 20]
    top_logprobs: np.ndarray  # f32[N, 20]

    @staticmethod
    def concat(outputs: list["StepOutput"]) -> "StepOutput":
        return StepOutput(*(np.concatenate(parts) for parts in zip(*outputs)))

    def take(self, rows) -> "StepOutput":
        """Some rows (a slice or a list of indices)."""
        return StepOutput(*(x[rows] for x in self))


def run_step(runner, plan, positions=None) -> StepOutput:
    """Run `plan` through ModelRunner.dispatch, greedy with 20 logprobs per row.

    positions (indices into the plan's tokens): return the distribution at each of them, not at each
    row's logits index. They ride along as extra padding rows (no tokens, no state slot: the step
    writes nothing for them) whose logits index is the position, so any positions of a prefill come
    out of one real step.
    """
    from jtp.core.sampling_params import SamplingParams, pack_sampling
    from jtp.core.step_input import StepInput

    rows = len(plan.context_lens)
    if positions is not None:
        n = len(positions)
        extra = dict(
            block_tables=np.zeros((n, plan.block_tables.shape[1]), np.int32),
            context_lens=np.zeros(n, np.int32),
            row_starts=np.full(n, plan.row_lens.sum(), np.int32),  # like the scheduler's padding rows
            row_lens=np.zeros(n, np.int32),
            seq_slots=np.full(n, -1, np.int32),
            state_reads=np.full(n, -1, np.int32),
            state_writes=np.full(n, -1, np.int32),
            logits_indices=np.asarray(positions, np.int32),
        )
        plan = dataclasses.replace(plan, **{k: np.concatenate([getattr(plan, k), v]) for k, v in extra.items()})
    B = len(plan.context_lens)
    greedy = SamplingParams(temperature=0.0, logprobs=20)
    result = runner.dispatch(StepInput(plan, pack_sampling([greedy] * B, B, [0] * B, [0] * B)))
    # The first step of the result (a decode plan runs through the decode loop: [steps, rows]).
    out = StepOutput(*(np.asarray(x)[0] for x in (result.tokens, result.top_ids, result.top_logprobs)))
    return out.take(slice(rows, None)) if positions is not None else out


def log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logprob_error(ours: StepOutput, ref_logits) -> float:
    """Largest difference between our top-20 logprobs and the reference's logprobs of the same
    tokens, relative to the reference's largest |logit| (so a tolerance reads as one on logits)."""
    ref_logits = np.asarray(ref_logits, np.float64)
    ref = np.take_along_axis(log_softmax(ref_logits), ours.top_ids, axis=-1)
    return float(np.abs(ours.top_logprobs - ref).max() / np.abs(ref_logits).max())


def assert_same_outputs(a: StepOutput, b: StepOutput, atol: float = 0.0, msg: str = "") -> None:
    """Same tokens and top-20 ids; logprobs equal (atol 0) or within atol."""
    np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=msg)
    np.testing.assert_array_equal(a.top_ids, b.top_ids, err_msg=msg)
    np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=atol, rtol=0, err_msg=msg)


def assert_step_collectives(runner, plan) -> None:
    """The compiled serving step (greedy, no logprobs) of `plan`: exactly 2 * layers + 1 all-reduces
    of activations, each exactly [T, H] (MoE layers combine a token's top-k pairs before reducing,
    never [T*k, H]), and besides them only exchanges of at most B * tp values (sampling over the
    vocab-parallel logits), never the logits; none at tp 1 (jtp/parallel/collectives.py). Nothing is
    hand-written: XLA chose every one."""
    found = step_collectives(runner, plan)
    assert not found.oversized, found.oversized
    assert found.activation_all_reduces == found.expected_activation_all_reduces, found.summary()
    assert all(size <= found.rows * found.tp for _, size in found.others), found.others
    assert found.ok
