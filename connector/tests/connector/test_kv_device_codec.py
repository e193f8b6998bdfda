"""The device codec's kernels, here with the CPU as the device: plain torch ops write the C kernels'
bytes bit for bit, a device runs torch.compile's where they write the host's bytes there (plain ops
where not), warm-up refuses a set that does not, bench/gpu_check.py finds them equal, and no kernel
set decodes a forged NaN code to NaN."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from codec_cases import GROUPS, NH64, blocks

from dllm_connector import codec
from dllm_connector.codec import kernel_sets, plain_kernels, quant
from dllm_connector.codec.header import MIN_SCALE
from dllm_contract.kvconfig import Compression

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("compression", [Compression.FP8, Compression.INT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_torch_kernels_write_the_c_kernels_bytes_on_a_realistic_kv(
    compression: Compression, dtype: torch.dtype
) -> None:
    """Two layers of 8 KV heads, head_dim 128, block size 16, with subnormal, zero, huge and
    power-of-two groups among random ones: codes, scales and decoded values, bit for bit."""
    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 3, 2 * 8, 16, 128, generator=generator) * 4
    info = torch.finfo(dtype)
    kv[0, 0, 0] = 0.0
    kv[0, 0, 1] *= info.tiny
    kv[0, 1, 2] = info.max * torch.linspace(-1, 1, 16 * 128).view(16, 128)
    kv[1, 2, 3] = 2.0 ** torch.arange(-8, 8).float().repeat(128).view(16, 128)
    kv = kv.to(dtype)
    groups = 2 * 8 * 3
    shape = tuple(kv.shape)
    codec.use_kernels("native")
    host_header, host_payload = codec.encode_parts(kv.chunk(kv.shape[0]), shape, dtype, compression, groups)
    host_values = codec.decode(host_header, host_payload)
    codec.use_kernels("plain")
    try:
        header, payload = codec.encode_parts(
            kv.chunk(kv.shape[0]), shape, dtype, compression, groups, checksum_algo=NH64
        )
        values = codec.decode(header, payload)
    finally:
        codec.use_kernels("native")
    assert torch.equal(payload, host_payload)
    assert torch.equal(values.view(torch.uint8), host_values.view(torch.uint8))


@pytest.mark.parametrize("compression", list(Compression))
def test_warm_up_for_device_staging_checks_the_kernels_there(compression: Compression) -> None:
    codec.warm_up(blocks(), compression, GROUPS, staging=torch.device("cpu"))


def _off_by_one_int8_set() -> kernel_sets._Kernels:
    """fake_off_by_one: int8 codes one above the host's (a GPU compiler's division could do that)."""
    plain = plain_kernels.PLAIN

    def fake_off_by_one(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        plain[Compression.INT8].encode_into(rows, codes, scales)
        codes.add_(1)

    int8 = plain_kernels.CodecKernels(fake_off_by_one, plain[Compression.INT8].decode_into)
    return kernel_sets._Kernels(
        {Compression.FP8: plain[Compression.FP8], Compression.INT8: int8}, "fake", 1 << 18
    )


def test_kernels_that_write_other_bytes_where_staging_is_are_refused_at_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel set whose int8 codes differ from the host's (no real set does on a CPU; a GPU
    compiler's division could), refused before any payload is written with it."""
    monkeypatch.setattr(kernel_sets, "_kernels", _off_by_one_int8_set())
    codec.warm_up(blocks(), Compression.FP8, GROUPS, staging=torch.device("cpu"))
    with pytest.raises(
        codec.CodecError, match="fake int8 KV kernels on cpu write other bytes than the host's"
    ):
        codec.warm_up(blocks(), Compression.INT8, GROUPS, staging=torch.device("cpu"))


