"""The local stack's container runtime: runs opted-in pods' commands as local processes.

kwok plays every node's kubelet (it moves bound pods to Running and keeps nodes Ready) but runs
nothing.  For the pods that must do real work on the local stack -- the demo's ranks, stop-time
diagnostics, a standby's self-check -- this runner does what a kubelet's container runtime would,
for pods labelled ``trainguard.io/local-run: "true"`` on the stack's nodes:

* a pod kwok reports Running gets its first container's ``command`` + ``args`` started as a local
  process (its own session), with the container's ``env`` (plain values, ``fieldRef``
  ``spec.nodeName`` / ``metadata.name`` / ``metadata.namespace``, and ``configMapKeyRef`` read
  when the process starts), ``workingDir``, and output in ``<dir>/<namespace>_<pod>.log``;
* a process that exits ends its pod: phase ``Succeeded`` (exit 0) or ``Failed``, with the
  container's terminated state and exit code, as a kubelet reports it (``restartPolicy: Never``;
  the runner restarts nothing);
* a container's ``readinessProbe.exec`` (a standby's self-check) runs as a local process every
  ``periodSeconds`` with the container's environment, after ``initialDelaySeconds``, killed after
  ``timeoutSeconds``; the pod's Ready condition follows it with ``successThreshold`` /
  ``failureThreshold``, as a kubelet's prober sets it (kwok's pod-ready stage leaves such pods not
  Ready);
* a pod being deleted gets SIGTERM (its process group), SIGKILL after the pod's grace period,
  and is removed from the API only once its process is gone (kwok's pod-delete stage skips
  these pods: ``infra/k8s/kwok-stages.yaml``), so "the pod is gone" means "the process is gone".

It polls the API (``--interval``, 0.25 s): a few hundred pods at most on the local stack.
``python -m trainguard.infra.stack.podrunner --kubeconfig KC --dir D``
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("trainguard.podrunner")

LOCAL_RUN_LABEL = "trainguard.io/local-run"


@dataclass
class Probe:
    """A container's exec readiness probe, with the kubelet's defaults."""

    argv: list[str]
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, container: Any) -> Probe | None:
        rp = container.readiness_probe
        action = getattr(rp, "_exec", None) if rp is not None else None
        if action is None or not action.command:
            return None
        return cls(
            argv=list(action.command),
            initial_delay_s=float(rp.initial_delay_seconds or 0),
            period_s=float(rp.period_seconds or 10),
            timeout_s=float(rp.timeout_seconds or 1),
            success_threshold=int(rp.success_threshold or 1),
            failure_threshold=int(rp.failure_threshold or 3),
        )


@dataclass
class Prober:
    """One pod's readiness: the probe, the run in flight, and the streaks the thresholds count."""

    probe: Probe
    env: dict[str, str]
    cwd: str | None
    due: float
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    successes: int = 0
    failures: int = 0
    #: the Ready condition last reported (False: kwok's pod-ready stage starts such pods not Ready).
    ready: bool = False


