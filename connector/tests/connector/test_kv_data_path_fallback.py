"""Where the transport refuses device memory (a GPU node without GPUDirect): `auto` falls back to
pinned-host staging, says why and moves KV; a `device` override stops the side with the error.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from data_path_cases import RELATIVE_ERROR, relative_error
from kv_peer import GEOMETRY, HOST, NUM_BLOCKS, make_caches, receiver_config

from dllm_connector.layout import PagedKV
from dllm_connector.pipe import common as common_module
from dllm_connector.pipe.receiver import KVReceiver
from dllm_connector.pipe.sender import KVSender, SendJob
from dllm_connector.scheduler import prompt_hash
from dllm_connector.transport.base import TransportError
from dllm_connector.transport.mooncake import MooncakeTransport
from dllm_connector.transport.placement import (
    DataPath,
    PathSetting,
    Placement,
    TransportTraits,
    choose_path,
)
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


class RefusesDeviceMemoryDouble(MooncakeTransport):
    """A TEST DOUBLE of a GPU node without GPUDirect (no peer-memory driver): the real Mooncake TCP
    engine, whose first registration (the device staging) is refused as Mooncake refuses one there."""

    refused = 0

    def register(self, tensor: torch.Tensor) -> None:
        if not self.refused:
            self.refused += 1
            raise TransportError("Mooncake register_memory returned -1 (test double)")
        super().register(tensor)


def test_where_device_memory_cannot_be_registered_auto_stages_in_pinned_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU cache on auto takes the device path; when the transport then refuses device memory, the
    side comes up on pinned-host instead, saying why, and moves KV. The GPU cache is what cannot be
    had here: a double of the decision answers auto as it would for one."""

    def as_for_a_gpu_cache_double(
        kv_device: str, codec: Compression, traits: TransportTraits, setting: PathSetting = PathSetting.AUTO
    ) -> Placement:
        if setting is PathSetting.AUTO:
            return choose_path("cuda", codec, TransportTraits(traits.kind, True, True), setting)
        return choose_path(kv_device, codec, traits, setting)

    monkeypatch.setattr(common_module, "choose_path", as_for_a_gpu_cache_double)
    config = receiver_config(data_path=PathSetting.AUTO, compression=Compression.FP8, async_transfer=False)
    decode_transport, prefill_transport = MooncakeTransport(HOST), RefusesDeviceMemoryDouble(HOST)
    receiver = KVReceiver(
        decode_transport,
        PagedKV(make_caches(None), NUM_BLOCKS, GEOMETRY),
        replace(config, data_path=PathSetting.PINNED_HOST),
        HOST,
        0,
    )
    source = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    sender = KVSender(prefill_transport, source, config)
    try:
        assert sender.placement.path is DataPath.PINNED_HOST
        assert "failed (Mooncake register_memory returned -1" in sender.data_path
        hashed = prompt_hash([4, 2])
        receiver.expect("fallback", tuple(range(100, 108)), prompt_hash=hashed)
        sender.submit(SendJob("fallback", tuple(range(10, 18)), HOST, receiver.port, hashed))
        assert sender.finished()["fallback"] is None
        assert receiver.wait_for("fallback", 20) == ""
        got, want = receiver.kv.gather(list(range(100, 108))), source.gather(list(range(10, 18)))
        assert relative_error(got, want) <= RELATIVE_ERROR[Compression.FP8]
    finally:
        sender.close(timeout=10)
        receiver.close()
        prefill_transport.close()
        decode_transport.close()


def test_a_device_override_whose_memory_cannot_be_registered_stops_the_side() -> None:
    """`device` asked for by the operator is not silently changed: the registration's error stands."""
    transport = RefusesDeviceMemoryDouble(HOST)
    kv = PagedKV(make_caches(7), NUM_BLOCKS, GEOMETRY)
    try:
        with pytest.raises(TransportError, match="register_memory returned -1"):
            KVSender(transport, kv, receiver_config(data_path=PathSetting.DEVICE))
    finally:
        transport.close()
