"""The product on the real node, as users run it: `make demo` (python -m e2e.demo up, then down)
deploys the CPU sample once for the whole module; the chart's operator pod, the engines and router in
pods from the images built here, requests through the router's Service (a ClusterIP through kube-proxy,
engines found through the headless Services' DNS), the operator's NetworkPolicies against a pod of
another namespace, and the faults users meet, which run last (they kill, roll and scale the sample)."""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e import demo
from e2e.cluster import probepod
from e2e.dataplane import kv_moved
from e2e.dataplane.pipeline import (
    DEMO_ANSWER,
    counter,
    metrics_text,
    post_json,
    start_single_engine,
    wait_healthy,
)
from e2e.engine_paths import ENGINE_PATHS, FORGED_OFFER_SCRIPT, OPEN_PATHS, STATUS_SCRIPT, WRONG_KEY
from e2e.fixtures import BLOCKED, Cluster, probe_dial, start_probe_servers, wait_until
from e2e.pod_logs import PodLogs, kept_logs
from e2e.rolling import RollOutcomes, Trickle, roll_under_load, rolled
from e2e.served_sample import (
    NAME,
    NAMESPACE,
    PROMPTS,
    SAMPLE_PODS,
    Served,
    completion,
    connect_from_engine,
    deployed,
    engine_pid,
    engine_ports,
    faulty_cr,
    listening_ports,
    stream_frozen_mid_way,
    tokens,
)
from prometheus_client.parser import text_string_to_metric_families

from dllm_contract.router_defaults import MOONCAKE_BOOTSTRAP_PORT
from dllm_operator.api import parse
from dllm_operator.config import OperatorConfig
from dllm_operator.render import auth
from dllm_operator.render.router import router_args

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def served(cluster: Cluster) -> Iterator[Served]:
    """The sample deployed once for the whole module: every test here shares it."""
    yield from deployed(cluster)


@pytest.fixture(scope="module")
def sample_logs(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodLogs]:
    """Every log line of every sample pod for the whole module, replaced pods' included."""
    with kept_logs(served.cluster, NAMESPACE, SAMPLE_PODS, tmp_path_factory.mktemp("sample-logs")) as logs:
        yield logs


