"""trace-rl: RL post-training on token-exact traces."""

__version__ = "0.1.0"
