"""Two nodes on one machine over loopback: two `torchrun` agents (`--nnodes 2 --nproc-per-node 1 --node-rank R
--master-addr 127.0.0.1`, gloo), one training process each, into one run directory, as docs/scaling.md launches
them on two machines.

Truths: a 2-process run started by Lightning on one node (tests/test_ddp.py) on the same prompts
(`generator.seed_per_prefix=true`: a prompt's samples do not depend on rank or world size), and the 2-node run
itself, straight against stopped after one round and resumed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from grpo_lightning.generation.vllm.engine_io import free_port
from tests.test_ddp import ROOT, run, run_overrides, scalars

NODES = ["trainer=ddp", "trainer.num_nodes=2", "trainer.devices=1", "trainer.accelerator=cpu"]


def two_nodes(run_dir: Path, *extra: str) -> Path:
    """Both agents at once, each bounded in time; the run's processes listen on 127.0.0.1 only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    overrides = run_overrides(run_dir, 1, *NODES, *extra)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    agents = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "grpo_lightning", *overrides,
        ]  # fmt: skip
        log = open(run_dir.parent / f"{run_dir.name}.node{node}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [agent.wait(timeout=600) for agent, _ in agents]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
            log.close()
    logs = [Path(log.name).read_text()[-3000:] for _, log in agents]
    assert codes == [0, 0], "\n".join(logs)
    return run_dir


def test_two_nodes_train_what_two_processes_on_one_node_train_and_resume_exactly(tmp_path):
    reference = run(tmp_path / "one_node", 2)["dir"]
    straight = two_nodes(tmp_path / "two_nodes")
    # one run directory: the node-0 process (global rank 0) alone writes checkpoints, events and the policy
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["last.ckpt"]
    assert len(list((straight / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert (straight / "policy").is_dir()
    ranks = [torch.load(straight / f"rank{r}.pt") for r in (0, 1)]
    expected = torch.load(reference / "rank0.pt")
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in expected)
    for name in expected:
        torch.testing.assert_close(ranks[0][name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert scalars(straight, "train/reward_mean") == scalars(reference, "train/reward_mean")
    # stopped after round 0 on both nodes, then resumed to round 1 from the checkpoint: equal to the straight run
    first = two_nodes(tmp_path / "first", "trainer.max_epochs=1")
    resumed = two_nodes(tmp_path / "resumed", f"ckpt_path={first}")
    for r in (0, 1):
        a, b = torch.load(straight / f"rank{r}.pt"), torch.load(resumed / f"rank{r}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