@pytest.fixture(autouse=True)
def engine_logs_on_failure(sample_logs: PodLogs, request: pytest.FixtureRequest) -> Iterator[None]:
    """When a test here fails, what each engine and the router said (a 500 from vLLM names nothing
    itself): the noteworthy lines, and where every whole log is."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        print(f"\n{request.node.name} failed; every sample pod's whole log: {sample_logs.directory}\n"
              f"{sample_logs.noteworthy()}", file=sys.__stderr__)  # fmt: skip


def test_make_demo_answers_through_the_router_service(served: Served) -> None:
    """What `make demo` shows: the sample Ready through real probes, the operator a pod on the real
    node from the image built here, and one chat completion with decode's KV loaded over the wire."""
    out = served.demo_output
    assert "Ready=True" in out
    assert re.search(r"dllm-dllm-operator-\S+\s+1/1\s+Running\s+\d+.*dllm-real-0", out), out
    assert re.search(r"answer:\s+'.+'", out), out
    assert f"answer:   {DEMO_ANSWER[:20]}" in out.replace("'", ""), out  # the tiny model's learnt answer
    loaded = re.search(
        r"decode loaded (\d+) prompt tokens of KV from prefill instead of computing them:\s+"
        r"(\d+) bytes of KV, (\d+) bytes on the wire",
        out,
    )
    assert loaded is not None, out
    # The demo itself fails unless decode's counters equal the layout's arithmetic; here, that what it
    # printed is that arithmetic for its prompt: every token loaded, whole blocks of float32 KV.
    tokens, kv, wire = (int(group) for group in loaded.groups())
    want = kv_moved.for_sample(served.model, [tokens])
    assert (tokens, kv, wire) == (want.tokens, want.kv_bytes, want.wire_bytes)
    assert kv == -(-tokens // 32) * 32 * 2048  # 2 layers x 2 KV heads x 64 x K,V x float32, whole blocks
    assert re.search(r"curl -s http://10\.96\.\d+\.\d+:8000/v1/chat/completions", out), out
    # The router's KV check, read by the operator: the condition, and `kubectl get dllm`'s KV column.
    assert re.search(r"KVTransferVerified=True \(Verified\): 1 pairs verified; latest: decode loaded", out), (
        out
    )
    assert re.search(rf"^{NAME}\s+1/1\s+1/1\s+True\s+mooncake\s+Verified\s", out, re.MULTILINE), out


def test_the_operator_runs_as_a_pod_from_its_image_with_the_charts_identity(served: Served) -> None:
    pods = served.cluster.get_json(
        "pods", "-n", demo.SYSTEM_NAMESPACE, "-l", "app.kubernetes.io/name=dllm-operator"
    )
    [pod] = pods["items"]
    assert pod["spec"]["nodeName"] == "dllm-real-0"
    assert pod["spec"]["containers"][0]["image"] == "localhost/dllm/operator:dev"
    assert pod["spec"]["serviceAccountName"] == "dllm-dllm-operator"
    assert all(s["ready"] for s in pod["status"]["containerStatuses"])
    namespace = served.cluster.get_json("namespace", demo.SYSTEM_NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # It reconciled the sample: the status is the operator's, at the current generation.
    cr = served.get("dllm", NAME)
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]


def test_engines_are_ready_through_their_own_probes_on_the_real_node(served: Served) -> None:
    for pod_name in (served.engine_pod("prefill"), served.engine_pod("decode")):
        pod = served.get("pod", pod_name)
        assert pod["spec"]["nodeName"] == "dllm-real-0"
        container = pod["spec"]["containers"][0]
        assert container["image"] == "localhost/dllm/vllm-cpu:dev"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health", probe
        assert pod["status"]["containerStatuses"][0]["ready"]
        restarts = pod["status"]["containerStatuses"][0]["restartCount"]
        assert restarts == 0, served.why_restarted(pod_name)


def test_the_router_runs_exactly_the_arguments_the_operator_rendered(served: Served) -> None:
    [pod] = served.get("pods", "-l", "app.kubernetes.io/component=router")["items"]
    cmdline = served.cluster.run(
        "exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "cat", "/proc/1/cmdline"
    )
    argv = cmdline.stdout.split("\0")[:-1]
    script = next(i for i, arg in enumerate(argv) if arg.endswith("/dllm-router"))
    sample = parse(
        {**yaml.safe_load(demo.SAMPLE.read_text()), "metadata": {"name": NAME, "namespace": NAMESPACE}}
    )
    assert argv[script + 1 :] == router_args(sample, OperatorConfig())


def test_completions_through_the_router_service_equal_one_engine(served: Served, tmp_path: Path) -> None:
    decode = served.pod_url(served.engine_pod("decode"))
    before = kv_moved.at(decode, served.router)
    through_service, prompt_tokens = {}, []
    for prompt in PROMPTS:
        status, body = completion(served.router, prompt)
        assert status == 200, body
        through_service[prompt] = tokens(body)
        prompt_tokens.append(int(body["usage"]["prompt_tokens"]))
    # Decode's own counters: every prompt token came from prefill (none computed there), in the
    # bytes the layout gives for the prompts' blocks.
    want = kv_moved.for_sample(served.model, prompt_tokens)
    kv_moved.wait_for(decode, before, want, router_url=served.router)
    reference = wait_healthy(start_single_engine(served.model, tmp_path))
    try:
        for prompt in PROMPTS:
            status, body = completion(reference.url, prompt)
            assert status == 200, body
            assert through_service[prompt] == tokens(body), prompt[:30]
    finally:
        reference.stop()


def forged_params(transfer_id: str, decode_host: str) -> dict[str, Any]:
    """A client's kv_transfer_params naming a transfer id and a decode host of its own choosing."""
    return {
        "dllm": 1,
        "transfer_id": transfer_id,
        "do_remote_decode": True,
        "do_remote_prefill": True,
        "decode_host": decode_host,
        "prefill_host": "198.51.100.8",
        "decode_kv_port": 1,
    }


AUTH_SECRET = NAME + auth.SECRET_SUFFIX


def engine_api_key(served: Served) -> str:
    secret = served.get("secret", AUTH_SECRET)
    return base64.b64decode(secret["data"]["api-key"]).decode()


def test_a_clients_kv_transfer_params_steer_no_transfer_and_stop_no_engine(served: Served) -> None:
    """NEW-2 through the router Service: a client's kv_transfer_params naming a transfer id and hosts
    of its choosing, top-level and in vllm_xargs on a PD request, and in vllm_xargs alone on a one-token
    request (prefill answers it alone, with no params of the router's to override the client's). The
    answers are served; what the engines did is read from them, not assumed: decode loaded the PD
    prompt's full blocks from prefill, neither engine logged the client's ids or hosts, and neither
    restarted. The controls, sent to prefill directly with the engines' key, show what the router kept
    from the engines: vLLM refuses the one-token body as the client wrote it, and acts on top-level
    params (its connector tries the send and logs the transfer id)."""
    decode_url = served.pod_url(served.engine_pod("decode"))
    before = kv_moved.at(decode_url, served.router)
    restarts = {
        role: served.get("pod", served.engine_pod(role))["status"]["containerStatuses"][0]["restartCount"]
        for role in ("prefill", "decode")
    }
    pd = forged_params("client-chosen-7f3a", "198.51.100.7")
    body = {
        "model": "tiny-llama",
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "temperature": 0,
        "kv_transfer_params": pd,
        "vllm_xargs": {"kv_transfer_params": pd},
    }
    status, answer = post_json(served.router + "/v1/completions", body, timeout=600)
    assert status == 200, answer
    assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] != pd
    want = kv_moved.for_sample(served.model, [int(answer["usage"]["prompt_tokens"])])
    kv_moved.wait_for(decode_url, before, want, router_url=served.router)
    one_token = forged_params("client-chosen-one-token", "198.51.100.6")
    one_token_body = {**body, "max_tokens": 1, "vllm_xargs": {"kv_transfer_params": one_token}}
    del one_token_body["kv_transfer_params"]
    status, answer = post_json(served.router + "/v1/completions", one_token_body, timeout=600)
    assert status == 200, answer
    # The controls, straight to prefill with the engines' key. The one-token body as the client sent
    # it: vLLM refuses an object in vllm_xargs (400), so the 200 above is the router's removal seen.
    key = {"Authorization": f"Bearer {engine_api_key(served)}"}
    prefill_url = served.pod_url(served.engine_pod("prefill")) + "/v1/completions"
    status, answer = post_json(prefill_url, one_token_body, timeout=600, headers=key)
    assert status == 400, answer
    assert "vllm_xargs.kv_transfer_params" in json.dumps(answer), answer
    # Top-level params: prefill's connector acts on them (tries the send, refuses the client's peer in a
    # log line naming the transfer id), so the absence of the client's ids below means something.
    control = {**body, "max_tokens": 1, "kv_transfer_params": forged_params("control-1", "198.51.100.9")}
    del control["vllm_xargs"]
    status, answer = post_json(prefill_url, control, timeout=600, headers=key)
    assert status == 200, answer

    def prefill_log() -> str:
        return str(served.cluster.run("logs", "-n", NAMESPACE, served.engine_pod("prefill")).stdout)

    seen = wait_until(
        lambda: (log := prefill_log()) and "KV send control-1 failed" in log and log,
        60,
        "the control's log line",
    )
    for role in ("prefill", "decode"):
        pod = served.get("pod", served.engine_pod(role))
        assert pod["status"]["containerStatuses"][0]["restartCount"] == restarts[role], role
        log = (
            seen
            if role == "prefill"
            else served.cluster.run("logs", "-n", NAMESPACE, pod["metadata"]["name"]).stdout
        )
        for chosen in (
            "client-chosen-7f3a",
            "client-chosen-one-token",
            "198.51.100.7",
            "198.51.100.6",
        ):
            assert chosen not in log, (role, chosen)


