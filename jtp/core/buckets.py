"""The step shapes the scheduler pads to: every jitted program compiles once per bucket."""

from __future__ import annotations

import dataclasses

from jtp.core.step_input import bucket_sizes

# Rows of 2 to SHORT_ROW tokens share the smallest tokens-per-row bound above 1.
SHORT_ROW = 16


def long_rows(num_tokens: int, num_rows: int, row_bound: int) -> int:
    """How many rows of several tokens a step of this shape (T, B, bound on tokens per row) may
    hold where a hybrid model lays them out apart, [P, bound] (bound > SHORT_ROW; see
    jtp/models/deltanet_rows.py): room for 4 x the step's tokens, and at least 4 rows. Rows over a
    quarter of the bound always fit by count; the scheduler cuts shorter ones beside a long row."""
    return min(num_rows, max(4, 4 * num_tokens // max(row_bound, 1)))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Static shapes of the jitted step: each dimension is padded up to one of these.

    tokens: powers of two from 16 to max_num_batched_tokens (plus that value itself); a decode step
      of one row has a shape of its own, 1 token in 1 row, so its projections run as matrix-vector
      products (the FP8 GEMV kernel) rather than over 15 padding tokens, and a hybrid model's
      DeltaNet layers update one recurrent state rather than 8 (7 of them padding);
    rows: powers of two from 8 to max_num_seqs (and 1, a lone token's step, above). A pure decode step
      picks it from its row count;
      a step with a longer row takes the most rows its token bucket can hold (padding rows
      cost almost nothing there, and the step shape then depends on the tokens alone);
    tokens per row: 1 in a pure decode step, else a power of four from 16, at most the tokens
      (coarse, as it multiplies the other dimensions: see `shapes`; 16, not 4, because a row of
      2-16 tokens costs the same in the attention kernel's 16-row tiles and the DeltaNet chunks,
      and each extra bound is one more forward program to compile before ready).
    The block table has one width, the blocks of max_model_len rounded up to 16: every attention
    walks a row's own pages, so its cost follows the context, not the width.
    """

    tokens: tuple[int, ...]
    rows: tuple[int, ...]
    table_width: int
    row_lens: tuple[int, ...]

    @classmethod
    def make(
        cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, bucket_row_lens: bool = True,
    ) -> "Buckets":
        """`bucket_row_lens=False`: the step's program ignores the tokens-per-row bound beyond 1 (the
        dense model's reference attention), so every step with a longer row takes the loosest, T."""
        return cls(
            tokens=bucket_sizes(16, max_num_batched_tokens),
            rows=bucket_sizes(8, max_num_seqs),
            # The GPU decode kernel reads a row's pages several per iteration, a count that must
            # divide the table's width (else it falls back to one page per iteration, 4x the
            # latency): round the width up to a multiple of 16 pages; the extra entries are 0.
            table_width=-(-max_blocks_per_seq // 16) * 16,
            row_lens=(1,) + (bucket_sizes(SHORT_ROW, max_num_batched_tokens, base=4) if bucket_row_lens else (max_num_batched_tokens,)),
        )

    @staticmethod
    def pick(buckets: tuple[int, ...], n: int) -> int:
        return next(b for b in buckets if b >= n)

    def step_shape(self, num_tokens: int, num_rows: int, longest_row: int) -> tuple[int, int, int]:
        """(tokens, rows, tokens per row) buckets of a step."""
        T = self.pick(self.tokens, num_tokens)
        if longest_row == 1:
            return (1, 1, 1) if num_tokens == 1 else (T, self.pick(self.rows, num_rows), 1)
        return T, self.pick(self.rows, min(T, self.rows[-1])), min(self.pick(self.row_lens, longest_row), T)

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (tokens, rows, tokens per row) the scheduler can pick, decode first."""
        decode = {self.step_shape(n, n, 1) for n in range(1, self.rows[-1] + 1)}
        # A step with a row of m >= 2 tokens has at least m tokens: any token bucket T >= m. It has
        # at most rows[-1] rows of at most q tokens, so a tokens bucket past rows[-1] * q is unreachable.
        smallest = dict(zip(self.tokens, (1,) + tuple(t + 1 for t in self.tokens[:-1])))  # fewest tokens of each bucket
        mixed = {
            shape
            for T in self.tokens
            for m in {2} | {q for q in self.row_lens if 2 <= q <= T} | {T}
            if self.rows[-1] * (shape := self.step_shape(T, 1, m))[2] >= smallest[T]
        }
        return sorted(decode) + sorted(mixed)