@dataclass
class Running:
    """One pod's process."""

    uid: str
    namespace: str
    name: str
    proc: subprocess.Popen[bytes]
    started: str
    #: monotonic time SIGTERM was sent (0: not yet), and when SIGKILL is due.
    term_at: float = 0.0
    kill_at: float = 0.0
    reported: bool = False
    log_file: Path = field(default_factory=Path)
    prober: Prober | None = None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodRunner:
    def __init__(self, api_client: Any, dir: Path) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.dir = dir
        self.running: dict[str, Running] = {}

    # -- one pass ---------------------------------------------------------------------------
    def tick(self) -> None:
        pods = self.core.list_pod_for_all_namespaces(label_selector=f"{LOCAL_RUN_LABEL}=true").items
        seen = set()
        for pod in pods:
            uid = pod.metadata.uid
            seen.add(uid)
            run = self.running.get(uid)
            if pod.metadata.deletion_timestamp is not None:
                self._terminate(pod, run)
            elif run is None and pod.status.phase == "Running" and pod.spec.node_name:
                self._start(pod)
            elif run is not None and not run.reported and run.proc.poll() is not None:
                self._stop_probe(run)
                self._report_exit(run)
            elif run is not None and not run.reported and run.prober is not None:
                self._probe(run, pod)
        # Pods force-deleted by someone else: their processes go too.
        for uid in list(self.running):
            if uid not in seen:
                run = self.running[uid]
                self._stop_probe(run)
                if run.proc.poll() is None:
                    self._signal(run, signal.SIGKILL)
                    run.proc.wait(10)
                del self.running[uid]

    def _env(self, pod: Any, container: Any) -> dict[str, str]:
        env = dict(os.environ)
        for var in container.env or []:
            if var.value is not None:
                env[var.name] = var.value
            elif var.value_from is not None:
                value = self._env_from(pod, var.value_from)
                if value is not None:
                    env[var.name] = value
        # $(VAR) references in args, as the kubelet expands them.
        return env

    def _env_from(self, pod: Any, src: Any) -> str | None:
        if src.field_ref is not None:
            path = src.field_ref.field_path
            return {
                "spec.nodeName": pod.spec.node_name,
                "metadata.name": pod.metadata.name,
                "metadata.namespace": pod.metadata.namespace,
                "metadata.uid": pod.metadata.uid,
            }.get(path)
        if src.config_map_key_ref is not None:
            ref = src.config_map_key_ref
            try:
                cm = self.core.read_namespaced_config_map(ref.name, pod.metadata.namespace)
            except Exception:
                return None
            return (cm.data or {}).get(ref.key)
        return None

    def _start(self, pod: Any) -> None:
        c = pod.spec.containers[0]
        argv = [*(c.command or []), *(c.args or [])]
        ns, name = pod.metadata.namespace, pod.metadata.name
        if not argv:
            self._finish(pod.metadata.uid, ns, name, 127, "no command in the pod's first container", _now())
            return
        env = self._env(pod, c)
        argv = [_expand(a, env) for a in argv]
        log_file = self.dir / f"{ns}_{name}.log"
        self.dir.mkdir(parents=True, exist_ok=True)
        started = _now()
        try:
            with open(log_file, "ab") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=c.working_dir or None,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except OSError as exc:
            log.warning("pod %s/%s: cannot start %s: %s", ns, name, argv[0], exc)
            self._finish(pod.metadata.uid, ns, name, 127, f"cannot start: {exc}", started)
            return
        run = Running(pod.metadata.uid, ns, name, proc, started, log_file=log_file)
        probe = Probe.of(c)
        if probe is not None:
            run.prober = Prober(probe, env, c.working_dir or None, time.monotonic() + probe.initial_delay_s)
        self.running[pod.metadata.uid] = run
        log.info(
            "pod %s/%s on %s: started pid %d: %s", ns, name, pod.spec.node_name, proc.pid, " ".join(argv)
        )

    # -- readiness --------------------------------------------------------------------------
    def _probe(self, run: Running, pod: Any) -> None:
        """Advance the pod's readiness probe by one tick: start it when due, judge it when done."""
        pr = run.prober
        assert pr is not None
        now = time.monotonic()
        if pr.proc is None:
            if now < pr.due:
                return
            try:
                pr.proc = subprocess.Popen(
                    pr.probe.argv,
                    env=pr.env,
                    cwd=pr.cwd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                self._judge(run, pod, False, f"cannot run the probe: {exc}")
                pr.due = now + pr.probe.period_s
                return
            pr.started = now
            return
        rc = pr.proc.poll()
        if rc is None and now - pr.started < pr.probe.timeout_s:
            return
        if rc is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pr.proc.pid, signal.SIGKILL)
            pr.proc.wait(5)
            out = f"timed out after {pr.probe.timeout_s:g}s"
        else:
            out = (pr.proc.stdout.read() if pr.proc.stdout else b"").decode(errors="replace").strip()
        if pr.proc.stdout:
            pr.proc.stdout.close()
        pr.proc = None
        # The kubelet counts the period from the probe's start.
        pr.due = pr.started + pr.probe.period_s
        self._judge(run, pod, rc == 0, out[-300:] or f"exit {rc}")

    def _judge(self, run: Running, pod: Any, ok: bool, out: str) -> None:
        pr = run.prober
        assert pr is not None
        pr.successes, pr.failures = (pr.successes + 1, 0) if ok else (0, pr.failures + 1)
        if not pr.ready and pr.successes >= pr.probe.success_threshold:
            self._set_ready(run, pod, True, "")
        elif pr.ready and pr.failures >= pr.probe.failure_threshold:
            self._set_ready(run, pod, False, out)
        elif not ok and pr.failures == 1:
            log.info("pod %s/%s: readiness probe failed: %s", run.namespace, run.name, out)

    def _set_ready(self, run: Running, pod: Any, ready: bool, why: str) -> None:
        status = "True" if ready else "False"
        now = _now()
        body = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": status, "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": status, "lastTransitionTime": now},
                ],
                "containerStatuses": [{"name": pod.spec.containers[0].name, "ready": ready}],
            }
        }
        try:
            self.core.patch_namespaced_pod_status(run.name, run.namespace, body)
        except Exception as exc:
            # Not recorded as reported: the next probe result tries again.
            log.info("pod %s/%s: readiness not reported: %s", run.namespace, run.name, exc)
            return
        assert run.prober is not None
        run.prober.ready = ready
        state = "Ready" if ready else f"not Ready ({why})"
        log.info("pod %s/%s: %s", run.namespace, run.name, state)

    @staticmethod
    def _stop_probe(run: Running) -> None:
        pr = run.prober
        if pr is not None and pr.proc is not None:
            if pr.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pr.proc.pid, signal.SIGKILL)
                pr.proc.wait(5)
            if pr.proc.stdout:
                pr.proc.stdout.close()
            pr.proc = None

    def _report_exit(self, run: Running) -> None:
        rc = run.proc.returncode
        self._finish(run.uid, run.namespace, run.name, rc if rc >= 0 else 128 - rc, "", run.started)
        run.reported = True

    def _finish(self, uid: str, ns: str, name: str, code: int, message: str, started: str) -> None:
        """Report the container's end as the kubelet would (phase, terminated state)."""
        phase = "Succeeded" if code == 0 else "Failed"
        state: dict[str, Any] = {
            "name": "main",
            "image": "local",
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "state": {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "message": message,
                    "startedAt": started,
                    "finishedAt": _now(),
                }
            },
        }
        body = {
            "status": {
                "phase": phase,
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
                "containerStatuses": [state],
            }
        }
        try:
            pod = self.core.read_namespaced_pod(name, ns)
            if pod.metadata.uid != uid:
                return
            state["name"] = pod.spec.containers[0].name
            state["image"] = pod.spec.containers[0].image or "local"
            self.core.patch_namespaced_pod_status(name, ns, body)
            log.info("pod %s/%s: exited %d -> %s", ns, name, code, phase)
        except Exception as exc:
            log.info("pod %s/%s: exit %d not reported: %s", ns, name, code, exc)

    def _terminate(self, pod: Any, run: Running | None) -> None:
        ns, name = pod.metadata.namespace, pod.metadata.name
        if run is not None:
            self._stop_probe(run)
        if run is not None and run.proc.poll() is None:
            now = time.monotonic()
            if not run.term_at:
                grace = pod.metadata.deletion_grace_period_seconds
                grace = 30 if grace is None else grace
                run.term_at, run.kill_at = now, now + grace
                self._signal(run, signal.SIGTERM if grace > 0 else signal.SIGKILL)
                log.info("pod %s/%s: deleted, SIGTERM to pid %d (grace %ss)", ns, name, run.proc.pid, grace)
                return
            if now >= run.kill_at:
                self._signal(run, signal.SIGKILL)
            return
        # The process is gone (or never ran): the pod may go, as a kubelet lets it.
        with contextlib.suppress(Exception):
            self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        if run is not None:
            self.running.pop(run.uid, None)
            log.info("pod %s/%s: process gone, pod removed", ns, name)

    @staticmethod
    def _signal(run: Running, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.proc.pid, sig)

    def stop_all(self) -> None:
        for run in self.running.values():
            self._stop_probe(run)
            if run.proc.poll() is None:
                self._signal(run, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for run in self.running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.proc.wait(max(0.1, deadline - time.monotonic()))
            if run.proc.poll() is None:
                self._signal(run, signal.SIGKILL)


def _expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` as the kubelet expands it in command and args (unknown ones stay as written)."""
    out, i = [], 0
    while i < len(arg):
        if arg.startswith("$(", i):
            end = arg.find(")", i)
            if end > 0 and arg[i + 2 : end] in env:
                out.append(env[arg[i + 2 : end]])
                i = end + 1
                continue
        out.append(arg[i])
        i += 1
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.infra.stack.podrunner", description=__doc__)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--dir", required=True, help="pods' output files")
    p.add_argument("--interval", type=float, default=0.25)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from kubernetes import config

    runner = PodRunner(config.new_client_from_config(config_file=a.kubeconfig), Path(a.dir))
    stopping = False

    def _stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stopping:
        try:
            runner.tick()
        except Exception as exc:
            log.warning("pod runner: %s: %s", type(exc).__name__, exc)
            time.sleep(1)
        time.sleep(a.interval)
    runner.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
