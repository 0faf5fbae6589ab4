"""Content keys of KV blocks for the prefix cache.

Block i of a sequence is keyed by a hash chain: key_i = H(key_{i-1} || tokens of block i), with
key_{-1} = H(identity of the model, dtype, block size). So a key names the whole prefix up to the
block's end, not just the block's own tokens: two sequences share block i exactly when they agree
on every token before it. BLAKE2b with 128-bit digests: collisions are not a practical concern,
unlike Python's 64-bit `hash`, and hashing a 16-token block costs about a microsecond.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_SIZE = 16


def root_key(identity: str) -> bytes:
    """The chain's starting key: distinct models, dtypes or block sizes never share a block."""
    return hashlib.blake2b(identity.encode(), digest_size=DIGEST_SIZE).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=DIGEST_SIZE).digest()


def block_keys(root: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of every full block of `tokens`."""
    keys, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys
