"""trainguard.infra.signing: signature headers of control-plane records, verification reasons, the replay
window, key files and rotation, and the ``trainguard keys`` CLI.  Pure: no broker, tmp_path only."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from trainguard.commands.keys import keys as keys_cli
from trainguard.infra.signing import (
    COMMANDS,
    CONTROL,
    DECISIONS,
    H_EXP,
    H_IAT,
    H_KID,
    H_SIG,
    JOBS,
    PRINCIPALS,
    ROLE_TOPICS,
    SIGNED_TOPICS,
    AuthError,
    Signer,
    SigningConfig,
    TrustedKey,
    Verifier,
    add_trusted,
    init_keys,
    key_id,
    load_trusted,
    remove_trusted,
)
from trainguard.schemas import topics
from trainguard.schemas.config import ConfigError, load_config

NOW = 1_750_000_000_000
CFG = SigningConfig()
KEY, VALUE = b"job-7", b'{"kind": "evict", "machines": ["n3"]}'


@pytest.fixture(scope="module")
def keyset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("home")
    init_keys(home / "keys")
    return home


def signer(home: Path, principal: str, cfg: SigningConfig = CFG) -> Signer:
    return Signer.load(cfg, home, principal)


def verifier(home: Path, cfg: SigningConfig = CFG) -> Verifier:
    return Verifier.load(cfg, home)


def test_signed_topics_are_the_registry_names() -> None:
    assert {
        topics.DECISIONS.name,
        topics.JOBS.name,
        topics.COMMANDS.name,
        topics.CONTROL.name,
        topics.DETECTIONS.name,
        topics.ACTIONS.name,
    } == SIGNED_TOPICS
    assert all(ROLE_TOPICS[p] <= SIGNED_TOPICS for p in PRINCIPALS)
    assert ROLE_TOPICS["operator"] == SIGNED_TOPICS


@pytest.mark.parametrize(("principal", "topic"), [(p, t) for p in PRINCIPALS for t in sorted(ROLE_TOPICS[p])])
def test_round_trip_for_every_principal_and_topic_it_may_sign(
    keyset: Path, principal: str, topic: str
) -> None:
    s = signer(keyset, principal)
    headers = s.headers(topic, KEY, VALUE, now_ms=NOW)
    assert [name for name, _ in headers] == [H_KID, H_IAT, H_EXP, H_SIG]
    assert all(isinstance(v, bytes) for _, v in headers)
    h = dict(headers)
    assert h[H_KID].decode() == s.kid and h[H_IAT] == str(NOW).encode() and len(h[H_SIG]) == 64
    assert verifier(keyset).verify(topic, KEY, VALUE, headers, NOW + 1000, where=(topic, 0, 5)) == principal


@pytest.mark.parametrize(
    ("principal", "topic"), [(p, t) for p in PRINCIPALS for t in sorted(SIGNED_TOPICS - ROLE_TOPICS[p])]
)
def test_a_principal_may_not_sign_other_topics(keyset: Path, principal: str, topic: str) -> None:
    with pytest.raises(
        AuthError, match=rf"principal {principal} may not sign topic {topic}.*bug in the caller"
    ):
        signer(keyset, principal).headers(topic, KEY, VALUE, now_ms=NOW)


def test_verifier_refuses_a_principal_outside_its_topics(keyset: Path, tmp_path: Path) -> None:
    # A worker key (trusted) that produces a job spec: signed correctly, but not allowed.
    worker = signer(keyset, "worker")
    forged = Signer(worker.private_key, worker.kid, "operator", CFG)
    headers = forged.headers(JOBS, KEY, VALUE, now_ms=NOW)
    with pytest.raises(AuthError, match=f"key of principal worker may not sign topic {JOBS}"):
        verifier(keyset).verify(JOBS, KEY, VALUE, headers, NOW)


def test_unsigned_records_and_tombstones(keyset: Path) -> None:
    v = verifier(keyset)
    for headers in (None, [], [("trace-id", b"abc")], {}):
        with pytest.raises(AuthError, match=f"unsigned record on {DECISIONS}"):
            v.verify(DECISIONS, KEY, VALUE, headers, NOW)
    with pytest.raises(AuthError, match="unsigned tombstone"):
        v.verify(JOBS, KEY, None, None, NOW)
    # A signed tombstone verifies, and is not the same record as an empty value.
    headers = signer(keyset, "actions").headers(JOBS, KEY, None, now_ms=NOW)
    assert v.verify(JOBS, KEY, None, headers, NOW) == "actions"
    with pytest.raises(AuthError, match="bad signature"):
        v.verify(JOBS, KEY, b"", headers, NOW)


def test_missing_or_duplicated_signature_headers(keyset: Path) -> None:
    headers = signer(keyset, "worker").headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    v = verifier(keyset)
    with pytest.raises(AuthError, match=rf"missing header\(s\) {H_EXP}"):
        v.verify(DECISIONS, KEY, VALUE, [h for h in headers if h[0] != H_EXP], NOW)
    with pytest.raises(AuthError, match=f"header {H_SIG} appears twice"):
        v.verify(DECISIONS, KEY, VALUE, [*headers, headers[-1]], NOW)
    bad_iat = [(n, b"soon" if n == H_IAT else val) for n, val in headers]
    with pytest.raises(AuthError, match=f"header {H_IAT} is not a time"):
        v.verify(DECISIONS, KEY, VALUE, bad_iat, NOW)


def test_unknown_key_id(keyset: Path) -> None:
    other = Ed25519PrivateKey.generate()
    s = Signer(other, "0123456789abcdef", "worker", CFG)
    with pytest.raises(AuthError, match="unknown key id '0123456789abcdef'"):
        verifier(keyset).verify(DECISIONS, KEY, VALUE, s.headers(DECISIONS, KEY, VALUE, now_ms=NOW), NOW)


def test_wrong_key_under_a_trusted_key_id(keyset: Path) -> None:
    # An attacker's key claiming the worker's key id: the signature does not check.
    worker = signer(keyset, "worker")
    impostor = Signer(Ed25519PrivateKey.generate(), worker.kid, "worker", CFG)
    headers = impostor.headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    with pytest.raises(AuthError, match=rf"bad signature \(key id {worker.kid}, principal worker\)"):
        verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, NOW)


@pytest.mark.parametrize("part", ["topic", "key", "value", "none-key", H_KID, H_IAT, H_EXP, H_SIG])
def test_tampering_breaks_the_signature(keyset: Path, part: str) -> None:
    headers = dict(signer(keyset, "operator").headers(DECISIONS, KEY, VALUE, now_ms=NOW))
    topic, key, value = DECISIONS, KEY, VALUE
    reason = "bad signature"
    if part == "topic":
        topic = COMMANDS  # the operator may sign it: only the signature can tell
    elif part == "key":
        key = b"job-8"
    elif part == "none-key":
        key = None
    elif part == "value":
        value = VALUE.replace(b"n3", b"n4")
    elif part == H_KID:
        headers[H_KID] = signer(keyset, "worker").kid.encode()  # another trusted key
        reason = "bad signature .*principal worker"
    elif part in (H_IAT, H_EXP):
        headers[part] = str(int(headers[part]) + 1).encode()
    else:
        headers[H_SIG] = bytes([headers[H_SIG][0] ^ 1]) + headers[H_SIG][1:]
    with pytest.raises(AuthError, match=reason):
        verifier(keyset).verify(topic, key, value, list(headers.items()), NOW)


def test_key_and_value_bytes_cannot_move_across_their_boundary(keyset: Path) -> None:
    headers = signer(keyset, "worker").headers(DECISIONS, b"a\0b", b"c", now_ms=NOW)
    with pytest.raises(AuthError, match="bad signature"):
        verifier(keyset).verify(DECISIONS, b"a", b"b\0c", headers, NOW)


def test_expiry_and_future_issue_with_clock_skew(keyset: Path) -> None:
    headers = signer(keyset, "worker").headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    exp = NOW + 900_000
    skew = 60_000
    assert verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, exp + skew) == "worker"
    with pytest.raises(AuthError, match="expired at 2025-06-15T15:21:40Z"):
        verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, exp + skew + 1)
    assert verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, NOW - skew) == "worker"
    with pytest.raises(AuthError, match=r"issued in the future at .*allowed clock skew 60s"):
        verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, NOW - skew - 1)


def test_state_topics_live_longer_than_acted_on_topics(keyset: Path) -> None:
    cfg = SigningConfig(act_ttl_s=10, state_ttl_s=3600)
    ops = signer(keyset, "operator", cfg)
    for topic, ttl_ms in ((DECISIONS, 10_000), (COMMANDS, 10_000), (JOBS, 3_600_000), (CONTROL, 3_600_000)):
        h = dict(ops.headers(topic, KEY, VALUE, now_ms=NOW))
        assert int(h[H_EXP]) - int(h[H_IAT]) == ttl_ms, topic
    default = dict(signer(keyset, "actions").headers(JOBS, KEY, VALUE, now_ms=NOW))
    assert int(default[H_EXP]) - NOW == 400 * 86400 * 1000
    # A job spec signed long ago still verifies when the jobs topic is re-read from its start.
    old = signer(keyset, "actions").headers(JOBS, KEY, VALUE, now_ms=NOW)
    assert verifier(keyset).verify(JOBS, KEY, VALUE, old, NOW + 200 * 86400 * 1000) == "actions"


def test_namespaced_twins_sign_like_their_live_topic(keyset: Path) -> None:
    shadow = topics.namespaced(DECISIONS, "shadow")
    headers = signer(keyset, "worker").headers(shadow, KEY, VALUE, now_ms=NOW)
    assert verifier(keyset).verify(shadow, KEY, VALUE, headers, NOW) == "worker"
    with pytest.raises(AuthError, match="bad signature"):  # not movable to the live topic
        verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, NOW)
    with pytest.raises(AuthError, match="may not sign"):
        signer(keyset, "worker").headers(topics.namespaced(JOBS, "shadow"), KEY, VALUE, now_ms=NOW)


def test_replay_at_other_coordinates_is_refused_redelivery_accepted(keyset: Path) -> None:
    headers = signer(keyset, "worker").headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    v = verifier(keyset)
    assert v.verify(DECISIONS, KEY, VALUE, headers, NOW, where=(DECISIONS, 2, 15)) == "worker"
    # A redelivery after a crash or a seek back: same coordinates, accepted again (list shape too).
    assert v.verify(DECISIONS, KEY, VALUE, headers, NOW + 5, where=(DECISIONS, 2, 15)) == "worker"
    assert v.verify(DECISIONS, KEY, VALUE, headers, NOW + 5, where=[DECISIONS, 2, 15]) == "worker"  # type: ignore[arg-type]
    with pytest.raises(AuthError, match=rf"replayed \(first seen at {DECISIONS}\[2\]@15\)"):
        v.verify(DECISIONS, KEY, VALUE, headers, NOW + 10, where=(DECISIONS, 2, 99))
    with pytest.raises(AuthError, match="replayed"):
        v.verify(DECISIONS, KEY, VALUE, headers, NOW + 10)


def test_without_coordinates_a_second_sighting_is_a_replay(keyset: Path) -> None:
    headers = signer(keyset, "worker").headers(COMMANDS, b"n3", VALUE, now_ms=NOW)
    v = verifier(keyset)
    assert v.verify(COMMANDS, b"n3", VALUE, headers, NOW) == "worker"
    with pytest.raises(AuthError, match=r"replayed \(first seen at a record without coordinates\)"):
        v.verify(COMMANDS, b"n3", VALUE, headers, NOW)
    with pytest.raises(AuthError, match="replayed"):
        v.verify(COMMANDS, b"n3", VALUE, headers, NOW, where=(COMMANDS, 0, 1))


def test_seen_window_is_bounded_and_forgets_expired_entries(keyset: Path) -> None:
    s = signer(keyset, "worker", SigningConfig(act_ttl_s=10))
    v = verifier(keyset, SigningConfig(seen_capacity=3))
    records = [s.headers(DECISIONS, KEY, b"v%d" % i, now_ms=NOW + i) for i in range(5)]
    for i, h in enumerate(records):
        v.verify(DECISIONS, KEY, b"v%d" % i, h, NOW + 10, where=(DECISIONS, 0, i))
        assert v.seen_size <= 3
    # The oldest fell out of the window: a copy elsewhere is no longer recognised (the bound's price).
    assert v.verify(DECISIONS, KEY, b"v0", records[0], NOW + 20, where=(DECISIONS, 1, 0)) == "worker"
    with pytest.raises(AuthError, match="replayed"):  # the newest is still remembered
        v.verify(DECISIONS, KEY, b"v4", records[4], NOW + 20, where=(DECISIONS, 1, 4))
    # Once past expiry (+ skew) every entry is dropped: such a record is refused as expired anyway.
    v.verify(DECISIONS, KEY, b"late", s.headers(DECISIONS, KEY, b"late", now_ms=NOW + 80_000), NOW + 80_000)
    assert v.seen_size == 1
    with pytest.raises(AuthError, match="expired"):
        v.verify(DECISIONS, KEY, b"v4", records[4], NOW + 80_000, where=(DECISIONS, 1, 4))


def test_expiry_heap_stays_bounded_under_capacity_evictions(keyset: Path) -> None:
    s = signer(keyset, "actions")  # state TTL: nothing expires during the test
    v = verifier(keyset, SigningConfig(seen_capacity=2))
    for i in range(3000):
        v.verify(JOBS, KEY, b"%d" % i, s.headers(JOBS, KEY, b"%d" % i, now_ms=NOW), NOW, where=(JOBS, 0, i))
    assert v.seen_size == 2
    assert len(v._expiry) <= 2 * 2 + 1024


@pytest.mark.parametrize("shape", ["kafka-python", "aiokafka", "faust-dict", "faust-list", "bytes-names"])
def test_headers_in_every_client_shape(keyset: Path, shape: str) -> None:
    raw = signer(keyset, "worker").headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    extra = [("trace-id", b"t1")]
    headers: object = {
        "kafka-python": extra + raw,  # list of (str, bytes)
        "aiokafka": tuple(extra + raw),  # tuple of (str, bytes)
        "faust-dict": dict(extra + raw),
        "faust-list": [list(p) for p in extra + raw],
        "bytes-names": [(n.encode(), val) for n, val in extra + raw],
    }[shape]
    assert verifier(keyset).verify(DECISIONS, KEY, VALUE, headers, NOW) == "worker"  # type: ignore[arg-type]


def test_key_files_modes_and_idempotent_init(tmp_path: Path) -> None:
    kdir = tmp_path / "home" / "keys"
    kids = init_keys(kdir)
    assert set(kids) == set(PRINCIPALS)
    assert stat.S_IMODE(kdir.stat().st_mode) == 0o700
    for p in PRINCIPALS:
        assert stat.S_IMODE((kdir / f"{p}.key").stat().st_mode) == 0o600
        assert (kdir / f"{p}.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    before = {p: (kdir / f"{p}.key").read_bytes() for p in PRINCIPALS}
    assert init_keys(kdir) == kids  # idempotent: nothing replaced
    assert {p: (kdir / f"{p}.key").read_bytes() for p in PRINCIPALS} == before
    trusted = load_trusted(kdir / "trusted.yaml")
    assert {k: t.principal for k, t in trusted.items()} == {kid: p for p, kid in kids.items()}
    doc = yaml.safe_load((kdir / "trusted.yaml").read_text())
    for kid, entry in doc.items():
        assert key_id(base64.b64decode(entry["public_key"])) == kid
    assert init_keys(kdir, ["worker"]) == {"worker": kids["worker"]}
    with pytest.raises(ConfigError, match="unknown principal 'root'"):
        init_keys(kdir, ["root"])


def test_signer_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no signing key at .*worker\.key: run `trainguard keys init`"):
        Signer.load(CFG, tmp_path, "worker")
    kdir = tmp_path / "keys"
    init_keys(kdir, ["worker"])
    os.chmod(kdir / "worker.key", 0o640)
    with pytest.raises(ConfigError, match=r"accessible by group/others \(mode 0640\).*chmod 600"):
        Signer.load(CFG, tmp_path, "worker")
    os.chmod(kdir / "worker.key", 0o600)
    assert Signer.load(CFG, tmp_path, "worker").principal == "worker"
    # cfg.principal and cfg.key_file override the component's choice and the directory.
    explicit = SigningConfig(principal="worker", key_file=str(kdir / "worker.key"))
    assert Signer.load(explicit, tmp_path / "elsewhere", "actions").principal == "worker"
    with pytest.raises(ConfigError, match=r"no trusted keys at .*elsewhere/keys/trusted.yaml"):
        Verifier.load(CFG, tmp_path / "elsewhere")
    (kdir / "bad.yaml").write_text("abc: {principal: worker, public_key: AAAA}\n")
    with pytest.raises(ConfigError, match="abc: public key is 3 bytes"):
        Verifier.load(SigningConfig(trusted_file=str(kdir / "bad.yaml")), tmp_path)


def test_rotation_trust_a_second_key_then_revoke_the_first(tmp_path: Path) -> None:
    kdir = tmp_path / "keys"
    old_kid = init_keys(kdir, ["worker"])["worker"]
    old = Signer.load(CFG, tmp_path, "worker")
    old_h = old.headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    # Replace the key: the old public key stays trusted until revoked.
    new_kid = init_keys(kdir, ["worker"], force=True)["worker"]
    assert new_kid != old_kid
    new_h = Signer.load(CFG, tmp_path, "worker").headers(DECISIONS, KEY, VALUE, now_ms=NOW)
    v = Verifier.load(CFG, tmp_path)
    assert (
        v.verify(DECISIONS, KEY, VALUE, old_h, NOW) == v.verify(DECISIONS, KEY, VALUE, new_h, NOW) == "worker"
    )
    assert remove_trusted(kdir, old_kid).principal == "worker"
    v = Verifier.load(CFG, tmp_path)
    assert v.verify(DECISIONS, KEY, VALUE, new_h, NOW) == "worker"
    with pytest.raises(AuthError, match="unknown key id"):
        v.verify(DECISIONS, KEY, VALUE, old_h, NOW)
    assert old_kid not in load_trusted(kdir / "trusted.yaml")
    init_keys(kdir, ["worker"])  # a later init does not bring the revoked key back
    assert old_kid not in load_trusted(kdir / "trusted.yaml")
    with pytest.raises(ConfigError, match="is not trusted"):
        remove_trusted(kdir, old_kid)


def test_trust_another_sites_key(tmp_path: Path) -> None:
    site_b = tmp_path / "b"
    init_keys(site_b / "keys", ["operator"])
    b_op = Signer.load(CFG, site_b, "operator")
    init_keys(tmp_path / "a" / "keys", ["worker"])
    kid = add_trusted(tmp_path / "a" / "keys", "operator", b_op.public_key_b64)
    assert kid == b_op.kid
    h = b_op.headers(CONTROL, b"job-1", VALUE, now_ms=NOW)
    assert Verifier.load(CFG, tmp_path / "a").verify(CONTROL, b"job-1", VALUE, h, NOW) == "operator"
    with pytest.raises(ConfigError, match="already trusted as principal operator"):
        add_trusted(tmp_path / "a" / "keys" / "trusted.yaml", "worker", b_op.public_key_b64)
    with pytest.raises(ConfigError, match="not base64"):
        add_trusted(tmp_path / "a" / "keys", "worker", "not base64!")


def test_verifier_from_trusted_keys_in_memory() -> None:
    key = Ed25519PrivateKey.generate()
    s = Signer(key, "k1", "operator", CFG)
    v = Verifier({"k1": TrustedKey(key.public_key(), "operator", "k1")}, CFG)
    assert v.verify(CONTROL, None, VALUE, s.headers(CONTROL, None, VALUE, now_ms=NOW), NOW) == "operator"


def test_config_section_loads_with_bounds() -> None:
    cfg = load_config(SigningConfig, {"enabled": False, "act_ttl_s": 60, "seen_capacity": 10})
    assert (cfg.enabled, cfg.act_ttl_s, cfg.seen_capacity) == (False, 60, 10)
    with pytest.raises(ConfigError, match="clock_skew_s"):
        load_config(SigningConfig, {"clock_skew_s": -1})
    with pytest.raises(ConfigError, match="unknown field"):
        load_config(SigningConfig, {"ttl": 1})


def test_cli_init_show_trust_revoke_export(tmp_path: Path) -> None:
    env = {"TRAINGUARD_HOME": str(tmp_path), "TRAINGUARD_CONFIG": ""}
    run = CliRunner().invoke
    res = run(keys_cli, ["init"], env=env)
    assert res.exit_code == 0, res.output
    kids = {line.split()[0]: line.split()[1] for line in res.output.splitlines() if "created" in line}
    assert set(kids) == set(PRINCIPALS)
    again = run(keys_cli, ["init", "--principal", "worker"], env=env)
    assert again.exit_code == 0 and f"worker    {kids['worker']}  exists" in again.output

    res = run(keys_cli, ["show"], env=env)
    assert res.exit_code == 0, res.output
    assert (
        f"{kids['worker']}  worker    control.commands, control.decisions, control.detections  (private key here)"
        in res.output
    )
    assert (
        f"{kids['actions']}  actions   control.actions, control.commands, control.decisions, control.jobs"
        in res.output
    )

    pub = run(keys_cli, ["export-public", "operator"], env=env)
    assert pub.exit_code == 0 and key_id(base64.b64decode(pub.output.strip())) == kids["operator"]

    other = Ed25519PrivateKey.generate()
    other_b64 = Signer(other, "x", "worker", CFG).public_key_b64
    res = run(keys_cli, ["trust", "--principal", "worker", "--public-key", other_b64], env=env)
    assert res.exit_code == 0, res.output
    other_kid = key_id(base64.b64decode(other_b64))
    assert other_kid in run(keys_cli, ["show"], env=env).output

    res = run(keys_cli, ["revoke", other_kid], env=env)
    assert res.exit_code == 0 and f"revoked {other_kid} (worker)" in res.output
    assert other_kid not in run(keys_cli, ["show"], env=env).output
    res = run(keys_cli, ["revoke", kids["worker"]], env=env)
    assert res.exit_code == 0 and "would trust it again" in res.output
    res = run(keys_cli, ["revoke", kids["worker"]], env=env)
    assert res.exit_code != 0 and "is not trusted" in res.output and "Traceback" not in res.output
    res = run(keys_cli, ["export-public", "worker"], env={**env, "TRAINGUARD_HOME": str(tmp_path / "none")})
    assert res.exit_code != 0 and "run `trainguard keys init`" in res.output


@pytest.mark.parametrize(
    ("principal", "topic", "allowed"),
    [
        # Who may write what the worker acts on (#38): a detection becomes a signed decision, an
        # action event says a recovery is running or held.
        ("worker", topics.DETECTIONS.name, True),
        ("actions", topics.DETECTIONS.name, False),
        ("launcher", topics.DETECTIONS.name, False),
        ("actions", topics.ACTIONS.name, True),
        ("worker", topics.ACTIONS.name, False),
        ("launcher", topics.ACTIONS.name, False),
        ("operator", topics.DETECTIONS.name, True),
        ("operator", topics.ACTIONS.name, True),
    ],
)
def test_detections_and_action_events_are_signed_by_their_role_only(
    principal: str, topic: str, allowed: bool
) -> None:
    assert (topic in ROLE_TOPICS[principal]) is allowed
    assert topic in SIGNED_TOPICS


def test_an_unsigned_detection_is_refused_and_action_events_outlive_the_act_lifetime() -> None:
    from trainguard.infra.signing import ACT_TOPICS, STATE_TOPICS

    assert topics.DETECTIONS.name in ACT_TOPICS  # evidence is acted on when read
    assert topics.ACTIONS.name in STATE_TOPICS  # a starting worker re-reads recoveries in flight
    private = Ed25519PrivateKey.generate()
    trusted = {"k": TrustedKey(private.public_key(), "worker", "k")}
    verifier = Verifier(trusted, SigningConfig())
    with pytest.raises(AuthError, match="unsigned record"):
        verifier.verify(topics.DETECTIONS.name, b"job", b"{}", None, 1_000)


def test_the_action_service_key_orders_only_the_agents_restarts() -> None:
    """The actions key may sign commands for the warm node agents, not an exporter's sampling or
    captures (a forged SET_INTERVAL under it was obeyed once: chaos forged_control)."""
    from trainguard.infra.signing import may_order, signer_principal

    assert may_order("actions", "agent_restart") and may_order("actions", "agent_code")
    assert not may_order("actions", "set_interval") and not may_order("actions", "capture_stacks")
    assert may_order("operator", "set_interval") and may_order("worker", "capture_stacks")
    key = Ed25519PrivateKey.generate()
    v = Verifier({"k1": TrustedKey(key.public_key(), "actions", "k1")}, CFG)
    assert signer_principal(v, [("tg-kid", b"k1")]) == "actions"
    assert signer_principal(v, [("tg-kid", b"other")]) == ""
    assert signer_principal(None, [("tg-kid", b"k1")]) == ""
