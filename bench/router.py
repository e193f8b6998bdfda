"""Router overhead, side by side: a two-call client (the floor) vs the same load through dllm-router.

Both runs hit the same engine doubles (FakeVllmEngine from router/tests, one process per role).
The floor client does what the router does: prefill with max_tokens=1 (stream false), then decode with
the kv_transfer_params prefill returned (the nixl flow; `--flow dllm`: both calls at once, with the
connector protocol's params). Then the same requests go through the router.

Reported: p50/p99 latency at concurrency 1, requests/s at concurrency 64 (added ms and ratio to the floor),
the router's CPU time per request, and the floor with 1 and 2 load-generator processes (if 2 processes do
not raise it, the generator is not what limits it).

The same Router also runs behind library HTTP servers (bench/router_asgi.py: uvicorn with httptools and
uvloop, granian by ASGI and by RSGI), in the same rounds, so the router's own server can be judged
against them (issue 19: it stays only if clearly ahead). `--libraries ''` leaves them out; they are
installed into .venv from requirements/bench.in when missing.

    .venv/bin/python bench/router.py --quick        # about a minute; --libraries "" under 50 s
    .venv/bin/python bench/router.py --quick --flow dllm   # the concurrent flow
    .venv/bin/python bench/router.py --pin          # taskset: engines on CPU 0, router on CPU 1

The load generator (bench/router_load.py) is a minimal keep-alive HTTP/1.1 client on asyncio streams,
cheaper than aiohttp's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The engines and the router bind their ports after an interpreter start: e2e.ports draws them below
# the ephemeral range, where no bind-to-0 socket can take one in between.
from e2e.ports import free_port  # noqa: E402
from router_load import generate, generate_parallel  # noqa: E402

DOUBLES = ROOT / "router" / "tests"
ASGI_APP = ROOT / "bench" / "router_asgi.py"
BENCH_REQUIREMENTS = ROOT / "requirements" / "bench.in"
LIBRARY_SERVERS = ("uvicorn", "granian", "granian-rsgi")  # bench/router_asgi.py's


# ---- processes ----


def taskset(cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu] if cpu else []


def start(cmd: list[str], cpu: str | None = None, quiet: bool = True) -> subprocess.Popen[bytes]:
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen([*taskset(cpu), *cmd], stdout=out, stderr=out, cwd=ROOT)


async def wait_http(url: str, path: str = "/health", seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
            writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
            line = await reader.readline()
            writer.close()
            if b" 200 " in line:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        await asyncio.sleep(0.05)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def row(name: str, floor: float, router: float, unit: str = "ms") -> str:
    fmt = ".3f" if unit == "ms" else ".0f"  # req/s and us: whole numbers
    return f"{name:<30}{floor:>10{fmt}}{router:>10{fmt}}{router - floor:>+10{fmt}}{router / floor:>8.2f}"


def tree_pids(pid: int) -> list[int]:
    """`pid` and its descendants (granian serves from a worker process under its main one)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += parents.get(p, [])
    return found


