"""`python -m dllm_operator run`: kopf's watches, the reconcile workers, the leader Lease and the
health/metrics server, in one event loop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from functools import partial
from typing import Any, cast

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dllm_contract.logs import configure_logging
from dllm_operator import metrics
from dllm_operator.config import ConfigInvalid, OperatorConfig
from dllm_operator.controller import Controller
from dllm_operator.handlers import build_registry
from dllm_operator.kube import KubeClient, load_credentials
from dllm_operator.leader import LeaderElector

log = logging.getLogger(__name__)
LEASE_CALL_TIMEOUT_S = 5.0


class BackgroundTaskEnded(RuntimeError):
    """The leader loop or the workers stopped: the process exits so that its pod restarts."""


def _stop_when_done(stop: asyncio.Event, ended: list[str], task: asyncio.Task[Any]) -> None:
    """Never keep running with a dead leader loop or dead workers (a stale leader, or no reconciles)."""
    if task.cancelled() or stop.is_set():
        return
    ended.append(f"{task.get_name()} stopped: {task.exception()!r}")
    log.critical("%s; exiting", ended[-1])
    stop.set()


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """The environment's settings, the command line's winning; ConfigInvalid naming a bad one."""
    given: dict[str, Any] = {}
    if args.all_namespaces or args.namespace:
        given["namespaces"] = () if args.all_namespaces else tuple(args.namespace)
    if args.log_level:
        given["log_level"] = args.log_level
    return OperatorConfig.from_env(os.environ, **given)


def health_app(controller: Controller, ready: asyncio.Event) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text="ok") if ready.is_set() else web.Response(status=503, text="starting")

    async def metrics_page(_: web.Request) -> web.Response:
        body = generate_latest(metrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes(
        [web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", metrics_page)]
    )
    return app


async def seed_until_reachable(controller: Controller, namespaces: tuple[str, ...]) -> None:
    delay = 0.5
    while True:
        try:
            await controller.seed(namespaces)
            return
        except Exception as error:  # noqa: BLE001 (the API server may not be up yet: retry)
            log.warning("initial listing failed (%s); retrying in %.1fs", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10)


async def operate(args: argparse.Namespace) -> None:
    config = operator_config(args)
    credentials = load_credentials(args.kubeconfig)
    client = KubeClient(credentials)
    clients = [client]
    controller = Controller(client=client, config=config)
    ready = asyncio.Event()
    runner = web.AppRunner(health_app(controller, ready), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.health_host, args.health_port).start()
    tasks: list[asyncio.Task[Any]] = []
    elector: LeaderElector | None = None
    identity = f"{config.pod_name or socket.gethostname()}-{os.getpid()}"
    if args.leader_elect:
        namespace = (
            args.lease_namespace
            or config.pod_namespace
            or (config.namespaces[0] if config.namespaces else "default")
        )
        # Its own connection pool and a timeout shorter than the renew deadline: a renewal never
        # queues behind reconcile writes, and a hung call cannot outlive the leadership it renews.
        lease_client = KubeClient(credentials, timeout=LEASE_CALL_TIMEOUT_S)
        clients.append(lease_client)
        elector = LeaderElector(
            lease_client, namespace, args.lease_name, identity, on_elected=controller.on_elected
        )
        controller.is_leader = elector.is_leader
        tasks.append(asyncio.create_task(elector.run(), name="leader"))
    await seed_until_reachable(controller, config.namespaces)
    ready.set()
    log.info("watching %s", ", ".join(config.namespaces) or "all namespaces")
    tasks.append(asyncio.create_task(controller.run_workers(), name="workers"))
    stop, ended = asyncio.Event(), list[str]()
    for task in tasks:
        task.add_done_callback(partial(_stop_when_done, stop, ended))
    try:
        await kopf.operator(
            registry=build_registry(controller, credentials),
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            standalone=True,
            # kopf would otherwise name itself after the user's passwd entry, which a numeric
            # non-root user in a container does not have (getpwuid fails and the operator exits).
            identity=cast(Any, identity),  # kopf types it as a NewType it does not export
            stop_flag=stop,
        )
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if elector is not None:
            with contextlib.suppress(Exception):
                await elector.release()
        for each in clients:
            await each.close()
        await runner.cleanup()
    if ended:
        raise BackgroundTaskEnded("; ".join(ended))


def run_operator(args: argparse.Namespace) -> int:
    try:
        config = operator_config(args)
    except ConfigInvalid as invalid:
        print(f"dllm-operator: {invalid}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(operate(args))
    return 0
