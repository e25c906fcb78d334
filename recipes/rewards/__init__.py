"""Rewards the shipped online-RL recipes name (``training.rl.rewards``): ``ladle.recipes.rewards.MODULE:FUNCTION``."""