def test_scales_divided_as_cuda_divides_by_a_python_float_are_refused_at_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fake_cuda_scalar_division: int8 scales as CUDA computes `amax / 127.0` (times fl32(1/127)), one
    ulp low for some bf16 maxima (gpu-review item 1). The warm-up's probes hold every 8-bit mantissa
    as a group's maximum, so such a set is refused; the old probes let it through."""
    plain = plain_kernels.PLAIN
    inverse_127 = torch.tensor(1 / 127, dtype=torch.float32)

    def fake_cuda_scalar_division(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (rows.abs().amax(dim=1).float() * inverse_127).clamp(min=MIN_SCALE)
        return scale.reciprocal(), scale

    int8 = plain_kernels.CodecKernels(
        plain_kernels.encoding_with(fake_cuda_scalar_division, quant.int8_codes),
        plain[Compression.INT8].decode_into,
    )
    fake = kernel_sets._Kernels(
        {Compression.FP8: plain[Compression.FP8], Compression.INT8: int8}, "fake", 1 << 18
    )
    maxima = kernel_sets._probe_rows(torch.bfloat16).float().abs().amax(dim=1)
    differ = (maxima * inverse_127) != torch.div(maxima, torch.full_like(maxima, 127.0))
    assert int(differ.sum()) >= 4, "the probes hold maxima where the two divisions part"
    assert kernel_sets._checked(fake, [torch.bfloat16]) is None
    monkeypatch.setattr(kernel_sets, "_kernels", fake)
    with pytest.raises(codec.CodecError, match="fake int8 KV kernels on cpu write other bytes"):
        codec.warm_up(blocks(), Compression.INT8, GROUPS, staging=torch.device("cpu"))


def test_a_device_set_that_writes_other_bytes_gives_way_to_plain_ops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The compiled set is what a device runs only where it writes the host's bytes; else plain ops
    (which warm-up then checks there), with a warning naming the set, the codec and the device."""
    cpu = torch.device("cpu")
    assert kernel_sets.same_on_device_or_plain(_off_by_one_int8_set(), cpu, torch.bfloat16).name == "plain"
    assert "fake int8 KV kernels on cpu write other bytes than the host's for torch.bfloat16" in caplog.text
    fine = kernel_sets._Kernels(plain_kernels.PLAIN, "fine", 1 << 18)
    assert kernel_sets.same_on_device_or_plain(fine, cpu, torch.float16) is fine


def test_plain_ops_asked_for_are_what_a_device_runs() -> None:
    assert kernel_sets._device_set(torch.device("cpu"), torch.bfloat16, "plain").name == "plain"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_device_runs_the_compiled_kernels_by_default() -> None:
    """gpu-review item 14: on a device the default (native) set's C kernels cannot serve; torch.compile's
    do, checked there against the host's bytes (here with the CPU standing for the device). An encode
    of a layer is then two compiled calls: no eager torch op computes in it, where plain ops run a
    dozen kinds (about twenty launches on a GPU)."""
    chosen = kernel_sets._device_set(torch.device("cpu"), torch.bfloat16, "native")
    assert chosen.name == "compiled"
    rows = blocks().to(torch.bfloat16).reshape(-1, 64)
    codes = torch.empty(rows.shape, dtype=torch.int8)
    scales = torch.empty(rows.shape[0], dtype=torch.float32)
    plain_ops = aten_ops(lambda: plain_kernels.PLAIN[Compression.INT8].encode_into(rows, codes, scales))
    compiled_ops = aten_ops(lambda: chosen.by_codec[Compression.INT8].encode_into(rows, codes, scales))
    assert len(plain_ops) >= 10, plain_ops
    # the compiled calls allocate, alias their arguments (no views: codec.views) and copy the scales out
    assert compiled_ops <= {"aten::empty", "aten::empty_strided", "aten::set_", "aten::copy_"}, compiled_ops


def aten_ops(run: Callable[[], None]) -> set[str]:
    """The torch ops `run` dispatches as such (a compiled kernel's own loops are not among them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        run()
    return {event.key for event in profiled.key_averages() if event.key.startswith("aten::")}


# ---- the GPU check, run here on the CPU ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_gpu_check_runs_on_the_cpu_and_finds_the_kernels_equal(tmp_path: Path) -> None:
    """bench/gpu_check.py --device cpu --quick: the same code paths as on a GPU, small sizes."""
    written = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*command, "--json", str(written)], capture_output=True, text=True, timeout=360, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report == json.loads(written.read_text())
    assert report["all_equal"] is True
    assert {"device", "torch", "triton", "goal_gbps", "sizes", "mooncake", "seconds"} <= report.keys()
    (size,) = report["sizes"]
    assert size["tokens"] == 256
    assert {row["codec"] for row in size["codec"]} == {"fp8", "int8"}
    for row in size["codec"]:
        for key in ("encode_layers_gbps", "encode_whole_gbps", "decode_layers_gbps", "decode_whole_gbps"):
            assert row[key] > 0
    assert [row["kernel"] for row in size["checksum"]] == ["eager"]
    (checksum,) = size["checksum"]
    assert checksum["blocks_gathered_gbps"] > 0
    assert checksum["blocks_in_place"].startswith("skipped")  # the Triton kernel: compiled on a GPU only
    assert len(size["equality"]) == 2
    for row in size["equality"]:
        assert row["payload_equal"] is row["decoded_equal"] is row["checksum_equal"] is True
        assert row["bytes"] > 0
    assert "skipped" in size["copies"]
    mooncake = report["mooncake"]
    assert mooncake.get("checksum_equal") is True or "skipped" in mooncake, mooncake
    assert "all equal: True" in done.stderr  # the human table
    # the pipe end to end on this one device, every layout, path and codec (gpu-review item 17)
    pipe = report["pipe"]
    assert {(row["layout"], row["path"], row["codec"]) for row in pipe} == {
        (layout, path, codec_name)
        for layout in ("nhd", "hnd", "mla")
        for path in ("device", "pinned-host")
        for codec_name in ("none", "fp8", "int8")
    }
    assert all(row["ok"] for row in pipe), [row for row in pipe if not row["ok"]]
    assert report["pipe_ok"] is True
    for row in pipe:
        zero_copy = row["path"] == "device" and row["codec"] == "none"
        assert row["taken"] == f"{row['path']} ({'zero-copy for codec none' if zero_copy else 'staged'})"
        assert (row["relative_error"] == 0.0) is (row["codec"] == "none")


@pytest.mark.parametrize("kernels", ["native", "plain"])
def test_forged_nan_codes_never_decode_to_nan(kernels: str) -> None:
    """L3 for codes: encode never writes e4m3's two NaN codes, a peer can (with a right checksum);
    every kernel set decodes them to finite values (the C kernels +-480 x scale, torch ops +-448)."""
    header, payload = codec.encode(blocks(), Compression.FP8, GROUPS)
    forged = payload.clone()
    forged[:4] = torch.tensor([0x7F, 0xFF, 0x7F, 0xFF], dtype=torch.uint8)
    forged_header = codec.KVHeader(header.codec, header.dtype, header.shape, header.groups, 0)
    forged_header = codec.KVHeader(
        header.codec, header.dtype, header.shape, header.groups, codec.checksum(forged_header, forged)
    )
    codec.use_kernels(kernels)
    try:
        values = codec.decode(forged_header, forged).float().view(-1)
    finally:
        codec.use_kernels("native")
    assert torch.isfinite(values).all()
    assert (values[:4].sign() == torch.tensor([1.0, -1.0, 1.0, -1.0])).all()
