"""Fixtures for the KV connector tests (codec, transport, pipe, vLLM plugin)."""

from __future__ import annotations

import importlib.util
import os

# Every test here drives torch (and most Mooncake or vLLM): without them there is nothing to collect.
collect_ignore_glob = [] if importlib.util.find_spec("torch") else ["test_*.py"]
# The plugin tests need vLLM itself; where it is installed but broken they fail loudly.
if not importlib.util.find_spec("vllm"):
    collect_ignore_glob.append("test_kv_vllm_plugin.py")

# Plain torch kernels in tests: compiling them costs tens of seconds on two shared cores. One test
# compares the compiled kernels with these explicitly.
os.environ.setdefault("DLLM_KV_CODEC_COMPILE", "0")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
