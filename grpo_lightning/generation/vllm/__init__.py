"""vLLM, run one of three ways: in the training process, in an engine process of its own, or as `vllm serve` servers.

- In this process or an engine process (`generator=vllm`; docs/vllm.md): `generator.py`, `VLLMGenerator`;
  `engine_process.py`, the engine calls, answered in this process or in a spawned one.
- Servers (`generator=vllm_server`; docs/scaling.md): `server.py`, `VLLMServerGenerator`; `server_checks.py`, what
  a server must be before a run trains on it; `server_claim.py`, one run per server; `server_pool.py`, which server
  a request goes to (by load; a lost one dropped) and each server's load from its `/metrics`; `server_process.py`, the
  servers a run starts; `server_supervisor.py`, run as a file, stops a started server whole; `server_weights.py`,
  the trainer side of a push; `file_transfer.py`, the server side of the `grpo_files` backend (loaded by vLLM through
  this package's plugin, pyproject.toml).
- Shared: `snapshot.py`, what overlapped rounds sample from (the engine process or the servers, holding the
  weights pushed as a round starts training); `settings.py`, the keys of both generators; `weights.py`, trained
  weights -> vLLM's parameter names, LoRA merged; `engine_io.py`, the installed build, engine and request
  arguments, output parsing.

Importing this package imports none of its modules and not vLLM; `import vllm` in a module here is absolute and
names the vLLM package.
"""
