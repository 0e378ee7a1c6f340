"""The ``trainguard`` command line: one click group whose commands come from the
``trainguard.commands`` entry point group, the product's own (``trainguard/commands/<area>.py``)
as well as plugins such as the demo.

A command's module is imported only when that command runs (``--help`` of the whole group loads
them all to show their summaries): each role installs only its own extras, so ``trainguard launch``
on a training image must not import the worker's Faust or the report's plotly, and a command whose
extra is missing says which one instead of taking every other command down with it.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

import click

from trainguard import __version__

#: the entry point group: a name per command, its value a click command (or, for plugins written
#: against the older convention, a list of click commands).
ENTRY_POINT_GROUP = "trainguard.commands"

#: which extra brings each third-party module a command may need (for the error a user sees).
EXTRA_OF_MODULE = {
    "faust": "worker",
    "aiokafka": "worker",
    "sklearn": "worker",
    "numpy": "worker",
    "crc32c": "worker",
    "clickhouse_connect": "store",
    "plotly": "report",
    "prometheus_client": "node, worker, actions or store",
    "pynvml": "node",
    "kubernetes": "k8s",
}

log = logging.getLogger(__name__)


def _as_commands(name: str, loaded: object) -> list[click.Command]:
    if isinstance(loaded, click.Command):
        return [loaded]
    if isinstance(loaded, list | tuple) and all(isinstance(c, click.Command) for c in loaded):
        return list(loaded)
    raise TypeError(f"entry point {name!r} is neither a click command nor a list of them: {loaded!r}")


class LazyGroup(click.Group):
    """A click group that imports a command's module the first time the command is asked for."""

    def _entry_points(self) -> dict[str, EntryPoint]:
        return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}

    def _load(self, ep: EntryPoint) -> list[click.Command]:
        try:
            commands = _as_commands(ep.name, ep.load())
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            extra = EXTRA_OF_MODULE.get(top)
            hint = f": install `trainguard[{extra}]`" if extra else ""
            raise click.ClickException(f"`trainguard {ep.name}` needs the {top!r} module{hint}") from exc
        for cmd in commands:
            if cmd.name and cmd.name not in self.commands:
                self.add_command(cmd)
        return commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(self._entry_points()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        eps = self._entry_points()
        if cmd_name in eps:
            commands = self._load(eps[cmd_name])
            for cmd in commands:
                if cmd.name == cmd_name:
                    return cmd
            return commands[0] if len(commands) == 1 else None
        # A plugin of the older convention registers an area whose list holds this command.
        for name, ep in eps.items():
            if name in self.commands:
                continue
            try:
                self._load(ep)
            except Exception as exc:  # a broken plugin must not take the operator's CLI down with it
                log.error("commands of %s (%s) not loaded: %s", ep.name, ep.value, exc)
            if cmd_name in self.commands:
                return self.commands[cmd_name]
        return None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        found: list[tuple[str, click.Command | str]] = []
        for name in self.list_commands(ctx):
            try:
                cmd = self.get_command(ctx, name)
            except click.ClickException as exc:
                found.append((name, f"(unavailable: {exc.message})"))
                continue
            if cmd is not None and not cmd.hidden:
                found.append((name, cmd))
        limit = formatter.width - 6 - max((len(name) for name, _ in found), default=0)
        rows = [(n, c if isinstance(c, str) else c.get_short_help_str(limit)) for n, c in found]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(
    cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
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
