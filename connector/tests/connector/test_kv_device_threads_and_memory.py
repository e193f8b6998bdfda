"""The connector on a GPU's terms, checked on the CPU (issue 35, gpu-review items 2, 4 and 13): each
connector thread makes a CUDA device current and works on streams of its own (made outside torch's
pool, which vLLM's forward stream comes from), drained before it gives them back, and staging that
does not fit on the device is an error that says what to lower. CUDA's own calls are stood in for
here, named so."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dllm_connector import thread_device
from dllm_connector.codec import device_checksum
from dllm_connector.pipe.device_copy import Copies
from dllm_connector.thread_device import on_callers_device, on_device, settle
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.staging import StagingBuffer

pytestmark = pytest.mark.timeout(60)
CUDA0 = torch.device("cuda", 0)


@dataclass(eq=False)
class StreamDouble:
    """Stands in for a CUDA stream: a name, and what was asked of it."""

    name: str
    log: list[tuple[str, ...]]
    waits_for: list[str] = field(default_factory=list)

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def wait_stream(self, other: StreamDouble) -> None:
        self.waits_for.append(other.name)
        self.log.append(("wait", self.name, other.name))


class CudaStreamsDouble:
    """Stands in for torch.cuda's streams and events in this process: the legacy default stream
    (`default`), the connector's own streams (thread_device.new_stream, numbered as made), a current
    stream per thread (the default at first, as on a GPU), and events that remember their stream.
    torch's pool (torch.cuda.Stream) refuses: vLLM's forward stream is one of its streams."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, ...]] = []
        self.default = StreamDouble("default", self.log)
        self._numbers = itertools.count(1)
        self._current = threading.local()
        double = self

        class EventDouble:
            def record(self, stream: StreamDouble) -> None:
                self.stream = stream

            def synchronize(self) -> None:
                double.log.append(("event synchronize", self.stream.name))

        def pool_stream(*args: object, **kwargs: object) -> None:
            raise AssertionError("a connector stream taken from torch's pool")

        monkeypatch.setattr(torch.cuda, "set_device", lambda device: self.log.append(("set", str(device))))
        monkeypatch.setattr(torch.cuda, "Stream", pool_stream)
        monkeypatch.setattr(torch.cuda, "stream", self.entered)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: self.default)
        monkeypatch.setattr(torch.cuda, "Event", EventDouble)
        monkeypatch.setattr(thread_device, "new_stream", self.new_stream)
        monkeypatch.setattr(thread_device, "_kept", thread_device._Kept())  # none kept from other tests

    def new_stream(self, device: torch.device) -> StreamDouble:
        return StreamDouble(f"own-{next(self._numbers)}", self.log)

    @property
    def current(self) -> StreamDouble:
        stream: StreamDouble = getattr(self._current, "stream", self.default)
        return stream

    @contextlib.contextmanager
    def entered(self, stream: StreamDouble) -> Iterator[None]:
        before = self.current
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def synchronized(self) -> list[str]:
        return [entry[1] for entry in self.log if entry[0] == "synchronize"]


def name_of(stream: object) -> str:
    """The name of a StreamDouble that thread_device hands out as a stream."""
    assert isinstance(stream, StreamDouble)
    return stream.name


@pytest.fixture
def cuda_streams(monkeypatch: pytest.MonkeyPatch) -> CudaStreamsDouble:
    return CudaStreamsDouble(monkeypatch)