# ---- the operator's NetworkPolicies, enforced by kube-router (before the faults below change the pods) --


def test_a_pod_of_another_namespace_reaches_no_engine_port_while_the_router_serves(
    served: Served, other_namespace: str
) -> None:
    cluster, ns = served.cluster, NAMESPACE
    policies = {p["metadata"]["name"] for p in cluster.get_json("networkpolicy", "-n", ns)["items"]}
    assert f"{NAME}-engines" in policies, (
        f"the operator rendered no engines NetworkPolicy ({sorted(policies)}): is the image "
        "localhost/dllm/operator:dev older than the operator's NetworkPolicy rendering? (make images)"
    )
    start_probe_servers(cluster, served.layout, [("stranger", other_namespace, {})])
    kv_listening: dict[str, list[int]] = {}
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        pod = served.get("pod", served.engine_pod(role))
        declared, transfer = engine_ports(pod)
        listening = listening_ports(cluster, pod["metadata"]["name"], ns)
        assert declared[0] == 8000, (role, declared)
        assert 8000 in listening, (role, sorted(listening))
        kv_ports = set(declared[1:]) | set(transfer) | {MOONCAKE_BOOTSTRAP_PORT}
        kv_listening[role] = sorted(listening & kv_ports)
        ip = pod["status"]["podIP"]
        # The other engine of this CR reaches every port that listens: they are reachable at all.
        peer_pod = served.engine_pod(peer)
        from_peer = connect_from_engine(cluster, peer_pod, ns, [f"{ip}:{p}" for p in sorted(listening)])
        assert set(from_peer.values()) == {"open"}, (role, from_peer)
        # A pod of another namespace reaches none of them, nor any port the CR declares: HTTP, the side
        # channel, Mooncake's bootstrap and its whole transfer range.
        ports = sorted(listening | set(declared) | set(transfer) | {MOONCAKE_BOOTSTRAP_PORT})
        outcomes = probe_dial(cluster, "stranger", other_namespace, *[f"{ip}:{p}" for p in ports])
        assert all(outcome in BLOCKED for outcome in outcomes.values()), (role, outcomes)
        print(f"\n{role}: listening {sorted(listening)}; from another namespace {len(ports)} ports tried, "
              f"{sorted(collections.Counter(outcomes.values()).items())}")  # fmt: skip
    # The KV path was among what was tried: some KV port listened (the side channel, Mooncake's).
    assert any(kv_listening.values()), kv_listening

    wait_until(lambda: demo.answers(served.router + "/ready"), 120, "the router's /ready")
    body = {"model": "tiny-llama", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    status, answer = post_json(served.router + "/v1/completions", body, timeout=600)
    assert status == 200, answer
    assert len(answer["choices"]) == 1, answer


# The container's memory use as its cgroup counts it (what the OOM killer compares with the limit),
# cgroup v2 or v1.
ROUTER_CGROUP_MEMORY = """\
from pathlib import Path
for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
    if Path(path).exists():
        print(Path(path).read_text().strip())
        break
"""


HEAD_TIMEOUT_S = 10  # the router's --head-timeout-s default, which the sample keeps


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def pod_running(cluster: Cluster, pod: str, namespace: str) -> bool:
    statuses = cluster.get_json("pod", pod, "-n", namespace).get("status", {}).get("containerStatuses", [])
    return bool(statuses) and "running" in statuses[0].get("state", {})


def run_python(cluster: Cluster, pod: str, script: str, *args: str) -> dict[str, Any]:
    """A script's JSON answer, run by the Python of `pod`'s image (the router's, here)."""
    result = cluster.run("exec", pod, "-n", NAMESPACE, "--", "python3", "-c", script, *args, timeout=300)
    return dict(json.loads(result.stdout))


def test_inside_the_namespace_only_the_engine_key_opens_an_engine(served: Served) -> None:
    """Issue 32, against the deployed sample with every boundary on. A pod of the namespace without the
    resource's labels reaches no engine port. A pod that carries decode's labels (so the NetworkPolicy
    admits it to every engine port; never Ready, so no Service lists it, and its name is no member of
    the StatefulSet) and the router pod itself get 401 on every engine path without the engine key or
    with a wrong one, the probes' paths stay open, and a side-channel peer that skips the authenticated
    hello is refused before any JSON. The router serves throughout."""
    cluster, ns = served.cluster, NAMESPACE
    router_pod = served.get("pod", "-l", f"{SAMPLE_PODS},app.kubernetes.io/component=router")["items"][0]
    decode_labels = {
        k: v
        for k, v in served.get("pod", served.engine_pod("decode"))["metadata"]["labels"].items()
        if k.startswith("app.kubernetes")
    }
    image = router_pod["spec"]["containers"][0]["image"]  # it has Python
    impostor = probepod.probe_pod(
        "impostor", ns, ["-c", "import time; time.sleep(1e9)"], image, decode_labels
    )
    impostor["spec"]["containers"][0] |= {
        "command": ["python3"],
        "readinessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 60},
    }
    start_probe_servers(cluster, served.layout, [("neighbour", ns, {})])
    cluster.apply(impostor)
    try:
        wait_until(lambda: pod_running(cluster, "impostor", ns), 120, "the impostor pod running")
        askers = {"impostor": "impostor", "the router pod": router_pod["metadata"]["name"]}
        items = [f"{method} {path}" for method, path in ENGINE_PATHS]
        for role in ("prefill", "decode"):
            pod = served.get("pod", served.engine_pod(role))
            ip = pod["status"]["podIP"]
            declared, transfer = engine_ports(pod)
            ports = sorted(set(declared) | set(transfer))
            outcomes = probe_dial(cluster, "neighbour", ns, *[f"{ip}:{p}" for p in ports])
            assert all(outcome in BLOCKED for outcome in outcomes.values()), (role, outcomes)
            for who, asker in askers.items():
                for key in ("", WRONG_KEY):
                    statuses = run_python(cluster, asker, STATUS_SCRIPT, f"http://{ip}:8000", key, *items)
                    assert set(statuses.values()) == {401}, (role, who, key and "wrong key", statuses)
                probes = run_python(
                    cluster, asker, STATUS_SCRIPT, f"http://{ip}:8000", "", *[f"GET {p}" for p in OPEN_PATHS]
                )
                assert set(probes.values()) == {200}, (role, who, probes)
        # Decode's side channel, where prefill pushes: a JSON offer in place of the hello.
        decode = served.get("pod", served.engine_pod("decode"))
        side_channel = engine_ports(decode)[0][1]
        forged = run_python(
            cluster, "impostor", FORGED_OFFER_SCRIPT, decode["status"]["podIP"], str(side_channel)
        )
        assert forged["closed"], forged
        assert "accept" not in forged["answer"], forged
        impostor_ip = cluster.get_json("pod", "impostor", "-n", ns)["status"]["podIP"]
        log = cluster.run("logs", "-n", ns, served.engine_pod("decode")).stdout
        assert f"refused a connection from {impostor_ip}" in log
        status, answer = completion(served.router, PROMPTS[0])
        assert status == 200, answer
    finally:
        cluster.run("delete", "pod", "impostor", "neighbour", "-n", ns, "--wait=false", check=False)


def test_silent_sockets_past_the_routers_connection_cap_lock_no_client_out(served: Served) -> None:
    """NEW-5 through the router Service: --max-connections + 50 connections that send nothing, held
    open, while a client asks. It is served within the head deadline (a new connection takes the slot of
    the longest-idle one once that has been silent past a short grace; the router may still be accepting
    the burst when the client first asks, and then refuses it 503 at once), and the router pod neither
    restarts nor nears its memory limit."""
    router = served.get("pod", "-l", f"{SAMPLE_PODS},app.kubernetes.io/component=router")["items"][0]
    name = router["metadata"]["name"]
    restarts = router["status"]["containerStatuses"][0]["restartCount"]
    args = router["spec"]["containers"][0]["args"]
    cap = int(args[args.index("--max-connections") + 1]) if "--max-connections" in args else 1024
    host, port = served.router.removeprefix("http://").rsplit(":", 1)
    silent: list[socket.socket] = []
    try:
        for _ in range(cap + 50):
            silent.append(socket.create_connection((host, int(port)), timeout=10))
        answers: list[tuple[int, dict[str, Any]]] = []

        def served_once() -> bool:
            answers.append(completion(served.router, PROMPTS[1]))
            return answers[-1][0] == 200

        wait_until(served_once, HEAD_TIMEOUT_S, f"a client served past {cap + 50} silent sockets")
        assert {status for status, _ in answers} <= {200, 503}, answers
    finally:
        for sock in silent:
            sock.close()
    after = served.get("pod", name)["status"]["containerStatuses"][0]
    assert after["restartCount"] == restarts, after
    limit = quantity_bytes(router["spec"]["containers"][0]["resources"]["limits"]["memory"])
    used = int(
        served.cluster.run("exec", name, "-n", NAMESPACE, "--", "python3", "-c", ROUTER_CGROUP_MEMORY).stdout
    )
    print(
        f"\nrouter memory after {cap + 50} silent sockets: {used / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB"
    )
    assert used < limit / 2, (used, limit)


def router_metric(served: Served, name: str) -> float:
    """A sample of the router's own /metrics (a GET without a body: never charged to its budget)."""
    text = metrics_text(served.router)
    found = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in the router's /metrics"
    return float(found.group(1))


def test_uploads_past_the_routers_memory_budget_are_refused_and_it_stays_under_its_limit(
    served: Served,
) -> None:
    """NEW-1 through the router Service: uploads that each send nearly --max-body-mb and stall, until
    together they are past --memory-budget-mb. As each new one needs room the oldest stalled one is
    refused 503 `memory_budget`, a normal request is served meanwhile, the router pod stays far under
    its memory limit and never restarts."""
    router = served.get("pod", "-l", f"{SAMPLE_PODS},app.kubernetes.io/component=router")["items"][0]
    name = router["metadata"]["name"]
    restarts = router["status"]["containerStatuses"][0]["restartCount"]
    args = router["spec"]["containers"][0]["args"]
    body_mb, budget_mb = (int(args[args.index(flag) + 1]) for flag in ("--max-body-mb", "--memory-budget-mb"))
    fit = budget_mb // body_mb  # uploads the budget holds
    refused_metric = 'dllm_router_errors_total{kind="memory_budget"}'
    refused_before = (
        router_metric(served, refused_metric) if refused_metric in metrics_text(served.router) else 0
    )
    host, port = served.router.removeprefix("http://").rsplit(":", 1)
    declared = body_mb * 2**20 - 1024
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n"
    ).encode()
    sent = head + b'{"prompt": "' + b"x" * (declared - 4096)
    stalled: list[socket.socket] = []
    try:
        for _ in range(fit + 8):
            sock = socket.create_connection((host, int(port)), timeout=30)
            stalled.append(sock)
            with contextlib.suppress(OSError):  # refused and closed while it was sending
                sock.sendall(sent)
        wait_until(
            lambda: router_metric(served, refused_metric) - refused_before >= 8,
            60,
            "the uploads past the budget refused as memory_budget",
        )
        held = router_metric(served, 'dllm_router_memory_budget_bytes{state="held"}')
        assert held >= (fit - 1) * body_mb * 2**20 * 0.9, held  # the stalled uploads are charged
        status, answer = completion(served.router, PROMPTS[1])  # with the budget full of them
        assert status == 200, answer
        script = ROUTER_CGROUP_MEMORY
        used = int(served.cluster.run("exec", name, "-n", NAMESPACE, "--", "python3", "-c", script).stdout)
    finally:
        for sock in stalled:
            sock.close()
    limit = quantity_bytes(router["spec"]["containers"][0]["resources"]["limits"]["memory"])
    mib = 2**20
    print(
        f"\nrouter memory with {fit + 8} uploads of {body_mb} MiB: {used / mib:.0f} of {limit / mib:.0f} MiB"
    )
    assert used < limit * 3 / 4, (used, limit)
    wait_until(
        lambda: completion(served.router, PROMPTS[1])[0] == 200, 30, "a request served after the uploads"
    )
    after = served.get("pod", name)["status"]["containerStatuses"][0]
    assert after["restartCount"] == restarts, after


