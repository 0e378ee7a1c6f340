"""The demo's commands, added to ``trainguard`` through the ``trainguard.commands`` entry point:

* ``trainguard demo`` -- the end-to-end demo (a real PyTorch job on a local process cluster, or
  with ``--cluster slurm`` a batch job on the stack's private Slurm, with ``--cluster k8s`` pods on
  its private Kubernetes);
* ``trainguard inject`` -- inject a fault into a machine of a running demo;
* ``trainguard demo-exporter`` -- the node exporter of a demo machine (simulated GPUs);
* ``trainguard demo-diagnose`` -- the real stop-time tests on local subprocess "machines".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import yaml

from trainguard.commands.exporter import exporter_options, run_exporter
from trainguard.context import friendly_errors, home_hint, settings


@click.command()
@click.option(
    "--scenario",
    "scenario_file",
    type=click.Path(exists=True, dir_okay=False),
    help="YAML list of {fault, machine} (machine: index or name); default: one of each kind.",
)
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Also write the result as JSON.")
@click.option("--keep", is_flag=True, help="Leave the cluster, worker and action service running.")
@click.option(
    "--baseline/--no-baseline",
    default=None,
    help="Run the same scenario on a second job under the baseline policy (timeout + cold requeue); "
    "default: yes on the local cluster (not available under Slurm).",
)
@click.option(
    "--cluster",
    type=click.Choice(["local", "slurm", "k8s"]),
    default="local",
    show_default=True,
    help="local: machines are process groups on this host; slurm: nodes of the stack's private "
    "Slurm (started with it), recovery through the slurm executor; k8s: nodes of the stack's private "
    "Kubernetes (started with it), ranks in pods, recovery through the kubernetes executor.",
)
@click.option(
    "--shadow-loader/--no-shadow-loader",
    default=True,
    show_default=True,
    help="TrainGuard's job reads through the shadow loader (a warm standby loader takes over a hung "
    "one in place); --no-shadow-loader: one plain DataLoader, a hung loader is evicted and restarted.",
)
@click.pass_context
@friendly_errors
def demo(
    ctx: click.Context,
    scenario_file: str | None,
    summary_json: str | None,
    keep: bool,
    baseline: bool | None,
    cluster: str,
    shadow_loader: bool,
) -> None:
    """Run a real PyTorch job on a local cluster through injected faults; print timeline and ETTR."""
    from trainguard_demo.k8s_demo import K8S_SCENARIO, K8sDemo, print_k8s
    from trainguard_demo.report import print_timeline
    from trainguard_demo.run import DEFAULT_SCENARIO, Demo, DemoConfig
    from trainguard_demo.slurm_demo import SLURM_SCENARIO, SlurmDemo, print_slurm

    if cluster != "local" and baseline:
        raise click.UsageError(
            f"--baseline runs on the local cluster only (drop it with --cluster {cluster})"
        )
    scenario = {"local": DEFAULT_SCENARIO, "slurm": SLURM_SCENARIO, "k8s": K8S_SCENARIO}[cluster]
    if scenario_file:
        scenario = yaml.safe_load(Path(scenario_file).read_text())
        if not isinstance(scenario, list) or not all(isinstance(i, dict) and "fault" in i for i in scenario):
            raise click.BadParameter(
                "a scenario is a list of {fault, machine} mappings", param_hint="--scenario"
            )
    import signal

    if cluster == "slurm":
        d: Demo = SlurmDemo(settings(ctx), DemoConfig(baseline=False, shadow_loader=shadow_loader), scenario)
    elif cluster == "k8s":
        d = K8sDemo(settings(ctx), DemoConfig(baseline=False, shadow_loader=shadow_loader), scenario)
    else:
        d = Demo(
            settings(ctx), DemoConfig(baseline=baseline is not False, shadow_loader=shadow_loader), scenario
        )

    def on_term(signum: int, frame: object) -> None:
        # Run the cleanup below on SIGTERM too, not only on Ctrl-C -- once: a second SIGTERM (a
        # supervisor that signals the whole group) must not cut the cleanup itself short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        summary = d.run()
    finally:
        if not keep:
            d.stop()
    print_timeline(summary)
    print_slurm(summary)
    print_k8s(summary)
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary, indent=2))
    missed = [i["fault"] for i in summary["incidents"] if not i["recovered"]]
    if missed:
        click.echo(f"NOT RECOVERED: {', '.join(missed)}", err=True)
        ctx.exit(1)


@click.command()
@click.option("--job", required=True)
@click.option("--machine", required=True, help="Machine name (m0, standby-1, ...).")
@click.option(
    "--fault",
    required=True,
    help="xid, nic-down, nic-flap, gpu-lost, machine-freeze, hang, hang-dataloader, "
    "hang-checkpoint, hang-p2p, slow, nan, crash, user-error, oom",
)
@click.option("--xid", default=79, show_default=True, help="Xid code for --fault xid.")
@click.option(
    "--cluster-dir", type=click.Path(file_okay=False), help="Default: the latest demo run's cluster."
)
@click.pass_context
@friendly_errors
def inject(ctx: click.Context, job: str, machine: str, fault: str, xid: int, cluster_dir: str | None) -> None:
    """Inject a fault into a machine of the demo cluster."""
    from trainguard_demo.inject import inject as do_inject

    if cluster_dir is None:
        demos = settings(ctx).stack.home_path / "demo"
        runs = sorted(demos.glob("*/cluster"))
        if not runs:
            raise click.ClickException(home_hint(f"no demo cluster in {demos}; pass --cluster-dir"))
        cluster_dir = str(runs[-1])
    try:
        click.echo(do_inject(Path(cluster_dir), machine, fault, job=job, xid=xid, settings=settings(ctx)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fault") from exc


@click.command("demo-exporter")
@exporter_options
@click.option("--simulate-gpus", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.pass_context
@friendly_errors
def demo_exporter(ctx: click.Context, exporter_config: str | None, simulate_gpus: int, **flags: Any) -> None:
    """The node exporter of a demo machine: the product's exporter with N simulated GPUs."""
    from trainguard_demo.nvml_sim import SimulatedNvml

    if flags.get("metrics_port") is None:
        # A demo "machine" shares the host with the others: no /metrics port unless asked for
        # (every exporter after the first would find 9401 taken).
        flags["metrics_port"] = 0
    run_exporter(ctx, exporter_config, flags, nvml=SimulatedNvml(simulate_gpus))


