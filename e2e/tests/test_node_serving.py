"""The product on the real node, as users run it: `make demo` (python -m e2e.demo up, then down)
deploys the CPU sample once for the whole module; the chart's operator pod, the engines and router in
pods from the images built here, requests through the router's Service (a ClusterIP through kube-proxy,
engines found through the headless Services' DNS), the operator's NetworkPolicies against a pod of
another namespace, and the faults users meet, which run last (they kill, roll and scale the sample)."""

from __future__ import annotations

import collections
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e import demo
from e2e.dataplane.pipeline import counter, metrics_text, post_json, start_single_engine, wait_healthy
from e2e.fixtures import BLOCKED, Cluster, probe_dial, start_probe_servers, wait_until
from e2e.pod_logs import kept_logs
from e2e.rolling import roll_under_load
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
    stream_first_event,
    tokens,
)

from dllm_contract.router_defaults import MOONCAKE_BOOTSTRAP_PORT
from dllm_operator.api import parse
from dllm_operator.config import OperatorConfig
from dllm_operator.render.router import router_args

pytestmark = [pytest.mark.k8s, pytest.mark.node, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def served(cluster: Cluster) -> Iterator[Served]:
    """The sample deployed once for the whole module: every test here shares it."""
    yield from deployed(cluster)


def test_make_demo_answers_through_the_router_service(served: Served) -> None:
    """What `make demo` shows: the sample Ready through real probes, the operator a pod on the real
    node from the image built here, and one chat completion with decode's KV loaded over the wire."""
    out = served.demo_output
    assert "Ready=True" in out
    assert re.search(r"dllm-dllm-operator-\S+\s+1/1\s+Running\s+\d+.*dllm-real-0", out), out
    assert re.search(r"answer:\s+'.+'", out), out
    loaded = re.search(
        r"decode loaded (\d+) prompt tokens of KV from prefill over Mooncake \((\d+) bytes\)", out
    )
    assert loaded is not None, out
    assert int(loaded.group(1)) >= 32  # at least one full block came over the wire
    assert int(loaded.group(2)) == int(loaded.group(1)) * 1024  # 2 layers x 2 KV heads x 64 x K,V x bf16
    assert re.search(r"curl -s http://10\.96\.\d+\.\d+:8000/v1/chat/completions", out), out


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
    for pod_name in (f"{NAME}-prefill-0", f"{NAME}-decode-0"):
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
    decode = served.pod_url(f"{NAME}-decode-0")
    before = counter(metrics_text(decode), "vllm:external_prefix_cache_hits")
    through_service = {}
    for prompt in PROMPTS:
        status, body = completion(served.router, prompt)
        assert status == 200, body
        through_service[prompt] = tokens(body)
    loaded = counter(metrics_text(decode), "vllm:external_prefix_cache_hits") - before
    # Decode's own counter: the prompts' full blocks came from prefill, none were recomputed there.
    assert loaded >= 32 * len(PROMPTS)
    assert counter(metrics_text(decode), "vllm:prefix_cache_hits") == 0
    reference = wait_healthy(start_single_engine(served.model, tmp_path))
    try:
        for prompt in PROMPTS:
            status, body = completion(reference.url, prompt)
            assert status == 200, body
            assert through_service[prompt] == tokens(body), prompt[:30]
    finally:
        reference.stop()


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
        pod = served.get("pod", f"{NAME}-{role}-0")
        declared, transfer = engine_ports(pod)
        listening = listening_ports(cluster, pod["metadata"]["name"], ns)
        assert declared[0] == 8000, (role, declared)
        assert 8000 in listening, (role, sorted(listening))
        kv_ports = set(declared[1:]) | set(transfer) | {MOONCAKE_BOOTSTRAP_PORT}
        kv_listening[role] = sorted(listening & kv_ports)
        ip = pod["status"]["podIP"]
        # The other engine of this CR reaches every port that listens: they are reachable at all.
        peer_pod = f"{NAME}-{peer}-0"
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


def test_a_decode_killed_mid_stream_gives_a_clean_error_then_degraded_then_ready(served: Served) -> None:
    pid = engine_pid(served, f"{NAME}-decode-0")
    response, first = stream_first_event(served.router)
    os.kill(pid, signal.SIGKILL)  # as a crash would: no graceful delete, no drain
    assert first.startswith(b"data: ")
    rest = response.read().decode()
    response.close()
    # The stream ends with an error event in OpenAI's shape, not a hang and not a cut without a word.
    assert '"type":"stream_broken"' in rest.replace(" ", "") or '"error"' in rest, rest[-500:]

    def degraded_naming_decode() -> str | None:
        condition = served.condition("Degraded")
        message = str(condition.get("message", ""))
        return message if condition.get("status") == "True" and f"{NAME}-decode-0" in message else None

    print(wait_until(degraded_naming_decode, 120, f"Degraded naming {NAME}-decode-0"))
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


def test_a_rolling_spec_change_fails_no_accepted_request(served: Served, tmp_path: Path) -> None:
    """maxNumSeqs changes on both roles: each StatefulSet replaces its pod while requests keep coming.
    A request may be refused up front (503 naming the role with no ready pod: not accepted); one that
    an engine accepted is drained by its preStop hook, never cut. Every engine instance's log is kept
    (the replaced pods' too), so a failure names what each engine said about the failed request.
    DLLM_ROLL_ROUNDS=N rolls N times in a row (each to a value the previous did not have), and
    DLLM_ROLL_CLIENTS=N sends from N clients side by side (one by default: see docs/development.md)."""
    rounds = int(os.environ.get("DLLM_ROLL_ROUNDS", "1"))
    clients = int(os.environ.get("DLLM_ROLL_CLIENTS", "1"))
    served_count, outcomes = 0, 0
    with kept_logs(served.cluster, NAMESPACE, SAMPLE_PODS, tmp_path / "logs") as logs:
        for round_ in range(rounds):
            seqs = 6 - round_ % 2
            patch = {"spec": {"prefill": {"maxNumSeqs": seqs}, "decode": {"maxNumSeqs": seqs}}}
            rolled = roll_under_load(served, patch, f"roll{round_}", clients)
            failed = rolled.failed()
            seen = logs.noteworthy(also=tuple(o.request_id for o in failed)) if failed else ""
            assert failed == [], (
                f"round {round_ + 1} of {rounds}: accepted requests failed during the roll, of "
                f"{len(rolled.outcomes)}: {failed}\nevery engine's whole log: {logs.directory}\n{seen}"
            )
            served_count += rolled.served_count()
            outcomes += len(rolled.outcomes)
            print(f"\nround {round_ + 1}/{rounds}: {len(rolled.outcomes)} requests, "
                  f"{rolled.served_count()} served, the rest refused up front (503)")  # fmt: skip
    assert served_count >= 2 * clients * rounds, (served_count, outcomes)


def test_scaling_decode_to_two_sends_requests_to_both(served: Served) -> None:
    served.cluster.run("scale", "-n", NAMESPACE, f"dllm/{NAME}", "--replicas", "2")
    wait_until(
        lambda: served.get("dllm", NAME)["status"]["decode"]["ready"] == "2/2", 600, "two ready decodes"
    )
    wait_until(lambda: served.condition("Ready").get("status") == "True", 120, "Ready with two decodes")
    urls = [served.pod_url(f"{NAME}-decode-{i}") for i in range(2)]
    before = [counter(metrics_text(url), "vllm:request_success") for url in urls]

    def both_served() -> bool:
        status, body = completion(served.router, PROMPTS[1], timeout=600)  # decode-1's first compile
        assert status == 200, body
        return all(
            counter(metrics_text(u), "vllm:request_success") > b for u, b in zip(urls, before, strict=True)
        )

    wait_until(both_served, 300, "both decode pods to serve a request through the router", interval=0.0)


def test_helm_test_passes_on_the_real_node(served: Served) -> None:
    result = served.cluster.helm(
        "test", demo.RELEASE, "-n", demo.SYSTEM_NAMESPACE, "--timeout=180s", check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Succeeded" in result.stdout
