"""Ed25519 signatures on control-plane Kafka records (decisions, jobs, commands, worker control).

The action service evicts machines and restarts jobs on what it reads from these topics, and node
exporters run the commands they read: anyone who can produce to them controls the cluster.  Every
record on a signed topic carries four headers (key id, issued-at, expiry, signature over topic,
key, value and those fields); consumers drop records that are unsigned, signed by an unknown or
revoked key, signed by a principal that may not write that topic (a worker cannot rewrite job
specs), tampered with, expired, dated in the future, or replayed at other log coordinates.
Not covered: confidentiality (records are readable), deletion or suppression of records, a thief
of a private key, and denial of service by flooding.  Kafka ACLs (and TLS/SASL) are still needed:
signatures decide what a consumer acts on, ACLs decide who may write, read or delete at all.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import os
import stat
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.schemas import topics as _topics
from trainguard.schemas.base import now_ms as _now_ms
from trainguard.schemas.config import ConfigError
from trainguard.schemas.typecheck import bounds

DECISIONS = _topics.DECISIONS.name
JOBS = _topics.JOBS.name
COMMANDS = _topics.COMMANDS.name
CONTROL = _topics.CONTROL.name
DETECTIONS = _topics.DETECTIONS.name
ACTIONS = _topics.ACTIONS.name

#: topics whose records must be signed (registry names).  Detections and action events too: the
#: worker turns detections into decisions it signs, and reads action events to know a recovery
#: is running or held, so whoever could write them unsigned could evict a machine, or keep a
#: dead job from being restarted, through the worker (#38).
SIGNED_TOPICS: frozenset[str] = frozenset({DECISIONS, JOBS, COMMANDS, CONTROL, DETECTIONS, ACTIONS})
#: records acted on when read (short lifetime) vs state topics re-read from their start on every
#: start (action events: a worker that starts reads the recoveries in flight from their history).
ACT_TOPICS: frozenset[str] = frozenset({DECISIONS, COMMANDS, DETECTIONS})
STATE_TOPICS: frozenset[str] = frozenset({JOBS, CONTROL, ACTIONS})

H_KID, H_IAT, H_EXP, H_SIG = "tg-kid", "tg-iat", "tg-exp", "tg-sig"
_HEADERS = (H_KID, H_IAT, H_EXP, H_SIG)

#: which topics each principal may sign: workers emit decisions and exporter commands, the action
#: service decisions (code updates), job specs (after a swap) and node agents' restart commands
#: (``agent_restart``: the warm path of a restart), the job launcher (``trainguard
#: launch``, on the training nodes, where users' jobs can read its key) job specs only,
#: the operator everything.
ROLE_TOPICS: dict[str, frozenset[str]] = {
    "worker": frozenset({DECISIONS, COMMANDS, DETECTIONS}),
    # commands: the executors' signed restart orders to the warm node agents (trainguard.agent)
    "actions": frozenset({DECISIONS, JOBS, ACTIONS, COMMANDS}),
    "launcher": frozenset({JOBS}),
    "operator": frozenset(SIGNED_TOPICS),
}
PRINCIPALS: tuple[str, ...] = ("worker", "actions", "launcher", "operator")
#: the command kinds a principal may order, where it may not order every kind: the action
#: service signs commands only to restart or update the warm node agents (trainguard.agent), not
#: to change what an exporter samples or captures.
COMMAND_KINDS: dict[str, frozenset[str]] = {"actions": frozenset({"agent_restart", "agent_code"})}


def signer_principal(verifier: Verifier | None, headers: Mapping[Any, Any] | Sequence[Any] | None) -> str:
    """The principal whose trusted key signed a record already verified ("" when signing is off
    or the key is not known): what a consumer needs to check what that principal may order."""
    if verifier is None:
        return ""
    kid = _signature_headers(headers).get(H_KID, b"").decode("ascii", "replace")
    trusted = verifier.trusted.get(kid)
    return trusted.principal if trusted is not None else ""


def may_order(principal: str, kind: str) -> bool:
    """Whether ``principal`` may order a command of ``kind`` (see :data:`COMMAND_KINDS`)."""
    allowed = COMMAND_KINDS.get(principal)
    return allowed is None or kind in allowed


TRUSTED_FILE = "trusted.yaml"
_SIG_LEN = 64
_PUB_LEN = 32
_DOMAIN = b"tg1"


class AuthError(ValueError):
    """Why a record is not authentic (or why this process may not sign it)."""


@dataclass(frozen=True)
class SigningConfig:
    """The ``signing`` settings section."""

    #: False: nothing signed, nothing verified (a cluster whose Kafka ACLs are the only guard).
    #: On by default: `trainguard stack up` / `trainguard keys init` create the keys it needs.
    enabled: bool = True
    #: "" -> ``<stack home>/keys``.
    keys_dir: str = ""
    #: which private key this process signs with ("" -> chosen by the component).
    principal: str = field(default="", metadata=bounds(max_len=64))
    #: explicit private key PEM path (overrides ``keys_dir/<principal>.key``).
    key_file: str = ""
    #: explicit trusted keys YAML (overrides ``keys_dir/trusted.yaml``).
    trusted_file: str = ""
    #: lifetime of what this process signs on decisions and commands: they are acted on when read,
    #: so a captured one must not be replayable long after (also bounds the replay window).
    act_ttl_s: float = field(default=900.0, metadata=bounds(1, 30 * 86400))
    #: jobs and worker control are state topics re-read from their start on every start: their
    #: records must stay valid for the topics' retention (a year), or a restart would forget jobs.
    state_ttl_s: float = field(default=400 * 86400.0, metadata=bounds(60, 10 * 366 * 86400))
    clock_skew_s: float = field(default=60.0, metadata=bounds(0, 3600))
    #: replay window entries ((key id, signature) -> first coordinates), oldest forgotten first.
    seen_capacity: int = field(default=200_000, metadata=bounds(1, 100_000_000))


def key_id(public_raw: bytes) -> str:
    """The id of a public key: the first 16 hex digits of the SHA-256 of its 32 raw bytes.

    >>> key_id(bytes(32))
    '66687aadf862bd77'
    """
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _registry_name(topic: str) -> str:
    """The registry name of ``topic``, also for a namespaced twin (``trainguard.shadow.control.jobs``)
    so a shadow worker signs like a live one; the full name stays in the signed message, so a record
    cannot be moved between namespaces."""
    if topic in _topics.BY_NAME or not topic.startswith(_topics.PREFIX):
        return topic
    _, _, rest = topic.removeprefix(_topics.PREFIX).partition(".")
    base = _topics.PREFIX + rest
    return base if base in _topics.BY_NAME else topic


def _message(topic: str, key: bytes | None, value: bytes | None, iat: bytes, exp: bytes, kid: bytes) -> bytes:
    # Length-prefixed parts: a plain separator join would let bytes move between key and value
    # (a NUL in either) under the same signature.  A tombstone (None) differs from an empty value.
    parts = [topic.encode(), key or b"", b"\x00" if value is None else b"\x01" + value, iat, exp, kid]
    return _DOMAIN + b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _iso(ms: int) -> str:
    try:
        return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms"


def keys_dir(cfg: SigningConfig, home: Path) -> Path:
    """Where the key set lives: ``signing.keys_dir`` or ``<stack home>/keys``."""
    return Path(cfg.keys_dir).expanduser() if cfg.keys_dir else Path(home) / "keys"


def trusted_path(cfg: SigningConfig, home: Path) -> Path:
    return Path(cfg.trusted_file).expanduser() if cfg.trusted_file else keys_dir(cfg, home) / TRUSTED_FILE


def _check_principal(principal: str) -> None:
    if principal not in ROLE_TOPICS:
        raise ConfigError(f"unknown principal {principal!r} (one of {', '.join(PRINCIPALS)})")


class Signer:
    """Signs records of the topics its principal may write."""

    def __init__(self, private_key: Ed25519PrivateKey, kid: str, principal: str, cfg: SigningConfig) -> None:
        _check_principal(principal)
        self.private_key = private_key
        self.kid = kid
        self.principal = principal
        self.cfg = cfg
        self._kid_b = kid.encode("ascii")
        self._act_ttl_ms = int(cfg.act_ttl_s * 1000)
        self._state_ttl_ms = int(cfg.state_ttl_s * 1000)

    @classmethod
    def load(cls, cfg: SigningConfig, home: Path, principal: str) -> Signer:
        """The signer of ``cfg.principal or principal``, reading ``cfg.key_file`` or
        ``keys_dir/<principal>.key``."""
        principal = cfg.principal or principal
        _check_principal(principal)
        path = Path(cfg.key_file).expanduser() if cfg.key_file else keys_dir(cfg, home) / f"{principal}.key"
        private = _read_private_key(path)
        return cls(private, key_id(_public_raw(private.public_key())), principal, cfg)

    @property
    def public_key_b64(self) -> str:
        return base64.b64encode(_public_raw(self.private_key.public_key())).decode()

    def ttl_ms(self, topic: str) -> int:
        return self._state_ttl_ms if _registry_name(topic) in STATE_TOPICS else self._act_ttl_ms

    def headers(
        self, topic: str, key: bytes | None, value: bytes | None, now_ms: int | None = None
    ) -> list[tuple[str, bytes]]:
        """The signature headers of one record (``value`` None: a signed tombstone)."""
        if _registry_name(topic) not in ROLE_TOPICS[self.principal]:
            raise AuthError(
                f"key of principal {self.principal} may not sign topic {topic} "
                f"(a bug in the caller: {self.principal} signs only {_short(ROLE_TOPICS[self.principal])})"
            )
        now = _now_ms() if now_ms is None else now_ms
        iat = str(now).encode()
        exp = str(now + self.ttl_ms(topic)).encode()
        sig = self.private_key.sign(_message(topic, key, value, iat, exp, self._kid_b))
        return [(H_KID, self._kid_b), (H_IAT, iat), (H_EXP, exp), (H_SIG, sig)]


@dataclass(frozen=True)
class TrustedKey:
    public_key: Ed25519PublicKey
    principal: str
    kid: str


def _short(names: Iterable[str]) -> str:
    return ", ".join(sorted(n.removeprefix(_topics.PREFIX) for n in names))


def _header_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise AuthError(f"malformed signature header value of type {type(value).__name__}")


def _signature_headers(headers: Mapping[Any, Any] | Sequence[Any] | None) -> dict[str, bytes]:
    """The tg-* headers of a record, from a kafka-python/aiokafka sequence of pairs or a Faust mapping."""
    if not headers:
        return {}
    pairs: Iterable[Any] = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, bytes] = {}
    for pair in pairs:
        try:
            name, value = pair
        except (TypeError, ValueError):
            raise AuthError(
                f"malformed record headers: {type(pair).__name__} is not a (name, value) pair"
            ) from None
        if isinstance(name, bytes | bytearray):
            name = bytes(name).decode("utf-8", "replace")
        if name not in _HEADERS:
            continue
        if name in found:
            # Two signatures on one record: a producer bug (headers appended twice) or tampering.
            raise AuthError(f"malformed signature: header {name} appears twice")
        found[name] = _header_bytes(value)
    return found


def _int_header(h: dict[str, bytes], name: str) -> int:
    raw = h[name]
    if not raw.isdigit() or len(raw) > 19:
        raise AuthError(f"malformed signature: header {name} is not a time in ms ({raw[:24]!r})")
    return int(raw)


class Verifier:
    """Checks signed records against the trusted keys; remembers signatures to refuse replays."""

    def __init__(self, trusted: dict[str, TrustedKey], cfg: SigningConfig) -> None:
        self.trusted = dict(trusted)
        self.cfg = cfg
        self._skew_ms = int(cfg.clock_skew_s * 1000)
        # (kid, sig) -> (first coordinates, exp ms), least recently seen first.
        self._seen: OrderedDict[tuple[str, bytes], tuple[tuple[str, int, int] | None, int]] = OrderedDict()
        # (exp ms, (kid, sig)): entries past their expiry are dropped (an expired record is refused
        # anyway); stale heap rows (entries evicted by capacity) are skipped when popped.
        self._expiry: list[tuple[int, tuple[str, bytes]]] = []
        self._lock = threading.Lock()

    @classmethod
    def load(cls, cfg: SigningConfig, home: Path) -> Verifier:
        path = trusted_path(cfg, home)
        if not path.exists():
            raise ConfigError(
                f"no trusted keys at {path}: run `trainguard keys init` "
                "(or copy trusted.yaml from the host that holds the keys)"
            )
        return cls(load_trusted(path), cfg)

    @property
    def seen_size(self) -> int:
        return len(self._seen)

    def verify(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Mapping[Any, Any] | Sequence[Any] | None,
        now_ms: int,
        where: tuple[str, int, int] | None = None,
    ) -> str:
        """The principal that signed this record; :class:`AuthError` if it is not authentic.

        ``where`` is the record's (topic, partition, offset): the same record read again at the same
        coordinates (a redelivery, a seek back, a state topic re-read) is accepted again, the same
        signature anywhere else is a replay.  Without coordinates a second sighting is a replay.
        """
        h = _signature_headers(headers)
        if H_SIG not in h and H_KID not in h:
            raise AuthError(f"unsigned {'tombstone' if value is None else 'record'} on {topic}")
        missing = [n for n in _HEADERS if n not in h]
        if missing:
            raise AuthError(f"malformed signature: missing header(s) {', '.join(missing)}")
        kid_b, sig = h[H_KID], h[H_SIG]
        kid = kid_b.decode("ascii", "replace")
        trusted = self.trusted.get(kid)
        if trusted is None:
            raise AuthError(f"unknown key id {kid[:32]!r} (not among the trusted keys, or revoked)")
        iat, exp = _int_header(h, H_IAT), _int_header(h, H_EXP)
        if len(sig) != _SIG_LEN:
            raise AuthError(f"bad signature (key id {kid}, principal {trusted.principal}): {len(sig)} bytes")
        try:
            trusted.public_key.verify(sig, _message(topic, key, value, h[H_IAT], h[H_EXP], kid_b))
        except InvalidSignature:
            raise AuthError(f"bad signature (key id {kid}, principal {trusted.principal})") from None
        # Only now are kid, iat and exp known to come from the key holder.
        if _registry_name(topic) not in ROLE_TOPICS.get(trusted.principal, ()):
            raise AuthError(f"key of principal {trusted.principal} may not sign topic {topic}")
        if exp < iat:
            raise AuthError(f"malformed signature: expires ({_iso(exp)}) before it was issued ({_iso(iat)})")
        if exp + self._skew_ms < now_ms:
            raise AuthError(f"expired at {_iso(exp)} (issued {_iso(iat)}, now {_iso(now_ms)})")
        if iat - self._skew_ms > now_ms:
            raise AuthError(
                f"issued in the future at {_iso(iat)} (now {_iso(now_ms)}, "
                f"allowed clock skew {self.cfg.clock_skew_s:g}s)"
            )
        self._remember(kid, sig, exp, now_ms, where)
        return trusted.principal

    def _remember(
        self, kid: str, sig: bytes, exp: int, now_ms: int, where: tuple[str, int, int] | None
    ) -> None:
        ident = (kid, sig)
        if where is not None:
            where = (str(where[0]), int(where[1]), int(where[2]))  # a list or numpy ints compare equal
        with self._lock:
            self._drop_expired(now_ms)
            first = self._seen.get(ident)
            if first is not None:
                first_where = first[0]
                if where is None or first_where != where:
                    at = (
                        f"{first_where[0]}[{first_where[1]}]@{first_where[2]}"
                        if first_where is not None
                        else "a record without coordinates"
                    )
                    raise AuthError(f"replayed (first seen at {at})")
                self._seen.move_to_end(ident)
                return
            self._seen[ident] = (where, exp)
            heapq.heappush(self._expiry, (exp, ident))
            while len(self._seen) > self.cfg.seen_capacity:
                self._seen.popitem(last=False)
            if len(self._expiry) > 2 * self.cfg.seen_capacity + 1024:
                # Rows of entries evicted by capacity would otherwise pile up until their expiry.
                self._expiry = [(e, i) for i, (_, e) in self._seen.items()]
                heapq.heapify(self._expiry)

    def _drop_expired(self, now_ms: int) -> None:
        while self._expiry and self._expiry[0][0] + self._skew_ms < now_ms:
            exp, ident = heapq.heappop(self._expiry)
            entry = self._seen.get(ident)
            if entry is not None and entry[1] == exp:
                del self._seen[ident]


# --- key files ---------------------------------------------------------------------------------


def _read_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"no signing key at {path}: run `trainguard keys init`") from None
    except OSError as exc:
        raise ConfigError(f"signing key {path}: {exc.strerror}") from None
    if os.name == "posix" and st.st_mode & 0o077:
        raise ConfigError(
            f"signing key {path} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"run `chmod 600 {path}` (and check who may have copied it)"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"signing key {path} is not an unencrypted PEM private key: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"signing key {path}: {exc.strerror}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {path} is a {type(key).__name__}, not an Ed25519 key")
    return key


def _parse_public(principal: str, public_key_b64: str) -> TrustedKey:
    _check_principal(principal)
    try:
        raw = base64.b64decode(public_key_b64.strip(), validate=True)
    except (ValueError, TypeError):
        raise ConfigError(f"public key {public_key_b64[:60]!r} is not base64") from None
    if len(raw) != _PUB_LEN:
        raise ConfigError(f"public key is {len(raw)} bytes, an Ed25519 public key is {_PUB_LEN}")
    return TrustedKey(Ed25519PublicKey.from_public_bytes(raw), principal, key_id(raw))


def load_trusted(path: Path) -> dict[str, TrustedKey]:
    """The trusted keys of a ``trusted.yaml`` (``kid: {principal, public_key: <base64 raw>}``)."""
    import yaml

    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"trusted keys {path}: {exc.strerror}") from None
    if os.name == "posix" and st.st_mode & 0o002:
        # Whoever can add a line here can sign anything.
        raise ConfigError(f"trusted keys {path} are writable by anyone: run `chmod 644 {path}`")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"trusted keys {path} are not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"trusted keys {path}: expected a mapping of key id -> {{principal, public_key}}")
    out: dict[str, TrustedKey] = {}
    for kid, entry in data.items():
        if not isinstance(entry, dict) or set(entry) != {"principal", "public_key"}:
            raise ConfigError(f"trusted keys {path}: {kid}: expected {{principal, public_key}}")
        try:
            tk = _parse_public(str(entry["principal"]), str(entry["public_key"]))
        except ConfigError as exc:
            raise ConfigError(f"trusted keys {path}: {kid}: {exc}") from None
        if tk.kid != str(kid):
            # A kid is derived from its key: a mismatch is a hand edit gone wrong.
            raise ConfigError(f"trusted keys {path}: {kid}: the key's id is {tk.kid}")
        out[tk.kid] = tk
    return out


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_trusted(path: Path, trusted: Mapping[str, TrustedKey]) -> None:
    import yaml

    body = {
        kid: {
            "principal": tk.principal,
            "public_key": base64.b64encode(_public_raw(tk.public_key)).decode(),
        }
        for kid, tk in sorted(trusted.items(), key=lambda kv: (kv[1].principal, kv[0]))
    }
    head = (
        "# TrainGuard trusted signing keys: key id -> principal and base64 raw Ed25519 public key.\n"
        "# Managed by `trainguard keys init|trust|revoke`; an old key stays trusted until revoked.\n"
    )
    text = head + (yaml.safe_dump(body, sort_keys=False) if body else "{}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, text.encode(), 0o644)


def _trusted_file(keys_dir_or_file: Path | str) -> Path:
    p = Path(keys_dir_or_file).expanduser()
    return p / TRUSTED_FILE if p.is_dir() else p


def init_keys(keys_dir: Path, principals: Iterable[str] = PRINCIPALS, force: bool = False) -> dict[str, str]:
    """Create the missing private keys of ``principals`` under ``keys_dir`` (``force``: new ones) and
    rewrite ``trusted.yaml`` with every key in the directory plus the entries it already had (a
    replaced key stays trusted until revoked).  Idempotent; returns principal -> key id."""
    wanted = list(dict.fromkeys(principals))
    for p in wanted:
        _check_principal(p)
    keys_dir = Path(keys_dir).expanduser()
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)  # an existing directory too: it holds private keys
    for p in wanted:
        path = keys_dir / f"{p}.key"
        if path.exists() and not force:
            continue
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_atomic(path, pem, 0o600)
    tfile = keys_dir / TRUSTED_FILE
    trusted = load_trusted(tfile) if tfile.exists() else {}
    kids: dict[str, str] = {}
    for path in sorted(keys_dir.glob("*.key")):
        if path.stem not in ROLE_TOPICS:
            continue
        pub = _read_private_key(path).public_key()
        kid = key_id(_public_raw(pub))
        trusted[kid] = TrustedKey(pub, path.stem, kid)
        kids[path.stem] = kid
    _write_trusted(tfile, trusted)
    return {p: kids[p] for p in wanted}


def add_trusted(keys_dir_or_file: Path | str, principal: str, public_key_b64: str) -> str:
    """Trust one more public key (rotation, or another site's key); returns its key id."""
    path = _trusted_file(keys_dir_or_file)
    trusted = load_trusted(path) if path.exists() else {}
    tk = _parse_public(principal, public_key_b64)
    old = trusted.get(tk.kid)
    if old is not None and old.principal != principal:
        raise ConfigError(f"key {tk.kid} is already trusted as principal {old.principal}; revoke it first")
    trusted[tk.kid] = tk
    _write_trusted(path, trusted)
    return tk.kid


def remove_trusted(keys_dir_or_file: Path | str, kid: str) -> TrustedKey:
    """Stop trusting key ``kid`` (its records fail from the next start of each consumer); returns it."""
    path = _trusted_file(keys_dir_or_file)
    trusted = load_trusted(path) if path.exists() else {}
    if kid not in trusted:
        raise ConfigError(f"key id {kid!r} is not trusted in {path}")
    removed = trusted.pop(kid)
    _write_trusted(path, trusted)
    return removed


def public_key_b64(keys_dir: Path, principal: str) -> str:
    """The base64 raw public key of ``keys_dir/<principal>.key``."""
    _check_principal(principal)
    private = _read_private_key(Path(keys_dir).expanduser() / f"{principal}.key")
    return base64.b64encode(_public_raw(private.public_key())).decode()
