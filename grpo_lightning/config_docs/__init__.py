"""The configuration reference page (docs/configuration.md), generated from the config files and their comments.

python -m grpo_lightning.config_docs.reference --write   # rewrite the page's generated regions
"""
