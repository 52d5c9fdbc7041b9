"""GRPO fine-tuning of causal LMs with PyTorch Lightning and Hydra.

The `pid` resolver gives the default run directory (`hydra.run.dir`) a part no other process shares, so two runs
started in the same second never write into one directory. The `hf_decode_dtype` resolver gives the rollout
correction the HF engine's decode precision (`perf.generate.weights`; grpo_lightning/accel/settings.py). The
`positive` resolver turns a count into a switch: `generator.engine_process` is on when rounds overlap
(`rollout.max_staleness` >= 1).
"""

import os

from omegaconf import OmegaConf

from grpo_lightning.accel.settings import correction_dtype

OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
OmegaConf.register_new_resolver("hf_decode_dtype", correction_dtype, replace=True)


def _own_engine_process(max_staleness, trainer) -> bool:
    from grpo_lightning.generation.placement import trainer_world_size

    return int(max_staleness) > 0 or trainer_world_size(trainer) > 1


OmegaConf.register_new_resolver("own_engine_process", _own_engine_process, replace=True)