def kv_condition(served: Served) -> dict[str, Any]:
    return served.condition("KVTransferVerified")


# A long prompt for the byte-level tiny model: 450 of the sample's 512 tokens, the answer's 12 after it.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10


def patch_sample(served: Served, patch: dict[str, Any], check: bool = True) -> Any:
    return served.cluster.run(
        "patch", "dllm", NAME, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(patch), check=check
    )


def users_served(served: Served, role: str, pod: str) -> float:
    """Requests the engine pod finished, less the router's KV check canaries it answered."""
    url = served.pod_url(pod)
    canaries = kv_moved.canary_totals(metrics_text(served.router), role, url.split("://", 1)[-1])
    return counter(metrics_text(url), "vllm:request_success") - canaries["requests"]


def event_messages(served: Served, reason: str) -> list[str]:
    items = served.cluster.get_json("events", "-n", NAMESPACE, "--field-selector", f"reason={reason}")[
        "items"
    ]
    return [str(e["message"]) for e in items]


def test_autoscaling_recommends_then_adds_a_prefill_pod_under_long_prompts_and_takes_it_away_when_idle(
    served: Served,
) -> None:
    """spec.autoscaling on the running sample, the operator pod reading the engines' and router's /metrics
    over the pod network (their NetworkPolicies admitting it, kube-router enforcing). Under a burst of long
    prompts from two clients, with a time-to-first-token target below what two busy cores give: advisory
    mode recommends prefill 2 (and measures decode's real KV-cache usage), with its Event, and scales
    nothing; active mode adds the second prefill pod, the router sends users' prompts to it, and a
    hand-set prefill count is refused meanwhile; when the burst ends the idle prefill goes back to one
    pod after the scale-down window, and a client sends through its drain. No request fails."""
    prefill = {"minReplicas": 1, "maxReplicas": 2, "target": {"timeToFirstTokenSeconds": 0.001}}
    advisory = {
        "mode": "advisory",
        "prefill": prefill,
        "decode": {"maxReplicas": 2, "target": {"kvCacheUsage": 0.5}},
        "scaleDownStabilizationSeconds": 20,
    }
    patch_sample(served, {"spec": {"autoscaling": advisory}})
    trickles: list[Trickle] = []
    try:
        with contextlib.ExitStack() as burst:
            trickles += [
                burst.enter_context(Trickle(served, f"burst{i}", prompt=LONG_PROMPT)) for i in range(2)
            ]

            def recommended() -> dict[str, Any] | None:
                found: dict[str, Any] = served.get("dllm", NAME).get("status", {}).get("autoscaling", {})
                prefill, decode = found.get("prefill", {}), found.get("decode", {})
                return found if prefill.get("replicas") == 2 and "value" in decode else None

            found = wait_until(
                recommended, 180, "advisory: prefill recommended 2, decode measured", interval=5.0
            )
            assert found["prefill"]["measure"] == "time to first token (s)"
            assert found["prefill"]["value"] > 0.001, found
            assert 0 <= found["decode"]["value"] <= 1, found
            assert any("prefill 2" in m for m in event_messages(served, "AutoscalingRecommendation"))
            sts = {
                role: served.get("statefulset", f"{NAME}-{role}")["spec"]["replicas"]
                for role in ("prefill", "decode")
            }
            assert sts == {"prefill": 1, "decode": 1}  # advisory: nothing scaled

            # active, for prefill only (decode keeps its hand-set replica)
            patch_sample(
                served,
                {"spec": {"prefill": {"replicas": None}, "autoscaling": {"mode": "active", "decode": None}}},
            )
            wait_until(
                lambda: served.get("dllm", NAME)["status"]["prefill"]["ready"] == "2/2",
                600,
                "a second prefill pod, ready",
            )
            second = served.engine_pod("prefill", 1)
            wait_until(
                lambda: users_served(served, "prefill", second) > 0,
                300,
                "the router to send users' prompts to the new prefill pod",
                interval=2.0,
            )
            refused = patch_sample(served, {"spec": {"prefill": {"replicas": 1}}}, check=False)
            assert refused.returncode != 0
            assert "prefill.replicas may not be set while autoscaling.mode is active" in refused.stderr
        assert any(
            m.startswith("prefill: scaled 1 to 2") for m in event_messages(served, "AutoscalingScaled")
        )

        # the burst is over: prefill idle, one step down after the window
        wait_until(
            lambda: any(
                m.startswith("prefill: scaled 2 to 1") for m in event_messages(served, "AutoscalingScaled")
            ),
            240,
            "the autoscaler to take prefill back to one pod",
            interval=5.0,
        )
        status = served.get("dllm", NAME)["status"]
        assert status["autoscaling"]["prefill"]["value"] == 0, status["autoscaling"]  # idle: no one waits
        # a client sends through prefill-1's drain (the target raised first, so its own first tokens
        # cannot bring the second pod back meanwhile)
        relaxed = {**prefill, "target": {"timeToFirstTokenSeconds": 600}}
        patch_sample(served, {"spec": {"autoscaling": {"prefill": relaxed}}})
        with Trickle(served, "drain") as drain:
            trickles.append(drain)
            wait_until(
                lambda: not served.cluster.exists("pod", second, "-n", NAMESPACE),
                300,
                "prefill-1 gone",
            )
            sent = len(drain.outcomes)
            wait_until(lambda: len(drain.outcomes) > sent, 120, "a request after prefill-1 went")
        assert served.get("statefulset", f"{NAME}-prefill")["spec"]["replicas"] == 1
        outcomes = [o for t in trickles for o in t.outcomes]
        assert outcomes
        assert [o for o in outcomes if o.status != 200 or o.kind] == [], "requests failed while scaling"
    finally:
        off = {"mode": "off", "prefill": None, "decode": None}
        patch_sample(served, {"spec": {"prefill": {"replicas": 1}, "autoscaling": off}})
        wait_until(
            lambda: served.get("dllm", NAME)["status"]["prefill"]["ready"] == "1/1",
            300,
            "the sample's one prefill",
        )


