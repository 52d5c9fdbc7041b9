"""Prompt data (GSM8K, reasoning-gym's procedural tasks) and the data module that serves each round's rollouts."""
