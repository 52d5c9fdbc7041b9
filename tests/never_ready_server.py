"""A server process that never answers (tests/unit/test_vllm_server_contract.py): it takes `vllm serve`'s arguments
and sleeps, bounded so that it ends by itself even if nothing stops it."""

import time

time.sleep(120)