def test_deleting_the_auth_secret_and_restarting_the_pods_rotates_every_key(served: Served) -> None:
    """The documented rotation (NEW-10): delete `<name>-dllm-auth` and restart the pods. The new pods
    wait on the missing Secret; the operator, which may create but never read Secrets, sees them wait
    and makes a new one at once (not at its next resync); every pod starts with the new keys, the KV
    path is verified again under the new side-channel key, and the old engine key opens nothing.
    Meanwhile a cluster admin who tries to plant keys of their own under the reserved name, or to
    change the keys in place, is refused by the chart's policy, so the operator's Secret is the only one
    that name ever holds."""
    old_key = engine_api_key(served)
    old_uid = served.get("secret", AUTH_SECRET)["metadata"]["uid"]
    planted = {
        "kv-token": base64.b64encode(b"known").decode(),
        "api-key": base64.b64encode(b"known").decode(),
    }
    changed = served.cluster.run(
        "patch", "secret", AUTH_SECRET, "-n", NAMESPACE, "-p", json.dumps({"data": planted}), check=False
    )
    assert changed.returncode != 0
    assert "reserved for the dllm-operator" in changed.stderr, changed.stderr
    served.cluster.run("delete", "secret", AUTH_SECRET, "-n", NAMESPACE)
    squat = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": AUTH_SECRET}, "data": planted}
    squatted = served.cluster.run(
        "create", "-n", NAMESPACE, "-f", "-", input_text=json.dumps(squat), check=False
    )
    assert squatted.returncode != 0
    assert "reserved for the dllm-operator" in squatted.stderr, squatted.stderr
    pods = [
        p["metadata"]["name"] for p in served.get("pods", "-l", f"app.kubernetes.io/instance={NAME}")["items"]
    ]
    served.cluster.run("delete", "pod", *pods, "-n", NAMESPACE, "--wait=false")

    def remade() -> bool:
        if not served.cluster.exists("secret", AUTH_SECRET, "-n", NAMESPACE):
            return False
        return bool(served.get("secret", AUTH_SECRET)["metadata"]["uid"] != old_uid)

    wait_until(remade, 300, f"a new {AUTH_SECRET} made by the operator")
    wait_until(lambda: served.condition("Ready").get("status") == "True", 600, "Ready with the new keys")
    wait_until(lambda: kv_condition(served).get("reason") == "Verified", 120, "the KV path verified anew")
    assert engine_api_key(served) not in (old_key, "known")
    status, body = completion(served.router, PROMPTS[1], timeout=600)
    assert status == 200, body
    for role in ("prefill", "decode"):
        url = served.pod_url(served.engine_pod(role)) + "/v1/completions"
        body = {"model": "tiny-llama", "prompt": "k", "max_tokens": 1}
        refused, _ = post_json(url, body, timeout=60, headers={"Authorization": f"Bearer {old_key}"})
        assert refused == 401, role


