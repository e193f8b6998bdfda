"""The reconcile loop: caches fed by watch events, a de-duplicating work queue, one reconcile per CR.

kopf delivers watch events (handlers.py) into `Store`; every event enqueues the owning CR; workers take
CR keys from the queue and run `reconcile`, which renders, plans (pure), writes only what the plan says,
and patches status only when it changed. A key enqueued while it is being reconciled runs once more
afterwards, never twice at once. Failures retry with exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dllm_operator import metrics, rollout
from dllm_operator.api import KIND, DisaggregatedLLM, SpecInvalid, parse
from dllm_operator.api.rollout import EngineRole
from dllm_operator.autoscale import act, exported
from dllm_operator.autoscale.applied import AppliedReplicas
from dllm_operator.autoscale.decide import Decision, Role
from dllm_operator.autoscale.poller import AutoscalePoller, Target
from dllm_operator.config import OperatorConfig
from dllm_operator.events import cr_event, now_iso
from dllm_operator.kube import ApiError, KubeClient
from dllm_operator.kv_poll import KVPoller, Page, RouterPod, router_pods
from dllm_operator.kv_transfer import KVCheckView, engine_pod_names
from dllm_operator.plan import MANAGED_KINDS, Key, key_of, only_replicas_changed, plan
from dllm_operator.redact import redact_values
from dllm_operator.render import auth, labels, render_all, with_hash
from dllm_operator.render.router import kv_check_args
from dllm_operator.secret_missing import pods_wait_on_secret
from dllm_operator.status import (
    Observed,
    compute_status,
    invalid_spec_status,
    missing_pods,
    pods_by_component,
    replica_failure,
    without_times,
    workloads_by_component,
)
from dllm_operator.store import CRKey, Store, version_number
from dllm_operator.work_queue import WorkQueue

log = logging.getLogger(__name__)
CREATE_FAILURE_RECHECK_S = 10.0


def _describe(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"


# The spec's version with active autoscaling's counts, the parsed spec, the CR as rendered (with those
# counts in it) and its children.
_Rendered = tuple[tuple[Any, ...], DisaggregatedLLM, DisaggregatedLLM, list[dict[str, Any]]]


@dataclass
class Controller:
    client: KubeClient
    config: OperatorConfig
    store: Store = field(default_factory=Store)
    queue: WorkQueue = field(default_factory=WorkQueue)
    is_leader: Callable[[], bool] = lambda: True
    _apply_errors: dict[CRKey, tuple[str, ...]] = field(default_factory=dict)
    _rendered: dict[CRKey, _Rendered] = field(default_factory=dict)
    _event_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _secrets_made: set[tuple[CRKey, str]] = field(default_factory=set)
    _rechecks: set[CRKey] = field(default_factory=set)  # keys with a FailedCreate recheck scheduled
    _kv_pages: dict[CRKey, dict[str, Page]] = field(default_factory=dict)  # router pods' KV check pages
    _autoscaling: dict[CRKey, dict[str, Any]] = field(default_factory=dict)  # status.autoscaling to write
    _applied: AppliedReplicas = field(default_factory=AppliedReplicas)  # active autoscaling's counts

    # ---- inputs ----

    def on_resource(self, body: dict[str, Any], deleted: bool) -> None:
        key = self.store.put_resource(body, deleted)
        metrics.MANAGED.set(len(self.store.resources))
        if not deleted:
            self.queue.add(key)
        else:
            self._forget(key)

    def on_child(self, obj: dict[str, Any], deleted: bool) -> None:
        key = self.store.put_child(obj, deleted)
        if key is not None and key in self.store.resources:
            self.queue.add(key)

    def requeue_all(self) -> None:
        for key in list(self.store.resources):
            self.queue.add(key)

    def on_elected(self) -> None:
        """A new term as leader: what an earlier term kept of active autoscaling may be stale (another
        leader may have stepped meanwhile), so it is read from the StatefulSets again."""
        self._applied.forget_all()
        self._rendered.clear()
        self.requeue_all()

    def _forget(self, key: CRKey) -> None:
        self.store.children.pop(key, None)
        self.store.pods.pop(key, None)
        self._apply_errors.pop(key, None)
        self._rendered.pop(key, None)
        self._kv_pages.pop(key, None)
        if self._autoscaling.pop(key, None) is not None:
            exported.forget(*key)
        self._applied.forget(key)

    async def seed(self, namespaces: tuple[str, ...]) -> None:
        """Fill the caches before the first reconcile, so a restart makes no needless writes."""
        listed, _ = await self._listing(namespaces)
        self.store = listed

    async def relist(self) -> None:
        """Merge a fresh listing into the caches, forget CRs that are gone, and reconcile the rest."""
        listed, listed_at = await self._listing(self.config.namespaces)
        for key in self.store.merge_listing(listed, listed_at):
            self._forget(key)
        metrics.MANAGED.set(len(self.store.resources))
        metrics.RESYNCS.inc()
        self.requeue_all()

    async def _listing(self, namespaces: tuple[str, ...]) -> tuple[Store, int]:
        """Every CR and child, and the oldest of the lists' resourceVersions (0 where one is no number:
        then nothing the listing lacks is taken as gone)."""
        store, versions = Store(), []
        selector = f"{labels.MANAGED_BY}={labels.MANAGER}"
        for namespace in namespaces or (None,):
            for kind in (*MANAGED_KINDS, "Pod"):
                objects, version = await self.client.list_at(kind, selector, namespace)
                versions.append(version)
                for obj in objects:
                    store.put_child(obj)
            bodies, version = await self.client.list_at(KIND, "", namespace)
            versions.append(version)
            for body in bodies:
                store.put_resource(body)
        oldest = min((version_number(v) for v in versions), default=0)
        return store, oldest

    # ---- workers ----

    async def run_workers(self, count: int = 4) -> None:
        background = [self._resync()]
        if self.config.kv_check_poll_seconds > 0:
            poller = KVPoller(self.config.kv_check_poll_seconds, self._kv_targets, self._on_kv_pages)
            background.append(poller.run())
        if self.config.autoscale_poll_seconds > 0:
            autoscaler = AutoscalePoller(
                self.config.autoscale_poll_seconds,
                self._autoscale_targets,
                self._on_autoscaled,
                acted=self._on_autoscale_decision,
            )
            background.append(autoscaler.run())
        await asyncio.gather(*(self._worker() for _ in range(count)), *background)

    # ---- the KV check (kv_poll.py reads the routers' pages; kv_transfer.py says what they mean) ----

    def _kv_checked(self, cr: DisaggregatedLLM) -> bool:
        return self.config.kv_check_poll_seconds > 0 and cr.spec.router.enabled and bool(kv_check_args(cr))

    def _kv_targets(self) -> dict[CRKey, list[RouterPod]]:
        """The ready router pods of each resource whose router runs the check (the leader's work)."""
        if not self.is_leader():
            return {}
        return {
            key: router_pods(pods_by_component(self.store.pods[key].values()).get("router", []))
            for key, (_, _, cr, _) in self._rendered.items()
            if key in self.store.resources and self._kv_checked(cr)
        }

    def _on_kv_pages(self, key: CRKey, pages: dict[str, Page]) -> None:
        self._kv_pages[key] = pages
        self.queue.add(key)

    # ---- autoscaling, advisory (autoscale/: the reads, the signals, the decision) ----

    def _autoscale_targets(self) -> dict[CRKey, Target]:
        """What each resource with spec.autoscaling on reads: its ready pods with an HTTP port, and the
        replicas its engine StatefulSets run (the leader's work)."""
        if not self.is_leader():
            return {}
        found: dict[CRKey, Target] = {}
        for key, (_, _, cr, _) in self._rendered.items():
            if key not in self.store.resources or cr.spec.autoscaling.mode == "off":
                continue
            pods = pods_by_component(self.store.pods[key].values())
            workloads = workloads_by_component(self.store.children[key].values())
            current: dict[Role, int] = {
                role: int(workloads.get(role, {}).get("spec", {}).get("replicas") or 0)
                for role in ("prefill", "decode")
            }
            current.update(self._applied.counts(key, cr, workloads))  # not a rollout's surge
            readable = {role: router_pods(pods.get(role, [])) for role in ("prefill", "decode", "router")}
            found[key] = Target(cr.spec.autoscaling, readable, current)
        for key in set(self._autoscaling) - set(found):  # deleted, or autoscaling turned off
            del self._autoscaling[key]
            exported.forget(*key)
        return found

    def _on_autoscaled(self, key: CRKey, status: dict[str, Any], changed: bool) -> None:
        self._autoscaling[key] = status
        exported.export(*key, status)
        self.queue.add(key)
        body = self.store.resources.get(key)
        if changed and body is not None:
            said = ", ".join(
                f"{role} {status[role]['replicas']}" for role in ("prefill", "decode") if role in status
            )
            self._event(body, "AutoscalingRecommendation", f"recommended replicas: {said}")

    def _on_autoscale_decision(self, key: CRKey, decision: Decision) -> None:
        """Active mode: a step of each role it scales (autoscale/act.py); a moved count is rendered by
        the reconcile this queues."""
        cached, body = self._rendered.get(key), self.store.resources.get(key)
        if cached is None or body is None or not cached[2].spec.autoscaling.active_roles():
            return
        if body["metadata"].get("deletionTimestamp") or not self.is_leader():
            return  # going, or no longer ours to scale
        said = self._applied.actions(key)
        moved = self._applied.step(
            key,
            cached[1],
            decision,
            pods_by_component(self.store.pods[key].values()),
            workloads_by_component(self.store.children[key].values()),
            time.time(),
            self.config.rollout_settle_seconds + self.config.autoscale_poll_seconds,
        )
        for scaled in moved:
            self._event(body, "AutoscalingScaled", f"{scaled.role}: {scaled.reason}")
        if moved or self._applied.actions(key) != said:
            self.queue.add(key)  # the step to render, or what status says of it

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            try:
                await self.relist()
            except Exception as error:  # noqa: BLE001 (the next resync tries again; watches go on)
                log.warning("resync listing failed: %s", error)
                self.requeue_all()

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            failed = False
            started = time.perf_counter()
            try:
                if self.is_leader():  # a follower drops the key; it re-queues everything when elected
                    metrics.RECONCILES.inc()
                    await self.reconcile(key)
                    metrics.DURATION.observe(time.perf_counter() - started)
            except Exception as error:  # noqa: BLE001 (any failure is retried with backoff, logged, counted)
                failed = True
                metrics.ERRORS.labels(type(error).__name__).inc()
                log.warning("reconcile %s/%s failed: %s", key[0], key[1], error)
            finally:
                delay = self.queue.done(key, failed)
                if delay is not None:
                    self.queue.add_after(key, delay)

    # ---- one reconcile ----

    async def reconcile(self, key: CRKey) -> None:
        body = self.store.resources.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # deleted or being deleted: the garbage collector removes the children
        try:
            cr, desired = self._desired(key, body)
        except SpecInvalid as invalid:
            await self._write_status(
                body,
                invalid_spec_status(
                    body["metadata"].get("generation", 0), str(invalid), body.get("status"), now_iso()
                ),
            )
            return
        await self._ensure_auth_secret(key, body, cr)
        actual = self.store.children[key]
        desired = self._at_rollout_step(key, cr, desired, actual)
        writes = plan(desired, actual, cr.metadata.uid)
        # Children are independent objects: apply them at once (a StatefulSet may precede its Service).
        created: list[str] = []
        results = await asyncio.gather(
            *(self._apply(body, obj, actual, created) for obj in writes.apply), return_exceptions=True
        )
        if created:  # one Event for the children a reconcile created, not one write per child
            self._event(body, "Created", "created " + ", ".join(sorted(created)))
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        errors = [r for r in results if isinstance(r, str)]
        for kind, name in writes.delete:
            await self.client.delete(kind, key[0], name, actual[(kind, name)]["metadata"].get("uid"))
            actual.pop((kind, name), None)
            self._event(body, "Deleted", f"{kind} {name} is no longer wanted by the spec")
        self._apply_errors[key] = tuple(errors)
        await self._update_status(key, body, cr)

    async def _ensure_auth_secret(self, key: CRKey, body: dict[str, Any], cr: DisaggregatedLLM) -> None:
        """Create the CR's auth Secret once (random values; never read back, never updated).

        Create-only RBAC: the operator can neither read nor change a Secret, so a user who wants new
        keys deletes the Secret (and restarts the pods); the operator creates a fresh one as soon as a
        pod reports it missing, which is when one is needed (running pods hold their keys). A resync
        does not try again: at 500 resources that was 500 refused creates every resync, while idle.
        """
        made = (key, cr.metadata.uid)
        if not cr.spec.security.authentication:
            return
        if made in self._secrets_made and pods_wait_on_secret(
            self.store.pods[key].values(), auth.secret_name(cr)
        ):
            self._secrets_made.discard(made)  # deleted (a rotation): made again now
        if made in self._secrets_made:
            return
        try:
            await self.client.create(auth.new_secret(cr))
            self._event(body, "Created", f"created Secret {auth.secret_name(cr)} (the data plane's keys)")
        except ApiError as error:
            # 409: it exists already, made by an earlier run: the chart's reserved-secrets policy lets
            # nobody else create one under the name (auth.py).
            if error.status != 409:
                raise
        self._secrets_made.add(made)

    def _at_rollout_step(
        self,
        key: CRKey,
        cr: DisaggregatedLLM,
        desired: list[dict[str, Any]],
        actual: dict[Key, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The engine StatefulSets at their surge rollout's step (rollout.py), their window of ordinals
        kept where it is with no rollout too; the rest as rendered."""
        pods = pods_by_component(self.store.pods[key].values())
        engines = {role: obj for obj in desired if (role := _engine_role(obj)) is not None}
        progress = {role: rollout.progress(obj, actual.get(key_of(obj))) for role, obj in engines.items()}
        stepped: list[dict[str, Any]] = []
        for obj in desired:
            role = _engine_role(obj)
            if role is None or engines.get(role) is not obj:
                stepped.append(obj)
                continue
            partner: EngineRole = "decode" if role == "prefill" else "prefill"
            at = rollout.step(
                obj,
                actual.get(key_of(obj)),
                pods.get(role, []),
                pods.get(partner, []),
                cr.spec.rollout,
                time.time(),
                partner_progress=progress.get(partner, 1.0),
                role=role,
                settle=self.config.rollout_settle_seconds,
            )
            stepped.append(obj if at is obj else with_hash(at))
        return stepped

    def _desired(self, key: CRKey, body: dict[str, Any]) -> tuple[DisaggregatedLLM, list[dict[str, Any]]]:
        """The parsed CR and its rendered children, reused while the spec's generation stays the same.

        Most reconciles come from pod and status events, which leave the spec alone; parsing and
        rendering again for each would cost more than the rest of the reconcile.
        """
        meta = body["metadata"]
        generation = (meta.get("uid", ""), int(meta.get("generation") or 0))
        cached = self._rendered.get(key)
        same_spec = cached is not None and cached[0][:2] == generation and generation[1] > 0
        parsed = cached[1] if cached is not None and same_spec else parse(body)
        workloads = workloads_by_component(self.store.children[key].values())
        applied = self._applied.counts(key, parsed, workloads)  # active autoscaling's, else none
        version = (*generation, tuple(sorted(applied.items())))
        if cached is not None and cached[0] == version and version[1] > 0:
            return cached[2], cached[3]
        cr = act.with_applied(parsed, applied) if applied else parsed
        desired = render_all(cr, self.config)
        self._rendered[key] = (version, parsed, cr, desired)
        return cr, desired

    async def _apply(
        self, body: dict[str, Any], obj: dict[str, Any], actual: dict[Key, dict[str, Any]], created: list[str]
    ) -> str | None:
        """Apply one child (a new one is added to `created`); returns an error message for status, or None."""
        key = key_of(obj)
        before = actual.get(key)
        try:
            result = await self._apply_or_replace(body, obj, before)
        except ApiError as error:
            if error.status >= 500 or error.status in (401, 403, 409, 429):
                raise  # transient or permission: retry with backoff
            message = f"{_describe(obj)}: {redact_values(error.message)}"
            self._event(body, "FailedApply", message, warning=True)
            return message
        if result is None:
            actual.pop(key, None)
            return None
        result.setdefault("kind", obj["kind"])
        actual[key] = result
        if before is None:
            created.append(_describe(obj))
        elif only_replicas_changed(obj, before):
            self._event(
                body,
                "Scaled",
                f"scaled {_describe(obj)} from {before['spec'].get('replicas')} to {obj['spec']['replicas']}",
            )
        return None

    async def _apply_or_replace(
        self, body: dict[str, Any], obj: dict[str, Any], before: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The applied object, or None when an immutable field forced a delete: the object is then
        created again by the reconcile that its deletion event brings."""
        try:
            return await self.client.apply(obj)
        except ApiError as error:
            if not error.immutable_field or before is None:
                raise
        # Orphan, not Background: the pods keep serving, and the StatefulSet created next adopts them
        # by its (unchanged) selector and rolls them under its update strategy; a Background delete
        # would take the whole role down at once (after an operator upgrade, every CR's at once).
        meta = obj["metadata"]
        await self.client.delete(
            obj["kind"], meta["namespace"], meta["name"], before["metadata"].get("uid"), propagation="Orphan"
        )
        self._event(body, "Replaced", f"replacing {_describe(obj)}: an immutable field changed; pods kept")
        return None

    async def _update_status(self, key: CRKey, body: dict[str, Any], cr: DisaggregatedLLM) -> None:
        workloads = workloads_by_component(self.store.children[key].values())
        pods = pods_by_component(self.store.pods[key].values())
        observed = Observed(
            workloads=workloads,
            pods=pods,
            apply_errors=self._apply_errors.get(key, ()),
            create_failures=await self._create_failures(key, workloads, pods),
            kv_check=KVCheckView(self._kv_checked(cr), self._kv_pages.get(key, {}), engine_pod_names(pods)),
            rollouts_overdue=tuple(
                name
                for role in ("prefill", "decode")
                if (workload := workloads.get(role)) is not None
                and cr.spec.rollout.coordinated
                and rollout.overdue(workload, cr.spec.rollout, time.time())
                and (name := workload["metadata"]["name"])
            ),
            autoscaling=self._autoscaling_status(key, cr),
        )
        status = compute_status(cr, observed, body.get("status"), now_iso())
        wanted = {"prefill": cr.spec.prefill.replicas, "decode": cr.spec.decode.replicas}
        if cr.spec.rollout.coordinated and any(
            rollout.under_way(w, wanted[role]) for role, w in workloads.items() if role in wanted
        ):
            self._recheck_later(key)  # a deadline, or a new pod's settling, passes with no event to say so
        await self._write_status(body, status)

    def _autoscaling_status(self, key: CRKey, cr: DisaggregatedLLM) -> dict[str, Any] | None:
        """status.autoscaling: the latest decision, with what active mode did about it per role."""
        found = self._autoscaling.get(key)
        if cr.spec.autoscaling.mode == "off" or found is None:
            return None
        out = dict(found)
        for role, action in self._applied.actions(key).items():
            if isinstance(out.get(role), dict):
                out[role] = {**out[role], "action": action}
        return out

    async def _create_failures(
        self, key: CRKey, workloads: dict[str, dict[str, Any]], pods: dict[str, list[dict[str, Any]]]
    ) -> tuple[str, ...]:
        """Why pods that should exist do not: a StatefulSet says so only in a FailedCreate Event (no
        status condition), a Deployment in its ReplicaFailure condition. Looked up only while pods are
        missing, and looked at again shortly, since no watched object changes when creation fails."""
        failures: list[str] = []
        for component, workload in workloads.items():
            if not missing_pods(workload, pods.get(component, [])):
                continue
            self._recheck_later(key)
            if workload.get("kind") == "Deployment":
                failure = replica_failure(workload)
            else:
                name = workload["metadata"]["name"]
                event = await self.client.latest_event(key[0], "StatefulSet", name, "FailedCreate")
                failure = f"StatefulSet {name}: {event.get('message', '')}" if event else None
            if failure:
                failures.append(redact_values(failure)[:1000])
        return tuple(failures)

    def _recheck_later(self, key: CRKey) -> None:
        """One pending recheck per CR, however many reconciles ran meanwhile (no timer chains): while
        pods are missing, and while a surge rollout runs."""
        if key in self._rechecks:
            return
        self._rechecks.add(key)

        def recheck() -> None:
            self._rechecks.discard(key)
            self.queue.add(key)

        asyncio.get_running_loop().call_later(CREATE_FAILURE_RECHECK_S, recheck)

    async def _write_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        if without_times(status) == without_times(body.get("status")):
            return
        meta = body["metadata"]
        try:
            await self.client.patch_status(meta["namespace"], meta["name"], status)
        except ApiError as error:
            if error.status != 404:
                raise
            key = (meta["namespace"], meta["name"])  # deleted while the watch was away
            self.store.resources.pop(key, None)
            self._forget(key)
            return
        body["status"] = status  # until the watch brings the new version

    def _event(self, body: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
        """Post an Event in the background: best effort, and never on the reconcile's critical path."""
        task = asyncio.get_running_loop().create_task(
            self._post_event(cr_event(body, reason, message, warning))
        )
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    async def _post_event(self, event: dict[str, Any]) -> None:
        try:
            await self.client.create_event(event)
        except (TimeoutError, ApiError, OSError) as error:
            log.info("could not post event %s: %s", event["reason"], error)


def _engine_role(obj: dict[str, Any]) -> EngineRole | None:
    """The engine role whose StatefulSet `obj` is, or None for any other child."""
    component = obj["metadata"].get("labels", {}).get(labels.COMPONENT)
    if obj["kind"] != "StatefulSet":
        return None
    return "prefill" if component == "prefill" else "decode" if component == "decode" else None
