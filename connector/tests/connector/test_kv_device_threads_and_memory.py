"""The connector on a GPU's terms, checked on the CPU (issue 35, gpu-review items 2 and 4): each
connector thread makes a CUDA device current before its work, and staging that does not fit on the
device is an error that says what to lower. CUDA's own calls are stood in for here, named so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dllm_connector.codec import device_checksum
from dllm_connector.thread_device import on_callers_device, on_device
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.staging import StagingBuffer

pytestmark = pytest.mark.timeout(60)


def test_a_connector_thread_makes_the_kv_device_current_before_its_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpu-review item 2: threads start on cuda:0; the writer and send threads set the KV's device
    first (recorded here through a stand-in for torch.cuda.set_device; nothing is set off CUDA)."""
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    on_device(torch.device("cuda", 1), lambda *args: calls.append(("work", args)))("job")
    assert calls == [("set", torch.device("cuda", 1)), ("work", ("job",))]
    work = lambda: None  # noqa: E731
    assert on_device(torch.device("cpu"), work) is work
    # a thread made where CUDA runs takes its maker's device (Mooncake's writes, the side channel)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    calls.clear()
    on_callers_device(lambda: calls.append("work"))()
    assert calls == [("set", torch.device("cuda", 3)), "work"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert on_callers_device(work) is work


def test_staging_that_does_not_fit_on_the_device_says_what_to_lower(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu-review item 4: a device too full for the staging (vLLM sized its KV cache first) is a
    TransportError naming bufferSizeGB and --gpu-memory-utilization, which the automatic data path turns
    into pinned host staging; never a raw OutOfMemoryError out of register_kv_caches. The device's
    allocator is stood in for by one that is always out of memory."""
    real_empty = torch.empty

    def device_full(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", device_full)
    with pytest.raises(
        TransportError,
        match=r"4\.00 GiB of KV staging does not fit on cuda:0 .*bufferSizeGB.*gpu-memory-utilization",
    ):
        StagingBuffer(4 * 2**30, device=torch.device("cuda", 0))
    assert StagingBuffer(1024).capacity == 1024  # host staging is not the device's


def test_the_compiled_checksum_is_handed_no_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu-review item 9: the pipe checksums runs of larger buffers, and torch.compile guards on a
    view's base, so such a call could compile again on a transfer's path. The compiled kernel is stood
    in for by one that records whether it was handed views. (Whether int64 views of uint8 staging, which
    torch does not count as views, recompile is for TORCH_LOGS=recompiles on a GPU.)"""
    seen: list[bool] = []

    def recording_compile(function: Any, **_: Any) -> Any:
        def run(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
            seen.append(words._is_view() or key._is_view())
            summed: torch.Tensor = function(words, key)
            return summed

        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(device_checksum, "_compiled", {})
    monkeypatch.setattr(device_checksum, "_choice", "compiled")
    kernel = device_checksum.kernel(torch.device("cpu"))
    gathered = torch.arange(64, dtype=torch.int64)
    words = gathered[8:12]  # a run of a larger buffer, as the pipe hands it
    assert words._is_view()
    keys = device_checksum._keys(torch.device("cpu"))[: words.numel()]
    assert torch.equal(kernel(words, keys), device_checksum.terms_sum(words, keys))
    assert seen == [False] * 4  # the probes at its choice, then the pipe's run
