"""The engine: intake, the step loop, output processing, snapshots and their persistence, the tokenizer."""
