"""The collectives XLA put in the compiled serving step, read from its optimized HLO.

Tensor parallelism is written as shardings only; this is how the tests and scripts/gpu_check.py
check what XLA made of them: one all-reduce of the [T, H] activations after each row-parallel
projection (o_proj / out_proj, and down_proj or the experts' combined down projection) plus one for
the vocab-parallel embedding lookup, so 2 * layers + 1; and besides them only sampling's exchanges
of a few values per row (each shard's best token, the log-softmax max and sum), never the logits.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


@dataclasses.dataclass
class StepCollectives:
    tp: int
    tokens: int  # T of the step's shape
    rows: int  # B
    activation_all_reduces: int  # all-reduces of exactly [T, H]
    expected_activation_all_reduces: int  # 2 * layers + 1 at tp > 1, else 0
    oversized: list[str]  # all-reduces larger than [T, H] (a [T*k, H] MoE reduction would land here)
    others: list[tuple[str, int]]  # every other collective: (kind, elements of its largest operand)

    @property
    def ok(self) -> bool:
        return (
            self.activation_all_reduces == self.expected_activation_all_reduces
            and not self.oversized
            and all(size <= self.rows * self.tp for _, size in self.others)
        )

    def summary(self) -> dict:
        return dict(tp=self.tp, tokens=self.tokens, rows=self.rows,
                    activation_all_reduces=self.activation_all_reduces,
                    expected=self.expected_activation_all_reduces, oversized=self.oversized,
                    other_collectives=len(self.others), largest_other=max((s for _, s in self.others), default=0))


def step_collectives(runner, plan) -> StepCollectives:
    """Count the collectives of the step `runner` compiles for `plan`'s shapes (greedy sampling)."""
    T, B, H = len(plan.token_ids), len(plan.context_lens), runner.cfg.hidden_size
    activations, oversized, others = 0, [], []
    for shapes, kind in _COLLECTIVE.findall(runner.compiled_text(plan)):
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\w+\[([\d,]*)\]", shapes)]
        if kind == "all-reduce" and max(sizes) >= T * H:
            if max(sizes) == T * H:
                activations += 1
            else:
                oversized.append(shapes)
        else:
            others.append((kind, max(sizes)))
    expected = 2 * runner.cfg.num_layers + 1 if runner.tp > 1 else 0
    return StepCollectives(runner.tp, T, B, activations, expected, oversized, others)
