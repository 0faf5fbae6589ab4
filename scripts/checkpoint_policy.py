#!/usr/bin/env python
"""Hybrid models' state-checkpoint policy: prefill saved (hit rate) against slots held (memory).

    python scripts/checkpoint_policy.py [--json-out F]

Runs the real `Scheduler` (page pool, state pool, prefix cache) host-side, with a stand-in for
the device (each sampled token is a hash of the sequence so far, so answers are deterministic),
over three shared-prefix workloads, under four checkpoint policies:

  request end     only the latest block boundary a request's decoding crossed (what a cache
                  that stores a state when a request finishes can offer)
  + prompt end    also the prompt's last block boundary
  jtp (default)   also where a prompt leaves the longest cached KV prefix (a shared document)
  every chunk     also every block boundary a prefill chunk ends on (the most a step can
                  give without extra splits), for comparison

and prints, per workload and policy, the prompt tokens prefilled (against no cache at all),
and the state checkpoints created and held at the end. Then the device memory one checkpoint
(state slot) costs for real hybrid configs, from the model code's own cache shapes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jtp.core.block_hash import root_key  # noqa: E402
from jtp.core.page_pool import PagePool  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.core.scheduler import Request, Scheduler  # noqa: E402
from jtp.core.state_pool import StatePool  # noqa: E402

BS = 16
BUDGET = 2048  # tokens per step
VOCAB = 50_000


class RequestEndOnly(Scheduler):
    def _checkpoint_targets(self, r):
        return ()


class PromptEnd(Scheduler):
    def _checkpoint_targets(self, r):
        return ((len(r.prompt_ids) - 1) // BS * BS,)


class EveryChunk(Scheduler):
    """jtp's targets, plus every chunk end (chunks rounded down to block boundaries, so that
    every chunk of a long prompt ends on one)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._chunk_ends: dict[str, set[int]] = {}

    def _chunk(self, r, budget):
        n = super()._chunk(r, budget)
        end = r.num_computed + n
        if end < len(r.prompt_ids) and end % BS and n > BS:
            n -= end % BS
        self._chunk_ends.setdefault(r.id, set()).add(r.num_computed + n)
        return n

    def _checkpoint_targets(self, r):
        return super()._checkpoint_targets(r) + tuple(self._chunk_ends.get(r.id, ()))


POLICIES = {"request end": RequestEndOnly, "+ prompt end": PromptEnd, "jtp (default)": Scheduler,
            "every chunk": EveryChunk}


def token_after(seq: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(str(seq[-64:]).encode(), digest_size=4).digest(), "little") % VOCAB


ANSWER = 32  # tokens per answer


def workloads(rng: random.Random):
    """(name, prompts); a prompt is a list of segments: token lists, or the index of an earlier
    request whose answer is resent there."""
    words = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    doc = words(4000)
    yield "16 questions over one 4k-token document", [[doc + words(rng.randint(30, 80))] for _ in range(16)]
    for rewrite in (False, True):
        prompts = []
        for _ in range(8):  # 8 conversations x 5 turns of 300-token messages after a 500-token system prompt
            history = [words(500)]
            for _ in range(5):
                history = history + [words(300)]
                prompts.append(history)
                # The answer comes back verbatim, or rewritten (e.g. its reasoning stripped).
                history = history + [words(ANSWER // 2) if rewrite else len(prompts) - 1]
        yield "8 chats x 5 turns, answers resent " + ("rewritten" if rewrite else "verbatim"), prompts


def serve(policy: type[Scheduler], prompts: list[list], cache: bool = True) -> dict:
    """Serve the prompts one after another; what it cost."""
    states = StatePool(4096)
    sched = policy(PagePool(200_000, BS), 16, BUDGET, 65_536, states=states,
                   cache_root=root_key("policy") if cache else None)
    created = prompt_tokens = 0
    answers: list[list[int]] = []
    for i, segments in enumerate(prompts):
        prompt = [t for seg in segments for t in (answers[seg] if isinstance(seg, int) else seg)]
        prompt_tokens += len(prompt)
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=ANSWER), 0, frozenset())
        sched.add(r)
        while r.status.value != "finished":
            rows = sched.schedule()
            held = len(r.pending_checkpoints)
            sched.dispatched(rows)
            created += len(r.pending_checkpoints) > held
            for row in rows:
                if row.picks_next_token:
                    row.request.num_unseen_tokens -= 1
                    row.request.output_ids.append(token_after(row.request.prompt_ids + row.request.output_ids))
                    if len(row.request.output_ids) >= ANSWER:
                        sched.remove(row.request)
        answers.append(r.output_ids)
    return {"prefilled": sched.prompt_tokens_computed, "prompt_tokens": prompt_tokens,
            "checkpoints_created": created, "checkpoints_held": states.num_cached}


def slot_bytes() -> dict[str, float]:
    """MiB of one recurrent-state slot (all DeltaNet layers, one device) for real hybrid configs."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_random_checkpoint import make_config

    from jtp.config.model_config import ModelConfig
    from jtp.models import qwen3_5
    from jtp.parallel.sharding import make_mesh

    mesh = make_mesh(1)
    out = {}
    for preset in ("qwen3.5-0.8b", "qwen3.5-9b"):
        cfg = ModelConfig.from_hf(make_config(preset, "bfloat16"))

        def size(slots, cfg=cfg):
            shapes = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, mesh, 1, BS, slots, jnp.bfloat16))
            return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

        per_slot = size(2) - size(1)
        out[preset] = {"state_slot_mib": per_slot / 2**20,
                       "kv_tokens_of_same_memory": per_slot // _kv_bytes_per_token(cfg)}
    return out


def _kv_bytes_per_token(cfg) -> int:
    full = sum(1 for i in range(cfg.num_layers) if not cfg.is_linear_layer(i))
    return full * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    rng = random.Random(0)
    results = {}
    print(f"{'workload':<48}{'policy':<16}{'prefilled':>11}{'of prompt':>11}{'ckpts made':>12}{'held':>7}")
    for name, prompts in workloads(rng):
        for policy_name, policy in POLICIES.items():
            r = results.setdefault(name, {})[policy_name] = serve(policy, prompts)
            print(f"{name:<48}{policy_name:<16}{r['prefilled']:>11,}{r['prompt_tokens']:>11,}"
                  f"{r['checkpoints_created']:>12,}{r['checkpoints_held']:>7,}")
    results["slot_memory"] = slot_bytes()
    for preset, m in results["slot_memory"].items():
        print(f"{preset}: one state checkpoint = {m['state_slot_mib']:.1f} MiB "
              f"= the K/V of {m['kv_tokens_of_same_memory']:,} tokens")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