def ensure_library_servers() -> None:
    """Install requirements/bench.in into .venv when a pinned version is missing (deps.lock untouched:
    the .venv has no pip of its own, so the deps venv's pip installs into it)."""
    pins = [line.split("#")[0].strip() for line in BENCH_REQUIREMENTS.read_text().splitlines()]
    try:
        if all(metadata.version(name) == version for name, version in (p.split("==") for p in pins if p)):
            return
    except metadata.PackageNotFoundError:
        pass
    deps = Path(sys.prefix, ".deps").read_text().strip()
    pip = [f"{deps}/bin/python", "-m", "pip", "--python", sys.executable, "install", "-q"]
    subprocess.run([*pip, "-r", str(BENCH_REQUIREMENTS)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests, shorter runs (about a minute)")
    ap.add_argument("--pin", action="store_true", help="taskset engines to CPU 0, router to CPU 1")
    ap.add_argument("--router-log-level", default="info")
    ap.add_argument("--event-loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument(
        "--flow", default="nixl", choices=["nixl", "dllm"], help="nixl: sequential; dllm: concurrent"
    )
    ap.add_argument(
        "--libraries",
        default=",".join(LIBRARY_SERVERS),
        help="library servers to compare with the router's own, comma-separated ('' for none): "
        + ", ".join(LIBRARY_SERVERS),
    )
    ap.add_argument(
        "--no-disconnect-watch",
        action="store_true",
        help="library rows without the task per request that notices a client leaving (its cost)",
    )
    args = ap.parse_args()
    if args.no_disconnect_watch:
        os.environ["DLLM_BENCH_NO_DISCONNECT_WATCH"] = "1"  # bench/router_asgi.py's; inherited
    libraries = [name for name in args.libraries.split(",") if name]
    if unknown := set(libraries) - set(LIBRARY_SERVERS):
        ap.error(f"--libraries: unknown {', '.join(sorted(unknown))}")
    if libraries:
        ensure_library_servers()
    rounds, n1, secs = (3, 150, 1.2) if args.quick else (8, 500, 3.0)
    pin_engines, pin_router = ("0", "1") if args.pin else (None, None)
    ports = {role: free_port() for role in ("prefill", "decode", "router", *libraries)}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    procs = [
        start([sys.executable, __file__, "engine", "prefill", str(ports["prefill"])], pin_engines),
        start([sys.executable, __file__, "engine", "decode", str(ports["decode"])], pin_engines),
    ]
    router_flags = [
        "--flow", args.flow, "--prefill-url", url["prefill"], "--decode-url", url["decode"],
        "--log-level", args.router_log_level,
    ]  # fmt: skip
    router_cmd = [
        sys.executable, "-m", "dllm_router", "--host", "127.0.0.1", "--port", str(ports["router"]),
        *router_flags, "--event-loop", args.event_loop,
    ]  # fmt: skip
    servers = {"router": start(router_cmd, pin_router)}
    for name in libraries:  # the same Router behind uvicorn or granian (bench/router_asgi.py)
        cmd = [sys.executable, str(ASGI_APP), name, str(ports[name]), "--", *router_flags]
        servers[name] = start(cmd, pin_router)
    procs += servers.values()
    names = list(servers)
    server_pids: dict[str, list[int]] = {}
    direct = [url["prefill"], url["decode"]]
    floor_mode = "floor" if args.flow == "nixl" else "floor-dllm"
    lat: dict[str, list[float]] = {"floor": [], **{n: [] for n in names}}
    p50s: dict[str, list[float]] = {"floor": [], **{n: [] for n in names}}  # per round
    rps: dict[str, list[float]] = {"floor": [], "floor2": [], "router2": [], **{n: [] for n in names}}
    server_cpu: dict[str, list[float]] = {"c1": [], **{n: [] for n in names}}  # c=64 unless named c1
    total_cpu: dict[str, list[float]] = {"floor": [], **{n: [] for n in names}}  # all processes, c=64
    parts: dict[str, list[tuple[float, float, float]]] = {"floor": [], "router": []}
    engines = [p.pid for p in procs[:2]]  # a server's CPU is counted on its own

    def run(
        mode: str, urls: list[str], concurrency: int, count: int, seconds: float, server: str = ""
    ) -> dict[str, Any]:
        pids = server_pids.get(server, [])
        before = {pid: cpu_seconds(pid) for pid in (*engines, *pids)}
        result = generate(mode, urls, concurrency, count, seconds)
        spent = {pid: cpu_seconds(pid) - t for pid, t in before.items()}
        n = result["all_requests"]
        result["router_cpu"] = sum(spent[pid] for pid in pids) / n
        result["engines_cpu"] = sum(spent[pid] for pid in engines) / n
        result["generator_cpu"] = result["cpu"] / n
        result["total_cpu"] = result["router_cpu"] + result["engines_cpu"] + result["generator_cpu"]
        return result

    try:
        asyncio.run(wait_http(url["prefill"]))
        asyncio.run(wait_http(url["decode"]))
        for name in names:  # both engines ready behind each
            asyncio.run(wait_http(url[name], "/ready", 30.0))
            server_pids[name] = tree_pids(servers[name].pid)
        for i in range(rounds):  # interleaved, so drifting machine load hits every side alike
            order = names[i % len(names) :] + names[: i % len(names)]  # and no server always goes first
            floor1 = run(floor_mode, direct, 1, n1, 0)["latencies"]
            lat["floor"] += floor1
            p50s["floor"].append(pct(floor1, 0.5))
            for name in order:
                via1 = run("router", [url[name]], 1, n1, 0, name)
                lat[name] += via1["latencies"]
                p50s[name].append(pct(via1["latencies"], 0.5))
                if name == "router":
                    server_cpu["c1"].append(via1["router_cpu"])
            floor64 = run(floor_mode, direct, 64, 0, secs)
            total_cpu["floor"].append(floor64["total_cpu"])
            parts["floor"].append((floor64["generator_cpu"], floor64["engines_cpu"], floor64["router_cpu"]))
            rps["floor"].append(floor64["requests"] / floor64["seconds"])
            for name in order:
                via64 = run("router", [url[name]], 64, 0, secs, name)
                server_cpu[name].append(via64["router_cpu"])
                total_cpu[name].append(via64["total_cpu"])
                rps[name].append(via64["requests"] / via64["seconds"])
                if name == "router":
                    parts["router"].append(
                        (via64["generator_cpu"], via64["engines_cpu"], via64["router_cpu"])
                    )
            rps["floor2"].append(generate_parallel(floor_mode, direct, 2, 64, secs))
            rps["router2"].append(generate_parallel("router", [url["router"]], 2, 64, secs))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)

    med = {k: statistics.median(v) for k, v in rps.items()}
    load = os.getloadavg()
    print(
        f"dllm-router bench: {args.flow} flow, non-streaming, {os.cpu_count()} CPUs, pin={args.pin}, "
        f"router --log-level {args.router_log_level} --event-loop {args.event_loop}, {rounds} rounds, "
        f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        + (", library rows without the disconnect watch" if args.no_disconnect_watch else "")
    )
    print(f"{'':<30}{'floor':>10}{'router':>10}{'added':>10}{'ratio':>8}")
    print(row("p50 latency c=1 (ms)", pct(lat["floor"], 0.5), pct(lat["router"], 0.5)))
    print(row("p99 latency c=1 (ms)", pct(lat["floor"], 0.99), pct(lat["router"], 0.99)))
    print(row("req/s c=64, 1 generator", med["floor"], med["router"], "req/s"))
    print(row("req/s c=64, 2 generators", med["floor2"], med["router2"], "req/s"))
    cpu = {k: statistics.median(v) * 1e6 for k, v in server_cpu.items()}  # a server's own
    total = {k: statistics.median(v) * 1e6 for k, v in total_cpu.items()}  # all processes
    print(row("CPU per request, all procs (us)", total["floor"], total["router"], "us"))
    print(
        f"router CPU time per request: {cpu['c1']:.0f} us at c=1, {cpu['router']:.0f} us at c=64; "
        f"req/s ratio if CPU-bound (floor CPU / router CPU): {total['floor'] / total['router']:.2f}"
    )
    for side in ("floor", "router"):
        gen, eng, rtr = (statistics.median(x) * 1e6 for x in zip(*parts[side], strict=True))
        print(
            f"  {side} CPU per request at c=64: generator {gen:.0f} us, engines {eng:.0f} us, "
            f"router {rtr:.0f} us"
        )
    print(
        f"generator check: floor with 2 generator processes / with 1 = {med['floor2'] / med['floor']:.2f} "
        "(near 1.0: one generator is not what limits the floor)"
    )
    if libraries:
        print_servers(names, lat, p50s, med, cpu, total)


def print_servers(
    names: list[str],
    lat: dict[str, list[float]],
    p50s: dict[str, list[float]],
    med: dict[str, float],
    cpu: dict[str, float],
    total: dict[str, float],
) -> None:
    """The same Router behind each HTTP server, and issue 19's test: ours stays only if it is clearly
    ahead (at least 0.1 ms less added p50 at c=1, or 1.2x the requests/s at c=64)."""
    floor50, floor99 = pct(lat["floor"], 0.5), pct(lat["floor"], 0.99)
    added50 = {n: pct(lat[n], 0.5) - floor50 for n in names}
    spread = {n: sorted(s - f for s, f in zip(p50s[n], p50s["floor"], strict=True)) for n in names}
    print("\nHTTP server under the same Router (interleaved rounds; added = over the floor)")
    print(f"{'':<37}" + "".join(f"{n:>14}" for n in names))
    lines = {
        "added p50 c=1 (ms)": {n: f"{added50[n]:+.3f}" for n in names},
        "  per round, min..max (ms)": {n: f"{spread[n][0]:+.2f}..{spread[n][-1]:+.2f}" for n in names},
        "added p99 c=1 (ms)": {n: f"{pct(lat[n], 0.99) - floor99:+.3f}" for n in names},
        "req/s c=64 (median)": {n: f"{med[n]:.0f}" for n in names},
        "  ratio to the floor": {n: f"{med[n] / med['floor']:.2f}" for n in names},
        "server CPU per request c=64 (us)": {n: f"{cpu[n]:.0f}" for n in names},
        "all processes' CPU per request (us)": {n: f"{total[n]:.0f}" for n in names},
    }
    for label, cells in lines.items():
        print(f"{label:<37}" + "".join(f"{cells[n]:>14}" for n in names))
    for n in names[1:]:
        less = added50[n] - added50["router"]  # ms of added p50 ours saves over this library
        ratio = med["router"] / med[n]
        verdict = "ours clearly ahead" if less >= 0.1 or ratio >= 1.2 else "ours NOT clearly ahead"
        paired = sorted(x - r for x, r in zip(p50s[n], p50s["router"], strict=True))  # same round
        print(
            f"ours vs {n}: {less:+.3f} ms less added p50 (keep at >= 0.1), "
            f"req/s ratio {ratio:.2f} (keep at >= 1.2): {verdict}\n"
            f"  p50 saved round by round {paired[0]:+.2f}..{paired[-1]:+.2f} ms, "
            f"at least 0.1 ms in {sum(d >= 0.1 for d in paired)} of {len(paired)} rounds"
        )


def serve_engine(role: str, port: int) -> None:
    sys.path.insert(0, str(DOUBLES))
    from router_engine_double import FakeVllmEngine  # type: ignore[import-not-found, unused-ignore]

    async def run() -> None:
        engine = FakeVllmEngine(role, nixl=role == "prefill")
        engine.record = False
        await engine.start(port)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        serve_engine(sys.argv[2], int(sys.argv[3]))
    else:
        main()
