"""The job-topology options shared by the analysis commands (``stacks analyze``, ``fr analyze``).

``@topology_options`` adds ``--tp --pp --dp --ranks-per-machine [--order]`` to a command and hands
the command one ``shape`` argument (:class:`JobShape`) in their place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from trainguard.schemas.topology import JobTopology


@dataclass(frozen=True)
class JobShape:
    """What the options say; :meth:`topology` names the job (ValueError for an impossible shape)."""

    tp: int
    pp: int
    dp: int
    ranks_per_machine: int
    order: str

    def topology(self, job: str) -> JobTopology:
        tp, pp, dp, rpm = self.tp, self.pp, self.dp, self.ranks_per_machine
        return JobTopology(job=job, tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm, order=self.order)


_SIZE = click.IntRange(min=1)
_OPTIONS = [
    click.option("--tp", type=_SIZE, required=True, help="Tensor-parallel size."),
    click.option("--pp", type=_SIZE, required=True, help="Pipeline-parallel size."),
    click.option("--dp", type=_SIZE, required=True, help="Data-parallel size."),
    click.option("--ranks-per-machine", type=_SIZE, required=True, help="Ranks on each machine."),
    click.option("--order", default="tp-dp-pp", show_default=True, help="Rank order, fastest first."),
]


def topology_options(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)
    def command(*args: Any, tp: int, pp: int, dp: int, ranks_per_machine: int, order: str, **kw: Any) -> Any:
        return f(*args, shape=JobShape(tp, pp, dp, ranks_per_machine, order), **kw)

    for option in reversed(_OPTIONS):
        command = option(command)
    return command
