"""The ``trainguard`` command line: one click group; each area adds its commands from
``trainguard/commands/<area>.py`` (a module exposing ``COMMANDS``)."""

from __future__ import annotations

import importlib
import logging

import click

from trainguard import __version__

#: modules whose COMMANDS are added to the main group, in help order.
COMMAND_MODULES = (
    "trainguard.commands.stack",
    "trainguard.commands.smoke",
    "trainguard.commands.classify",
    "trainguard.commands.stacks",
    "trainguard.commands.worker",
    "trainguard.commands.ops",
    "trainguard.commands.exporter",
    "trainguard.commands.actions",
    "trainguard.commands.demo",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="TRAINGUARD_CONFIG",
    help="YAML config file (sections kafka, clickhouse, stack). Env: TRAINGUARD_CONFIG.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO level.")
@click.version_option(__version__, prog_name="trainguard")
@click.pass_context
def main(ctx: click.Context, config_path: str | None, verbose: bool) -> None:
    """TrainGuard keeps large training jobs running through hardware and software faults."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # kafka-python logs transient coordinator moves as warnings; they are noise for a CLI user.
    logging.getLogger("kafka").setLevel(logging.INFO if verbose else logging.ERROR)
    ctx.ensure_object(dict)["config_path"] = config_path


for _module in COMMAND_MODULES:
    for _cmd in importlib.import_module(_module).COMMANDS:
        main.add_command(_cmd)