def test_a_decode_that_cannot_load_kv_fails_kv_transfer_verified_until_it_can(served: Served) -> None:
    """The router's KV check, read by the operator's pod through a router policy closed to all but
    this machine: decode with 64-token KV blocks against prefill's 32 (it can load nothing prefill
    sends) turns KVTransferVerified to TransferFailed, the resource Degraded and not Ready; decode back
    as it was turns it Verified and Ready again. Each is a decode roll plus one canary and one read."""
    wait_until(lambda: kv_condition(served).get("reason") == "Verified", 120, "KVTransferVerified Verified")
    pairs = served.get("dllm", NAME)["status"]["kvTransfer"]["pairs"]
    assert [(p["prefill"], p["decode"], p["reason"]) for p in pairs] == [
        (served.engine_pod("prefill"), served.engine_pod("decode"), "Verified")
    ]
    decode_args = served.get("dllm", NAME)["spec"]["decode"]["extraArgs"]
    closed = {"routerAllowedFrom": [{"ipBlock": {"cidr": "10.250.0.1/32"}}]}

    def patch(spec: dict[str, Any]) -> None:
        served.cluster.run(
            "patch", "dllm", NAME, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": spec})
        )

    patch({"decode": {"extraArgs": [*decode_args, "--block-size", "64"]}, "security": closed})
    try:

        def failed() -> dict[str, Any] | None:
            # the roll done, the pair that is left checked, and the status saying so throughout
            said = {c["type"]: c for c in served.get("dllm", NAME).get("status", {}).get("conditions", [])}
            kv, ready, degraded = (said.get(t, {}) for t in ("KVTransferVerified", "Ready", "Degraded"))
            names = f"{served.engine_pod('prefill')} -> {served.engine_pod('decode')}: "
            pair = str(kv.get("message", "")).startswith(names)
            done = said.get("RolloutProgressing", {}).get("reason") == "Complete"
            judged = (ready.get("reason"), degraded.get("reason")) == ("TransferFailed", "TransferFailed")
            return said if kv.get("reason") == "TransferFailed" and pair and done and judged else None

        said = wait_until(
            failed, 900, "KVTransferVerified TransferFailed once the roll is done, Ready and Degraded too"
        )
        assert said["KVTransferVerified"]["status"] == "False", said
        assert (said["Ready"]["status"], said["Degraded"]["status"]) == ("False", "True"), said
    finally:
        patch({"decode": {"extraArgs": decode_args}, "security": {"routerAllowedFrom": None}})
    wait_until(
        lambda: kv_condition(served).get("reason") == "Verified", 600, "Verified after decode's return"
    )
    wait_until(lambda: served.condition("Ready").get("status") == "True", 600, "Ready again")


