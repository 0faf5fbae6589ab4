"""The device mesh, the partition rules, and counting the collectives XLA put in a compiled step."""
