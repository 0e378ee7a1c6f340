"""The NVIDIA Xid catalog as data, and what each resolution bucket means for a training job.

The catalog (``detectors/rules/catalog/xid.yaml``) lists every Xid code with a short name,
NVIDIA's resolution as printed in its catalog and the bucket TrainGuard files it under
(``restart_app``, ``reset_gpu``, ``reboot_node``, ``contact_support``, ``ignore``).  Its
``policy`` maps a bucket to an action: a GPU that needs a reset or a reboot cannot be used by the
job until then, so its machine is evicted; ``restart_app`` restarts in place; ``ignore`` records.
The rule table uses it for the codes no row names and for Xid chains ("... caused by previous
Xid N" is judged by N).

>>> cat = default_xid_catalog()
>>> cat.entry(79).bucket, cat.decide(79)
('reboot_node', (<Action.EVICT: 'evict'>, <Severity.CRITICAL: 'critical'>))
>>> cat.decide(13)[0].value, cat.decide(45)[0].value, cat.decide(61)[0].value
('restart', 'ignore', 'diagnose')
>>> cat.decide(999) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from trainguard.schemas.enums import Action, Severity

CATALOG_PATH = Path(__file__).with_name("rules") / "catalog" / "xid.yaml"
BUCKETS = ("restart_app", "reset_gpu", "reboot_node", "contact_support", "ignore")


class XidCatalogError(ValueError):
    """The catalog file is unreadable or an entry is invalid; the message names the entry."""


@dataclass(frozen=True)
class XidEntry:
    """One catalog code."""

    code: int
    name: str
    bucket: str
    #: NVIDIA's resolution as its catalog prints it (None: the catalog gives none).
    nvidia: str | None = None
    #: the Ampere-and-newer catalog marks the code Unused.
    unused: bool = False
    #: a documented exception to the bucket's policy (with ``why``).
    action: Action | None = None
    why: str = ""
    note: str = ""


class XidCatalog:
    """Catalog entries by code plus the bucket -> (action, severity) policy."""

    def __init__(
        self,
        entries: list[XidEntry],
        policy: dict[str, tuple[Action, Severity]],
        unused: tuple[Action, Severity],
    ) -> None:
        missing = [b for b in BUCKETS if b not in policy]
        if missing or set(policy) - set(BUCKETS):
            raise XidCatalogError(f"policy must map exactly the buckets {', '.join(BUCKETS)}")
        self.entries = {e.code: e for e in entries}
        if len(self.entries) != len(entries):
            raise XidCatalogError("a code is listed twice")
        self.policy = dict(policy)
        self.unused = unused

    def __contains__(self, code: object) -> bool:
        return code in self.entries

    def entry(self, code: int) -> XidEntry:
        return self.entries[code]

    def decide(self, code: int) -> tuple[Action, Severity] | None:
        """(action, severity) for a training job seeing ``code``; None for a code not listed."""
        e = self.entries.get(code)
        if e is None:
            return None
        if e.action is not None:
            return e.action, _SEVERITY_OF[e.action]
        if e.unused:
            return self.unused
        return self.policy[e.bucket]


_SEVERITY_OF = {
    Action.EVICT: Severity.CRITICAL,
    Action.RESTART: Severity.ERROR,
    Action.ROLLBACK: Severity.ERROR,
    Action.DIAGNOSE: Severity.WARNING,
    Action.IGNORE: Severity.INFO,
}


def _action(v: Any, where: str) -> Action:
    try:
        a = Action(v)
    except ValueError:
        raise XidCatalogError(f"{where}: action {v!r} is not an action") from None
    if a not in _SEVERITY_OF:
        raise XidCatalogError(f"{where}: action {v!r} is not allowed for an Xid")
    return a


def _decision(raw: Any, where: str) -> tuple[Action, Severity]:
    if not isinstance(raw, dict) or set(raw) - {"action", "severity", "why"}:
        raise XidCatalogError(f"{where}: needs {{action, severity}}")
    action = _action(raw.get("action"), where)
    try:
        return action, Severity(str(raw.get("severity")))
    except ValueError:
        raise XidCatalogError(f"{where}: severity {raw.get('severity')!r} is not a severity") from None


_ENTRY_KEYS = {"code", "name", "bucket", "nvidia", "unused", "action", "why", "note"}


def _entry(raw: Any, i: int) -> XidEntry:
    where = f"codes[{i}]"
    if not isinstance(raw, dict) or not {"code", "name", "bucket"} <= set(raw) or set(raw) - _ENTRY_KEYS:
        allowed = ", ".join(sorted(_ENTRY_KEYS))
        raise XidCatalogError(f"{where}: needs code, name, bucket (and only {allowed})")
    code = raw["code"]
    if isinstance(code, bool) or not isinstance(code, int) or code < 1:
        raise XidCatalogError(f"{where}: code {code!r} is not a positive integer")
    where = f"Xid {code}"
    if raw["bucket"] not in BUCKETS:
        raise XidCatalogError(f"{where}: bucket {raw['bucket']!r} is not one of {', '.join(BUCKETS)}")
    action = _action(raw["action"], where) if raw.get("action") is not None else None
    if action is not None and not raw.get("why"):
        raise XidCatalogError(f"{where}: an action that overrides the bucket needs 'why'")
    return XidEntry(
        code=code,
        name=str(raw["name"]),
        bucket=raw["bucket"],
        nvidia=raw.get("nvidia"),
        unused=bool(raw.get("unused", False)),
        action=action,
        why=str(raw.get("why") or ""),
        note=str(raw.get("note") or ""),
    )


def load_xid_catalog(path: str | Path | None = None) -> XidCatalog:
    """Load and validate a catalog file (default: the built-in one)."""
    import yaml  # local: keeps the module importable for doc builds without PyYAML

    p = Path(path) if path is not None else CATALOG_PATH
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise XidCatalogError(f"cannot read Xid catalog {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise XidCatalogError(f"Xid catalog {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("codes"), list):
        raise XidCatalogError(f"Xid catalog {p}: top level needs a 'codes' list")
    if tuple(data.get("buckets") or ()) != BUCKETS:
        raise XidCatalogError(f"Xid catalog {p}: 'buckets' must be {list(BUCKETS)}")
    policy_raw = data.get("policy")
    if not isinstance(policy_raw, dict):
        raise XidCatalogError(f"Xid catalog {p}: 'policy' must map buckets to {{action, severity}}")
    policy = {b: _decision(v, f"policy.{b}") for b, v in policy_raw.items()}
    unused = _decision(data.get("unused"), "unused")
    return XidCatalog([_entry(raw, i) for i, raw in enumerate(data["codes"])], policy, unused)


@cache
def default_xid_catalog() -> XidCatalog:
    """The built-in catalog, loaded once."""
    return load_xid_catalog()