def test_a_decode_killed_mid_stream_gives_a_clean_error_then_degraded_then_ready(served: Served) -> None:
    # One decode pod to kill: an earlier test's rollout may still have its old pod draining (the stream
    # then went to it, and killing the new one cut nothing: a failed run).
    generation = served.get("dllm", NAME)["metadata"]["generation"]
    wait_until(
        lambda: rolled(served, generation), 600, "one pod per role, no rollout under way", interval=2.0
    )
    victim = served.engine_pod("decode")
    pid = engine_pid(served, victim)
    response, first = stream_frozen_mid_way(served, pid)
    os.kill(pid, signal.SIGKILL)  # as a crash would: no graceful delete, no drain
    assert first.startswith(b"data: ")
    rest = response.read().decode()
    response.close()
    # The stream ends with an error event in OpenAI's shape, not a hang and not a cut without a word.
    assert '"type":"stream_broken"' in rest.replace(" ", "") or '"error"' in rest, rest[-500:]

    def degraded_naming_decode() -> str | None:
        condition = served.condition("Degraded")
        message = str(condition.get("message", ""))
        return message if condition.get("status") == "True" and victim in message else None

    print(wait_until(degraded_naming_decode, 120, f"Degraded naming {victim}"))
    assert served.condition("Ready").get("status") == "False"
    wait_until(
        lambda: served.condition("Ready").get("status") == "True", 600, "Ready again after the restart"
    )
    wait_until(lambda: demo.answers(served.router + "/ready"), 60, "the router's /ready after the restart")
    # The restarted decode's first request is its slowest.
    status, body = completion(served.router, PROMPTS[0], timeout=600)
    assert status == 200, body


@pytest.mark.parametrize(
    ("fault", "prefill", "reasons"),
    [
        ("crashloop", {"extraArgs": ["--no-such-vllm-flag"]}, ("CrashLoopBackOff",)),
        # A registry on the node's own loopback that nothing serves: refused at once, no traffic leaves.
        ("nopull", {"image": "localhost:1/dllm/nothing:0"}, ("ErrImagePull", "ImagePullBackOff")),
    ],
)
def test_a_failing_engine_shows_as_degraded_naming_the_pod_and_reason(
    served: Served, fault: str, prefill: dict[str, Any], reasons: tuple[str, ...]
) -> None:
    name = f"broken-{fault}"
    wait_until(lambda: served.condition("Ready").get("status") == "True", 600, "the served sample Ready")
    served.cluster.apply(faulty_cr(name, **prefill))
    try:

        def degraded() -> str | None:
            cr = served.get("dllm", name)
            cond: dict[str, Any] = next(
                (c for c in cr.get("status", {}).get("conditions", []) if c["type"] == "Degraded"), {}
            )
            message = str(cond.get("message", ""))
            hit = cond.get("status") == "True" and f"{name}-prefill-0" in message
            return message if hit and any(r in message for r in reasons) else None

        message = wait_until(degraded, 300, f"{name}: Degraded naming {name}-prefill-0 and {reasons}")
        print(f"{fault}: {message}")
    finally:
        served.cluster.run("delete", "dllm", name, "-n", NAMESPACE, "--wait=true", "--timeout=120s")


