"""Slurm side of a node's way back: validate a drained node, then resume it or keep it drained.

A drained node takes no job, not even a test; resuming it first would let any queued job land on
it before it passed.  So validation holds the node in a reservation of its own first
(``scontrol create reservation Nodes=N Flags=IGNORE_JOBS Users=<this user>``), resumes it (only
the reservation's user may use it now), runs the validation command as a one-task ``srun
--reservation`` on it -- a job step on that node, as the preflight prolog's tests are -- and
reads its ``trainguard diag --json`` lines.  :meth:`resume` then deletes the reservation (the node
takes jobs again); :meth:`hold` drains it again with the reason and deletes the reservation.

Every method is idempotent (it looks at the node and the reservation before changing them), so
a validation interrupted anywhere is finished by running it again.
"""

from __future__ import annotations

import getpass
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from trainguard.actions.errors import SchedulerError, UnknownNode
from trainguard.actions.executors.slurm import node_flags, parse_record
from trainguard.actions.node_config import NodeReturnConfig
from trainguard.diag.preflight import Verdict, judge, read_results

_DRAINED = {"DRAIN", "DRAINED", "DRAINING"}
#: how long a Slurm query or update may take.
COMMAND_TIMEOUT_S = 20.0


class SlurmNodes:
    """Validate, resume and hold nodes of one Slurm cluster."""

    name = "slurm"

    def __init__(self, cfg: NodeReturnConfig, environ: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        base = dict(os.environ if environ is None else environ)
        # A caller inside an allocation must not hand its job's settings to our srun.
        self.env = {
            k: v for k, v in base.items() if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))
        }
        conf = cfg.slurm_conf or base.get("SLURM_CONF", "")
        if conf:
            self.env["SLURM_CONF"] = conf

    def _run(self, *argv: str, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        return self._call(*argv, check=check, timeout_s=timeout_s).stdout

    def _call(
        self, *argv: str, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        try:
            res = subprocess.run(
                list(argv),
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except FileNotFoundError as exc:
            raise SchedulerError(f"{argv[0]} is not installed here (the Slurm client)") from exc
        except subprocess.TimeoutExpired as exc:
            raise SchedulerError(f"`{shlex.join(argv)}` did not answer in {timeout_s:.0f} s") from exc
        if check and res.returncode != 0:
            raise SchedulerError(f"`{shlex.join(argv)}` -> {res.returncode}: {_why(res)}")
        return res

    def node(self, node: str) -> dict[str, str]:
        """``scontrol show node`` of ``node`` (UnknownNode when Slurm has none)."""
        res = self._call("scontrol", "-o", "show", "node", node, check=False)
        rec = parse_record(res.stdout.splitlines()[0]) if res.stdout.strip() else {}
        if rec.get("NodeName") == node:
            return rec
        if (
            res.returncode == 0
            or "not found" in res.stderr.lower()
            or "invalid node name" in res.stderr.lower()
        ):
            raise UnknownNode(f"Slurm has no node {node!r}")
        raise SchedulerError(f"cannot ask Slurm about node {node}: {_why(res)}")

    def drained(self, node: str) -> bool:
        return bool(node_flags(self.node(node).get("State", "")) & _DRAINED)

    def reservation(self, node: str) -> str:
        return f"{self.cfg.reservation_prefix}{node}"

    def _has_reservation(self, node: str) -> bool:
        out = self._run("scontrol", "-o", "show", "reservation", self.reservation(node), check=False)
        return f"ReservationName={self.reservation(node)} " in out + " "

    def _reserve(self, node: str) -> None:
        if self._has_reservation(node):
            return
        minutes = max(1, int(self.cfg.validate_timeout_s // 60) + 5)
        self._run(
            "scontrol", "create", "reservation", f"ReservationName={self.reservation(node)}",
            f"Nodes={node}", "StartTime=now", f"Duration={minutes}", f"Users={getpass.getuser()}",
            "Flags=IGNORE_JOBS",
        )  # fmt: skip

    def _unreserve(self, node: str) -> None:
        if self._has_reservation(node):
            self._run("scontrol", "delete", f"ReservationName={self.reservation(node)}")

    def validate(self, node: str) -> Verdict:
        """Run the validation command on ``node`` inside its reservation; its verdict.

        The node is left resumed inside the reservation: :meth:`resume` or :meth:`hold` decides."""
        self.node(node)
        self._reserve(node)
        if self.drained(node):
            self._run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        limit = self.cfg.validate_timeout_s
        argv = [
            "srun", f"--reservation={self.reservation(node)}", f"--nodelist={node}", "--nodes=1",
            "--ntasks=1", f"--job-name=tg-validate-{node}", f"--time={max(1, int(limit // 60) + 1)}",
            "--quiet", *self.cfg.command(),
        ]  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="tg-validate-") as tmp:
            out = Path(tmp) / "results.jsonl"
            t0 = time.monotonic()
            try:
                res = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    env=self.env,
                    timeout=limit,
                    stdin=subprocess.DEVNULL,
                )
                rc, stdout, stderr = res.returncode, res.stdout, res.stderr
            except subprocess.TimeoutExpired as exc:
                # srun forwards the kill to its step; the job ends with it.
                rc, stdout, stderr = 124, _text(exc.stdout), _text(exc.stderr)
            except FileNotFoundError as exc:
                raise SchedulerError("srun is not installed here (the Slurm client)") from exc
            out.write_text(stdout)
            lines, problems = read_results(out)
        last = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        verdict = judge(lines, rc, problems, timeout_s=limit, diag_error=last[-1][-400:] if last else "")
        if not verdict.duration_s:
            verdict = replace(verdict, duration_s=time.monotonic() - t0)
        return verdict

    def resume(self, node: str) -> None:
        """Back in service: not drained, no reservation."""
        self.node(node)
        if self.drained(node):
            self._run("scontrol", "update", f"NodeName={node}", "State=RESUME")
        self._unreserve(node)

    def hold(self, node: str, reason: str) -> None:
        """Out of service with ``reason`` (drained; the reason updated if it was drained already)."""
        self.node(node)
        self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason[:200]}")
        self._unreserve(node)


def _why(res: subprocess.CompletedProcess[str]) -> str:
    return (res.stderr or res.stdout).strip()[-400:] or f"exit {res.returncode}"


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data
