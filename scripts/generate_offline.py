#!/usr/bin/env python
"""Offline batch generation: JSONL prompts in, JSONL completions out (see jtp/entrypoints/batch.py).

    python scripts/generate_offline.py --input in.jsonl --output out.jsonl [--model DIR] [--limit N]
        [engine flags: --tensor-parallel-size N --dtype D --max-num-seqs N --num-blocks N ...]

The same program as `jtp batch`; greedy unless a line sets temperature; resumable.
"""
import sys
from pathlib import Path

# Runs from a plain checkout too, without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jtp.entrypoints.batch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
