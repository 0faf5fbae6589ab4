"""Several processes, one engine: the launcher, the control channel, the leader's worker group and the follower loop."""
