"""``trainguard keys``: the Ed25519 keys that sign control-plane records
(see :mod:`trainguard.infra.signing`).

* ``trainguard keys init [--principal NAME ...] [--force]`` -- create the missing private keys under
  ``<stack home>/keys`` (``--force``: replace them; the old public keys stay trusted until revoked);
* ``trainguard keys show`` -- the trusted keys: id, principal, the topics it may sign;
* ``trainguard keys trust --principal P --public-key B64`` / ``revoke KID`` -- rotation;
* ``trainguard keys export-public PRINCIPAL`` -- the base64 public key, for another site's trust.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from trainguard.context import friendly_errors, home_hint, settings
from trainguard.infra.signing import (
    PRINCIPALS,
    ROLE_TOPICS,
    AuthError,
    SigningConfig,
    add_trusted,
    init_keys,
    key_id,
    keys_dir,
    load_trusted,
    public_key_b64,
    remove_trusted,
    trusted_path,
)
from trainguard.schemas.config import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def _key_errors(fn: F) -> F:
    """Key and trust-file problems are the whole story: ``Error: ...``, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (AuthError, ConfigError) as exc:
            raise click.ClickException(home_hint(str(exc))) from exc
        except OSError as exc:
            raise click.ClickException(home_hint(f"{exc.filename or ''}: {exc.strerror or exc}")) from exc

    return wrapper  # type: ignore[return-value]


def _paths(ctx: click.Context) -> tuple[Path, Path]:
    s = settings(ctx)
    # The `signing` settings section, once the config model has one; defaults until then.
    cfg = getattr(s, "signing", None) or SigningConfig()
    home = s.stack.home_path
    return keys_dir(cfg, home), trusted_path(cfg, home)


def _topics(principal: str) -> str:
    return ", ".join(sorted(t.removeprefix("trainguard.") for t in ROLE_TOPICS.get(principal, ())))


_PRINCIPAL = click.Choice(PRINCIPALS)


@click.group()
def keys() -> None:
    """Signing keys of the control plane (decisions, jobs, commands, worker control)."""


@keys.command()
@click.option(
    "--principal",
    "principals",
    multiple=True,
    type=_PRINCIPAL,
    help="Only this principal's key (repeatable; default: all).",
)
@click.option("--force", is_flag=True, help="Replace existing keys (the old public keys stay trusted).")
@click.pass_context
@friendly_errors
@_key_errors
def init(ctx: click.Context, principals: tuple[str, ...], force: bool) -> None:
    """Create the missing private keys and the trusted keys file under <stack home>/keys (idempotent)."""
    kdir, tfile = _paths(ctx)
    wanted = principals or PRINCIPALS
    existed = {p for p in wanted if (kdir / f"{p}.key").exists()}
    kids = init_keys(kdir, wanted, force=force)
    for p, kid in kids.items():
        state = "replaced" if p in existed and force else "exists" if p in existed else "created"
        click.echo(f"{p:9} {kid}  {state}  {kdir / (p + '.key')}")
    click.echo(f"trusted keys: {kdir / 'trusted.yaml'}")
    if tfile != kdir / "trusted.yaml":
        click.echo(
            f"note: signing.trusted_file points at {tfile}; add these keys there (keys trust)", err=True
        )


@keys.command()
@click.pass_context
@friendly_errors
@_key_errors
def show(ctx: click.Context) -> None:
    """The trusted keys: key id, principal and the topics it may sign."""
    kdir, tfile = _paths(ctx)
    if not tfile.exists():
        raise click.ClickException(home_hint(f"no trusted keys at {tfile}: run `trainguard keys init`"))
    trusted = load_trusted(tfile)
    here = {_local_kid(kdir, p) for p in PRINCIPALS}
    click.echo(f"{tfile}:")
    for kid, tk in sorted(trusted.items(), key=lambda kv: (kv[1].principal, kv[0])):
        held = "  (private key here)" if kid in here else ""
        click.echo(f"{kid}  {tk.principal:9} {_topics(tk.principal)}{held}")
    if not trusted:
        click.echo("(no trusted keys: every signed record is refused)")


def _local_kid(kdir: Path, principal: str) -> str | None:
    """The key id of ``kdir/<principal>.key``, None if there is none (or it cannot be read)."""
    if not (kdir / f"{principal}.key").exists():
        return None
    try:
        return key_id(base64.b64decode(public_key_b64(kdir, principal)))
    except ConfigError as exc:
        click.echo(f"warning: {exc}", err=True)
        return None


@keys.command()
@click.option("--principal", required=True, type=_PRINCIPAL, help="Whose key it is.")
@click.option("--public-key", "public_key", required=True, help="Base64 raw Ed25519 public key.")
@click.pass_context
@friendly_errors
@_key_errors
def trust(ctx: click.Context, principal: str, public_key: str) -> None:
    """Trust one more public key (a rotated key, or another site's)."""
    _, tfile = _paths(ctx)
    kid = add_trusted(tfile, principal, public_key)
    click.echo(f"trusted {kid} as {principal} ({_topics(principal)}) in {tfile}")


@keys.command()
@click.argument("kid")
@click.pass_context
@friendly_errors
@_key_errors
def revoke(ctx: click.Context, kid: str) -> None:
    """Stop trusting key KID (consumers refuse its records from their next start)."""
    kdir, tfile = _paths(ctx)
    removed = remove_trusted(tfile, kid)
    click.echo(f"revoked {kid} ({removed.principal}) in {tfile}")
    if _local_kid(kdir, removed.principal) == kid:
        # `keys init` trusts every key in the directory again: a revoked key must leave it.
        click.echo(
            f"warning: {kdir / (removed.principal + '.key')} is this key and `trainguard keys init` "
            f"would trust it again: replace it with `trainguard keys init --principal {removed.principal} "
            "--force`",
            err=True,
        )


@keys.command("export-public")
@click.argument("principal", type=_PRINCIPAL)
@click.pass_context
@friendly_errors
@_key_errors
def export_public(ctx: click.Context, principal: str) -> None:
    """Print PRINCIPAL's base64 public key (for `keys trust` at another site)."""
    kdir, _ = _paths(ctx)
    click.echo(public_key_b64(kdir, principal))


COMMANDS = [keys]
