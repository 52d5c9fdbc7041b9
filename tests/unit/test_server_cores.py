"""The cores a CPU server the run starts runs on (`generator.server_cpus`; server_process.server_cpus): Linux's CPU
list format read and written (truth: the sets written out by brute force), and the default split of this process's
cores between the servers. The supervisor applying them to a started process: tests/unit/test_server_supervisor.py."""

from __future__ import annotations

import random

import pytest

from grpo_lightning.generation.vllm import server_process
from grpo_lightning.generation.vllm.server_process import cpu_list, server_cpus, server_launches
from grpo_lightning.generation.vllm.server_supervisor import parse_cpu_list
from grpo_lightning.generation.vllm.settings import ServerSettings


@pytest.mark.parametrize(
    ("spec", "cores"),
    [("0", [0]), ("0-3,5", [0, 1, 2, 3, 5]), ("5,0-1", [0, 1, 5]), ("2-2", [2]), (7, [7]), (" 1 , 3-4", [1, 3, 4])],
)
def test_a_cpu_list_is_read_as_taskset_reads_it(spec, cores):
    assert parse_cpu_list(spec) == cores


@pytest.mark.parametrize("spec", ["", "a", "-1", "1-", "3-1", "0,,1", "0-1-2"])
def test_what_is_not_a_cpu_list_is_refused(spec):
    with pytest.raises(ValueError):
        parse_cpu_list(spec)


def test_a_written_cpu_list_reads_back_as_the_same_cores():
    rng = random.Random(0)
    for _ in range(500):
        cores = sorted(rng.sample(range(64), rng.randint(1, 20)))
        written = cpu_list(cores)
        assert parse_cpu_list(written) == cores
        assert len(written.split(",")) == 1 + sum(b - a > 1 for a, b in zip(cores, cores[1:], strict=False))


@pytest.mark.parametrize(
    ("cores", "servers", "split"),
    [
        ({0, 1}, 1, ["0-1"]),
        ({0, 1}, 2, ["0", "1"]),
        ({0, 1}, 3, ["0-1", "0-1", "0-1"]),  # fewer cores than servers: each takes them all
        ({0, 1, 2, 3, 4}, 2, ["0-2", "3-4"]),
        ({2, 3, 6, 7}, 2, ["2-3", "6-7"]),  # a taskset or cgroup that leaves gaps
    ],
)
def test_unset_the_process_cores_are_split_between_the_servers(monkeypatch, cores, servers, split):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(server_process.os, "sched_getaffinity", lambda pid: cores)
    assert server_cpus(None, servers) == split
    every_core_once = sorted(cores) if len(cores) >= servers else sorted(list(cores) * servers)
    assert sorted(c for part in split for c in parse_cpu_list(part)) == every_core_once


def test_a_binding_set_in_the_environment_or_the_config_wins(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert server_cpus(None, 2) == [None, None]  # vLLM reads the user's own binding
    assert server_cpus(["1", 0], 2) == ["1", "0"]


def test_cpu_servers_are_launched_on_their_cores_and_gpu_servers_are_not(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(server_process.os, "sched_getaffinity", lambda pid: {0, 1})
    cpu = server_launches(ServerSettings(num_servers=2), "/m", cpu=True, transfer_backend="grpo_files", lora_rank=0)
    assert [launch.cpus for launch in cpu] == ["0", "1"]
    gpu = ServerSettings(num_servers=2, server_devices=["0", "1"])
    launches = server_launches(gpu, "/m", cpu=False, transfer_backend="nccl", lora_rank=0)
    assert [(launch.cpus, launch.cuda_devices) for launch in launches] == [(None, "0"), (None, "1")]
