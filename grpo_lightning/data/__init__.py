"""Prompt data (GSM8K) and the data module that serves each round's rollouts."""
