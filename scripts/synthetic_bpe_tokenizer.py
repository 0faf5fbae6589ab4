"""A byte-level BPE tokenizer of any vocabulary size, grown from a small one: what a random checkpoint
of a real model's shapes serves with when the tokenizer must be real BPE (structured outputs:
llguidance reads byte-level BPE, not the word-level placeholder of make_random_checkpoint.py).

    python scripts/synthetic_bpe_tokenizer.py --base checkpoints/demo-qwen3 --vocab-size 151936 --out DIR

Tokens past the base's are merges of two earlier tokens drawn at random (at most 16 characters), so
every one is reachable and the vocabulary's trie has a real one's size; its text is noise. The base's
added tokens (<|im_end|> and the like) keep their order after the merged ones. Writes tokenizer.json and
tokenizer_config.json into --out.
"""

import argparse
import json
import random
import shutil
from pathlib import Path


def grow(tokenizer: dict, vocab_size: int, seed: int = 0) -> dict:
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"the base tokenizer is {model.get('type')}, not BPE")
    vocab, merges = dict(model["vocab"]), [list(m) if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    tokens, rng = list(vocab), random.Random(seed)
    target = vocab_size - len(tokenizer["added_tokens"])
    while len(vocab) < target:
        a, b = rng.choice(tokens), rng.choice(tokens[:4000])
        if (s := a + b) not in vocab and len(s) <= 16:
            vocab[s] = len(vocab)
            merges.append([a, b])
            tokens.append(s)
    shift = len(vocab) - len(model["vocab"])
    added = [{**t, "id": t["id"] + shift} for t in tokenizer["added_tokens"]]
    return {**tokenizer, "model": {**model, "vocab": vocab, "merges": merges}, "added_tokens": added}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a checkpoint directory with a byte-level BPE tokenizer.json")
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    grown = grow(json.loads((args.base / "tokenizer.json").read_text()), args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.json").write_text(json.dumps(grown, ensure_ascii=False))
    shutil.copy(args.base / "tokenizer_config.json", args.out / "tokenizer_config.json")


if __name__ == "__main__":
    main()
