"""The ``trainguard`` command line: one click group; every installed package adds its commands
through the ``trainguard.commands`` entry point group (a list of click commands), the product's own
areas (``trainguard/commands/<area>.py``) as well as plugins such as the demo."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import click

from trainguard import __version__

#: the entry point group whose values are lists of click commands.
ENTRY_POINT_GROUP = "trainguard.commands"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="TRAINGUARD_CONFIG",
    help="YAML config file (sections kafka, clickhouse, stack). Env: TRAINGUARD_CONFIG.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress on stderr for long commands (stack up, record, replay). Env: TRAINGUARD_PROGRESS=0.",
)
@click.version_option(__version__, prog_name="trainguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, verbose: bool, quiet: bool) -> None:
    """TrainGuard keeps large training jobs running through hardware and software faults."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # kafka-python logs transient coordinator moves as warnings; they are noise for a CLI user.
    logging.getLogger("kafka").setLevel(logging.INFO if verbose else logging.ERROR)
    obj = ctx.ensure_object(dict)
    obj["config_path"] = config_path
    obj["quiet"] = quiet


def _load_plugins() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            commands = ep.load()
        except Exception as exc:  # a broken plugin must not take the operator's CLI down with it
            logging.getLogger(__name__).error("commands of %s (%s) not loaded: %s", ep.name, ep.value, exc)
            continue
        for cmd in commands:
            main.add_command(cmd)


_load_plugins()