def _fingerprint_pairs(router: str) -> dict[tuple[str, str], float]:
    """The router pod's prompts per (prefill, decode) KV fingerprint pair (absent metric: an error)."""
    text = metrics_text(router)
    counted = {
        (sample.labels["prefill_fingerprint"], sample.labels["decode_fingerprint"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "dllm_router_fingerprint_pairs"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted, f"no dllm_router_fingerprint_pairs_total in the router's /metrics:\n{text[:2000]}"
    return counted


def _assert_every_stream_answered(roll: RollOutcomes, logs: PodLogs, during: str) -> None:
    """No request without its whole answer (failed, cut or refused with a 503); else each one's id and
    what every engine said about it."""
    missed = roll.not_served()
    seen = logs.noteworthy(also=tuple(o.request_id for o in missed)) if missed else ""
    assert missed == [], (
        f"requests without their whole answer during {during}, of {len(roll.outcomes)}: "
        f"{missed}\nevery engine's whole log: {logs.directory}\n{seen}"
    )


def _roll_clients() -> int:
    """DLLM_ROLL_CLIENTS streams in flight side by side (four by default, as issue 34 asks)."""
    return int(os.environ.get("DLLM_ROLL_CLIENTS", "4"))


def test_a_compression_change_rolls_both_roles_in_pairs_with_no_request_refused_or_failed(
    served: Served, sample_logs: PodLogs
) -> None:
    """Compression none to fp8 changes the KV fingerprint: under four streaming clients (so pods are
    replaced with streams running in them), new prefill and decode pods come up beside the old pair
    (the sample's maxSurge 1), the router sends each stream through a pair of one fingerprint, and the
    old pods go, drained by their preStop, only once the new pair serves. No stream is refused (a 503
    counts as a failure), failed or cut; the router never paired two fingerprints; afterwards the
    answers go through fp8 pairs and decode's KV crosses the wire in fp8. Every engine instance's log
    is kept (the replaced pods' too), so a failure names what each engine said."""
    old = served.get("dllm", NAME)["status"]["decode"]["kvFingerprint"]
    before = _fingerprint_pairs(served.router_pod)
    patch = {"spec": {"kvTransfer": {"compression": "fp8"}}}
    roll = roll_under_load(served, patch, "fp8", _roll_clients(), stream=True)
    _assert_every_stream_answered(roll, sample_logs, "the compression roll")
    status = served.get("dllm", NAME)["status"]
    new = status["decode"]["kvFingerprint"]
    assert new != old, status
    assert status["prefill"]["kvFingerprint"] == new, status
    during = _fingerprint_pairs(served.router_pod)
    assert all(p == d for p, d in during), f"the router paired two fingerprints: {during}"
    assert set(during) >= {(old, old), (new, new)}, f"both versions served: {during} (before: {before})"
    decode = served.pod_url(served.engine_pod("decode"))
    moved_before = kv_moved.at(decode, served.router)
    status_code, body = completion(served.router, PROMPTS[0], timeout=300)
    assert status_code == 200, body
    after = _fingerprint_pairs(served.router_pod)
    assert after.get((new, new), 0) > during.get((new, new), 0), f"no answer through an fp8 pair: {after}"
    fp8 = kv_moved.at(decode, served.router) - moved_before
    # float32 KV as one byte per value, plus a scale per block: about a quarter on the wire.
    assert 0 < fp8.wire_bytes <= fp8.kv_bytes / 3, fp8
    print(
        f"\ncompression roll: {len(roll.outcomes)} streams, every one answered whole; pairs {after}; "
        f"connects retried for want of a route to the Service: {roll.unrouted}"
    )


def test_a_decode_only_change_rolls_decode_alone_with_no_request_refused_or_failed(
    served: Served, sample_logs: PodLogs
) -> None:
    """decode.maxNumSeqs keeps the KV fingerprint, so decode alone rolls: under four streaming clients
    its surge pod comes up beside the old one (the sample's maxSurge 1), pairs with the prefill pod
    that stays, and the old decode goes, drained by its preStop with streams in it. No stream is
    refused (a 503 counts as a failure), failed or cut; prefill is never replaced; every pairing the
    router made is of the one fingerprint; the decode pod left serves with the new limit."""
    status = served.get("dllm", NAME)["status"]
    fingerprint = status["decode"]["kvFingerprint"]
    pods = {
        role: served.get("pod", served.engine_pod(role))["metadata"]["uid"] for role in ("prefill", "decode")
    }
    before = _fingerprint_pairs(served.router_pod)
    limit = served.get("dllm", NAME)["spec"]["decode"]["maxNumSeqs"] - 2
    roll = roll_under_load(served, {"spec": {"decode": {"maxNumSeqs": limit}}}, "seqs", _roll_clients(), True)
    _assert_every_stream_answered(roll, sample_logs, "the decode roll")
    status = served.get("dllm", NAME)["status"]
    assert (status["prefill"]["kvFingerprint"], status["decode"]["kvFingerprint"]) == (fingerprint,) * 2
    assert served.get("pod", served.engine_pod("prefill"))["metadata"]["uid"] == pods["prefill"]
    decode = served.get("pod", served.engine_pod("decode"))
    assert decode["metadata"]["uid"] != pods["decode"]
    args = decode["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == str(limit), args
    during = _fingerprint_pairs(served.router_pod)
    assert set(during) == set(before) | {(fingerprint, fingerprint)}, during
    assert during[(fingerprint, fingerprint)] > before.get((fingerprint, fingerprint), 0), during
    print(
        f"\ndecode roll: {len(roll.outcomes)} streams, every one answered whole; "
        f"connects retried for want of a route to the Service: {roll.unrouted}"
    )


def test_scaling_decode_to_two_sends_requests_to_both(served: Served) -> None:
    served.cluster.run("scale", "-n", NAMESPACE, f"dllm/{NAME}", "--replicas", "2")
    wait_until(
        lambda: served.get("dllm", NAME)["status"]["decode"]["ready"] == "2/2", 600, "two ready decodes"
    )
    wait_until(lambda: served.condition("Ready").get("status") == "True", 120, "Ready with two decodes")
    urls = [served.pod_url(served.engine_pod("decode", i)) for i in range(2)]

    def users_served(url: str) -> float:
        """The pod's finished requests, less the router's KV check canaries it answered."""
        canaries = kv_moved.canary_totals(metrics_text(served.router), "decode", url.split("://", 1)[-1])
        return counter(metrics_text(url), "vllm:request_success") - canaries["requests"]

    before = [users_served(url) for url in urls]

    def both_served() -> bool:
        status, body = completion(served.router, PROMPTS[1], timeout=600)  # decode-1's first compile
        assert status == 200, body
        return all(users_served(u) > b for u, b in zip(urls, before, strict=True))

    wait_until(both_served, 300, "both decode pods to serve a request through the router", interval=0.0)
    assert kv_moved.at(urls[1], served.router).tokens > 0  # the new decode loaded users' KV too


def test_helm_test_passes_on_the_real_node(served: Served) -> None:
    result = served.cluster.helm(
        "test", demo.RELEASE, "-n", demo.SYSTEM_NAMESPACE, "--timeout=180s", check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Succeeded" in result.stdout