def at_once(works: list[Callable[[], None]]) -> None:
    """Run each work on a thread of its own, all of them inside their work at the same time."""
    inside = threading.Barrier(len(works))

    def run(work: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            inside.wait(10)
            work()
            inside.wait(10)

        return both

    threads = [threading.Thread(target=on_device(CUDA0, run(work))) for work in works]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_a_connector_thread_makes_the_kv_device_current_before_its_work(
    cuda_streams: CudaStreamsDouble, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu-review item 2: threads start on cuda:0; the writer and send threads set the KV's device
    first (nothing is set off CUDA)."""
    calls = cuda_streams.log
    on_device(torch.device("cuda", 1), lambda *args: calls.append(("work", *args)))("job")
    assert calls[:2] == [("set", "cuda:1"), ("work", "job")]
    work = lambda: None  # noqa: E731
    assert on_device(torch.device("cpu"), work) is work
    # a thread made where CUDA runs takes its maker's device (Mooncake's writes, the side channel's
    # connections), and no streams: Mooncake's write threads queue no device work
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    calls.clear()
    on_callers_device(lambda: calls.append(("work",)))()
    assert calls == [("set", "cuda:3"), ("work",)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert on_callers_device(work) is work


def test_connector_threads_work_on_streams_of_their_own_drained_before_they_are_given_back(
    cuda_streams: CudaStreamsDouble,
) -> None:
    """gpu-review item 13: a connector thread's work runs on a stream the connector made (not the
    legacy default stream every transfer would queue behind, nor one of torch's pool, where vLLM's
    forward stream is), which no other thread holds meanwhile; both its streams have run what it
    queued before they are given back, even when the work fails; and a later thread reuses them."""
    seen: list[tuple[str, str]] = []

    def work() -> None:
        seen.append((cuda_streams.current.name, name_of(thread_device.side_stream(CUDA0))))

    at_once([work, work])
    assert sorted(seen) == [("own-1", "own-2"), ("own-3", "own-4")]
    assert sorted(cuda_streams.synchronized()) == ["own-1", "own-2", "own-3", "own-4"]

    def failing() -> None:
        work()
        raise RuntimeError("the transfer failed")

    cuda_streams.log.clear()
    seen.clear()
    with pytest.raises(RuntimeError):
        on_device(CUDA0, failing)()
    assert len(seen) == 1
    assert seen[0] in {("own-1", "own-2"), ("own-3", "own-4")}  # kept, not made again
    assert sorted(cuda_streams.synchronized()) == sorted(seen[0])
    assert cuda_streams.current is cuda_streams.default  # the caller's stream, as before


def test_settle_waits_for_the_calling_threads_streams_on_cuda_alone(cuda_streams: CudaStreamsDouble) -> None:
    def settled() -> None:
        settle(CUDA0)
        assert sorted(cuda_streams.synchronized()) == ["own-1", "own-2"]  # main and side, before the end

    on_device(CUDA0, settled)()
    cuda_streams.log.clear()
    settle(torch.device("cpu"))
    assert cuda_streams.log == []


def test_each_thread_copies_on_its_own_side_stream_after_its_own_work(
    cuda_streams: CudaStreamsDouble,
) -> None:
    """gpu-review item 13: one side stream shared by every transfer ordered each transfer's copies
    after every other's. A thread's copies now go on its own side stream, ordered after that thread's
    main stream; each copy's readiness is waited for on it, and a join makes the main stream wait."""
    copies = Copies(CUDA0)
    waits: dict[str, list[tuple[str, str]]] = {}

    def transfer(name: str) -> Callable[[], None]:
        def run() -> None:
            src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
            copies.copy(dst, src)()
            copies.join()
            assert torch.equal(dst, src)
            main, side = cuda_streams.current.name, name_of(thread_device.side_stream(CUDA0))
            waits[name] = [(entry[1], entry[2]) for entry in cuda_streams.log if entry[0] == "wait"]
            assert (side, main) in waits[name]  # the copy after the thread's own work
            assert (main, side) in waits[name]  # the join

        return run

    at_once([transfer("a"), transfer("b")])
    sides = {entry[1] for entry in cuda_streams.log if entry[0] == "event synchronize"}
    assert len(sides) == 2  # each thread's copies on its own side stream


def test_what_a_transport_wrote_is_read_after_the_legacy_default_stream(
    cuda_streams: CudaStreamsDouble,
) -> None:
    """Mooncake's TCP build copies into device memory on the legacy default stream: `landed` queues
    a wait of the thread's stream for it (no host sync)."""
    on_device(CUDA0, Copies(CUDA0).landed)()
    assert ("wait", "own-1", "default") in cuda_streams.log
    assert "default" not in cuda_streams.synchronized()
    Copies(torch.device("cpu")).landed()  # nothing to wait for off CUDA


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
