"""GRPO fine-tuning of causal LMs with PyTorch Lightning and Hydra.

The `pid` resolver gives the default run directory (`hydra.run.dir`) a part no other process shares, so two runs
started in the same second never write into one directory.
"""

import os

from omegaconf import OmegaConf

OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