@click.command("demo-diagnose")
@click.option("--machines", required=True, help="Comma-separated local machine names (2 or more).")
@click.option("--tests", default="alignment,connectivity", show_default=True)
@click.option("--perturb", default="", help="Machines whose alignment arithmetic is made wrong.")
@click.option("--corrupt", default="", help="Machines that corrupt all-gather payloads.")
@click.option("--absent", default="", help="Machines that never join the collective.")
@click.option("--timeout", "timeout_s", default=20.0, show_default=True)
@friendly_errors
def diagnose(machines: str, tests: str, perturb: str, corrupt: str, absent: str, timeout_s: float) -> None:
    """Run the real stop-time tests on local subprocess machines; exit 1 if any machine fails."""
    from trainguard_demo.diagnostics import LocalFaults, run_local

    def names(text: str) -> frozenset[str]:
        return frozenset(x for x in text.split(",") if x)

    ms = [m for m in machines.split(",") if m]
    faults = LocalFaults(perturb=names(perturb), corrupt=names(corrupt), absent=names(absent))
    results = run_local(ms, [t for t in tests.split(",") if t], faults, timeout_s)
    for r in results:
        click.echo(json.dumps(asdict(r)))
    if not all(r.passed for r in results):
        raise SystemExit(1)


COMMANDS = [demo, inject, demo_exporter, diagnose]
