"""The load generator of bench/router.py: a minimal keep-alive HTTP/1.1 client on asyncio streams (cheaper
than aiohttp's), the floor's two calls without a router (either flow), and one run of requests.

`python bench/router_load.py MODE URLS CONCURRENCY COUNT SECONDS` runs one generator in its own process
(for the rows with two generators) and prints its result as JSON.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_contract.pd_params import DecodeParams, PrefillParams, new_transfer_id  # noqa: E402
from dllm_router.flows import NIXL_PREFILL_KV  # noqa: E402

PROMPT = "Explain disaggregated prefill and decode serving in one paragraph, please. " * 2
BODY = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 16}
WARM = 5  # requests per connection before measuring


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host.encode()

    @classmethod
    async def open(cls, url: str) -> Conn:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.writer.write(head % (path, self.host, len(body)) + body)
        status = int((await self.reader.readline()).split(b" ", 2)[1])
        length = -1
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if length < 0:
            raise RuntimeError("the bench client needs Content-Length answers")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def floor_request(prefill: Conn, decode: Conn) -> None:
    """The two calls without a router: prefill (one token), then decode with what prefill returned."""
    pbody = {**BODY, "max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": NIXL_PREFILL_KV}
    status, data = await prefill.post(b"/v1/completions", json.dumps(pbody).encode())
    assert status == 200, data
    kv = json.loads(data).get("kv_transfer_params")
    dbody = {**BODY, "kv_transfer_params": kv}
    status, data = await decode.post(b"/v1/completions", json.dumps(dbody).encode())
    assert status == 200, data
    json.loads(data)


# The connector protocol's params, validated and dumped once: the router caches them per pod pair, so
# the floor builds no model per request either (only the transfer id is new each time, as in the router).
_DLLM_PREFILL_KV = PrefillParams(transfer_id="t", decode_host="127.0.0.1", decode_kv_port=50051).model_dump(
    exclude_none=True
)
_DLLM_DECODE_KV = DecodeParams(transfer_id="t", prefill_host="127.0.0.1").model_dump(exclude_none=True)


async def floor_dllm_request(prefill: Conn, decode: Conn) -> None:
    """The dllm flow's two calls without a router: both at once, with the connector protocol's params."""
    tid = new_transfer_id("bench", 0)
    pbody = {
        **BODY,
        "max_tokens": 1,
        "n": 1,
        "stream": False,
        "kv_transfer_params": {**_DLLM_PREFILL_KV, "transfer_id": tid},
    }
    dbody = {**BODY, "kv_transfer_params": {**_DLLM_DECODE_KV, "transfer_id": tid}}
    (pstatus, pdata), (dstatus, ddata) = await asyncio.gather(
        prefill.post(b"/v1/completions", json.dumps(pbody).encode()),
        decode.post(b"/v1/completions", json.dumps(dbody).encode()),
    )
    assert pstatus == dstatus == 200, (pdata, ddata)
    json.loads(pdata)
    json.loads(ddata)


async def router_request(router: Conn) -> None:
    status, data = await router.post(b"/v1/completions", json.dumps(BODY).encode())
    assert status == 200, data
    json.loads(data)


async def run_load(
    mode: str, urls: list[str], concurrency: int, count: int, seconds: float
) -> dict[str, Any]:
    """`count` requests one by one (latencies), or as many as fit in `seconds` at `concurrency`."""
    cpu_at_start = time.process_time()

    async def worker(latencies: list[float], stop_at: float, quota: int) -> int:
        conns = [await Conn.open(u) for u in urls]
        done = 0
        try:
            while (quota and done < quota) or (not quota and time.perf_counter() < stop_at):
                t = time.perf_counter()
                if mode == "floor":
                    await floor_request(conns[0], conns[1])
                elif mode == "floor-dllm":
                    await floor_dllm_request(conns[0], conns[1])
                else:
                    await router_request(conns[0])
                latencies.append(time.perf_counter() - t)
                done += 1
        finally:
            for c in conns:
                c.close()
        return done

    latencies: list[float] = []
    warm: list[float] = []
    await asyncio.gather(*(worker(warm, 0.0, WARM) for _ in range(concurrency)))  # open, warm pools
    started = time.perf_counter()
    stop_at = started + seconds
    done = await asyncio.gather(*(worker(latencies, stop_at, count) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "requests": sum(done),
        "all_requests": sum(done) + WARM * concurrency,  # what the CPU counters saw
        "seconds": elapsed,
        "latencies": latencies if count else [],
        "cpu": time.process_time() - cpu_at_start,  # the generator's own, warm-up included
    }


def load_cmd(mode: str, urls: list[str], concurrency: int, count: int, seconds: float) -> list[str]:
    return [
        sys.executable,
        __file__,
        mode,
        ",".join(urls),
        str(concurrency),
        str(count),
        str(seconds),
    ]


def generate(mode: str, urls: list[str], concurrency: int, count: int, seconds: float) -> dict[str, Any]:
    """One generator: this process (it does nothing else meanwhile), so no interpreter start per run."""
    return asyncio.run(run_load(mode, urls, concurrency, count, seconds))


def generate_parallel(mode: str, urls: list[str], procs: int, concurrency: int, seconds: float) -> float:
    cmd = load_cmd(mode, urls, concurrency // procs, 0, seconds)
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT) for _ in range(procs)]
    results = [json.loads(p.communicate()[0]) for p in running]
    return float(sum(r["requests"] for r in results) / max(r["seconds"] for r in results))


if __name__ == "__main__":
    mode, urls, conc, count, secs = sys.argv[1:6]
    print(json.dumps(asyncio.run(run_load(mode, urls.split(","), int(conc), int(count), float(secs)))))
