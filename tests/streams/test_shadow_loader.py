"""The shadow loader on real multi-worker DataLoaders: the same batches as a plain loader at the
same data position, a hung or dead worker taken over in place (same stream, no batch skipped or
repeated), a checkpoint after a takeover resuming exactly, and the limits (giving up, a dataset's
own error, the arguments it owns)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.schemas.config import ConfigError, load_config
from trainguard.streams.data_position import DataPosition, ResumableSampler, SeededSamples
from trainguard.streams.shadow_loader import LINE_PREFIX, LoaderEvent, ShadowLoader, ShadowLoaderConfig

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

#: Real DataLoader worker processes, hung and killed on purpose: minutes on a busy host, not the
#: quick tier (docs/testing.md).
pytestmark = pytest.mark.integration

N = 30  # 8 batches of 4 per epoch, the last one of 2
BATCH = 4
FAST = ShadowLoaderConfig(takeover_after_s=0.5, first_batch_s=60.0)


class Flaky(Dataset[Any]):
    """Item i: (i, a torch draw); a file ``<faults>/hang-<i>`` or ``die-<i>``, claimed by the
    first worker that reads item i (renamed, with its pid), hangs or kills that worker."""

    def __init__(self, faults: Path) -> None:
        self.faults = faults

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Any:
        for kind in ("hang", "die", "error"):
            flag = self.faults / f"{kind}-{i}"
            claimed = self.faults / f"{kind}-{i}.claimed.{os.getpid()}"
            try:
                flag.rename(claimed)
            except FileNotFoundError:
                continue
            if kind == "hang":
                while True:
                    time.sleep(0.2)
            if kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyError(f"sample {i} is corrupt")
        return torch.tensor([float(i), float(torch.rand(()))], dtype=torch.float64)


def _digest(batch: Any) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]


def _position(epoch: int = 0, offset: int = 0) -> DataPosition:
    sampler = ResumableSampler(N, seed=99)
    position = DataPosition(sampler, torch.Generator())
    sampler.epoch, sampler.offset = epoch, offset
    return position


def _reference(faults: Path, count: int) -> list[str]:
    """``count`` batches from a plain loader at the start: what every run must read."""
    position = _position()
    loader = DataLoader(SeededSamples(Flaky(faults)), batch_size=BATCH, sampler=position.sampler,
                        num_workers=2, generator=position.generator)  # fmt: skip
    return [_digest(b) for _, b in zip(range(count), position.batches(loader), strict=False)]


def _take(batches: Iterator[Any], count: int) -> list[str]:
    return [_digest(b) for _, b in zip(range(count), batches, strict=False)]


def _shadow(
    faults: Path, position: DataPosition, config: ShadowLoaderConfig = FAST, **kw: Any
) -> ShadowLoader:
    return ShadowLoader(Flaky(faults), position, {"batch_size": BATCH, "num_workers": 2}, config, **kw)


def _dead(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_reads_what_a_plain_loader_reads(tmp_path: Path) -> None:
    want = _reference(tmp_path, 20)  # two epochs and a half
    shadow = _shadow(tmp_path, _position())
    try:
        assert _take(shadow.batches(), 20) == want
    finally:
        shadow.close()
    assert shadow.events == [] and shadow.lanes_started == 2
    assert shadow.last_wait_s < 5


def test_drop_last_across_epochs_and_a_checkpoint_at_an_epochs_tail(tmp_path: Path) -> None:
    """With ``drop_last`` each epoch's short tail (2 of 30 samples) is dropped, as a plain loader
    drops it; the lane's workers read on into the next epoch without a restart, and a position
    saved after an epoch's last full batch resumes, on a plain loader, at the next epoch."""
    position = _position()
    plain = DataLoader(SeededSamples(Flaky(tmp_path)), batch_size=BATCH, sampler=position.sampler,
                       num_workers=2, generator=position.generator, drop_last=True)  # fmt: skip
    want = _take(position.batches(plain), 22)  # 7 full batches per epoch: three epochs and a bit
    shadow_position = _position()
    shadow = ShadowLoader(Flaky(tmp_path), shadow_position, {"batch_size": BATCH, "num_workers": 2,
                          "drop_last": True}, FAST)  # fmt: skip
    batches = shadow.batches()
    got = _take(batches, 7)
    state = shadow_position.state_dict()
    assert (state["epoch"], state["offset"], state["consumed"]) == (0, 28, 28)
    got += _take(batches, 15)
    shadow.close()
    assert got == want
    resumed = _position()
    resumed.load_state_dict(state)
    loader = DataLoader(SeededSamples(Flaky(tmp_path)), batch_size=BATCH, sampler=resumed.sampler,
                        num_workers=2, generator=resumed.generator, drop_last=True)  # fmt: skip
    assert _take(resumed.batches(loader), 15) == want[7:]


def test_hung_worker_is_taken_over_in_place_on_the_same_stream(tmp_path: Path) -> None:
    want = _reference(tmp_path, 24)
    (tmp_path / "hang-7").touch()  # read in the middle of epoch 0 or 1 (the order is shuffled)
    seen: list[LoaderEvent] = []
    position = _position()
    shadow = _shadow(tmp_path, position, on_event=seen.append)
    batches = shadow.batches()
    got = _take(batches, 13)
    state = position.state_dict()  # a checkpoint after the takeover
    got += _take(batches, 11)
    shadow.close()
    assert got == want  # nothing skipped, nothing repeated, the same draws
    assert [e.kind for e in seen] == ["takeover"], [e.line() for e in seen]
    event = seen[0]
    assert event.reason == "stalled" and event.from_lane == 1 and event.to_lane == 2
    assert 0.5 <= event.stalled_s < 5 and event.takeover_s < 1.0
    assert event.line().startswith(f"{LINE_PREFIX} took over from loader 1 (stalled: no batch for ")
    assert shadow.lanes_started == 3  # a new standby replaced the one that took over
    (claimed,) = tmp_path.glob("hang-7.claimed.*")
    assert _dead(int(claimed.name.rsplit(".", 1)[1]))  # the hung worker was killed
    # The checkpoint taken after the takeover resumes exactly, on a plain loader.
    resumed = _position()
    resumed.load_state_dict(state)
    loader = DataLoader(SeededSamples(Flaky(tmp_path)), batch_size=BATCH, sampler=resumed.sampler,
                        num_workers=2, generator=resumed.generator)  # fmt: skip
    assert _take(resumed.batches(loader), 11) == want[13:]


def test_dead_worker_is_taken_over(tmp_path: Path) -> None:
    """The worker dies by SIGKILL while the loop may be anywhere: ``_reference`` made a loader in
    this (main) thread first, so torch's SIGCHLD handler is installed -- it must not raise in the
    loop for a lane's worker."""
    want = _reference(tmp_path, 12)
    (tmp_path / "die-3").touch()
    shadow = _shadow(tmp_path, _position())
    try:
        got = _take(shadow.batches(), 12)
    finally:
        shadow.close()
    assert got == want
    assert [(e.kind, e.reason) for e in shadow.events] == [("takeover", "died")]


def test_two_hangs_two_takeovers(tmp_path: Path) -> None:
    want = _reference(tmp_path, 16)
    (tmp_path / "hang-2").touch()
    (tmp_path / "hang-20").touch()
    shadow = _shadow(tmp_path, _position())
    try:
        got = _take(shadow.batches(), 16)
    finally:
        shadow.close()
    assert got == want
    assert [e.kind for e in shadow.events] == ["takeover", "takeover"]
    assert [(e.from_lane, e.to_lane) for e in shadow.events] == [(1, 2), (2, 3)]
    # Both samples may fall in one batch: the standby that took over then hangs on the second
    # before its first batch, and says so.
    first = shadow.events[0]
    assert first.failed == (first.consumed == shadow.events[1].consumed), first.line()


def test_gives_up_past_max_takeovers_then_waits_like_a_plain_loader(tmp_path: Path) -> None:
    (tmp_path / "hang-2").touch()
    (tmp_path / "hang-20").touch()
    config = ShadowLoaderConfig(takeover_after_s=0.5, max_takeovers=1)
    shadow = _shadow(tmp_path, _position(), config)
    batches = shadow.batches()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(len(_take(batches, 16)))
        except RuntimeError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and [e.kind for e in shadow.events] != ["takeover", "gave_up"]:
        time.sleep(0.1)
    assert [e.kind for e in shadow.events] == ["takeover", "gave_up"]
    assert "the data source or the machine is failing" in shadow.events[1].line()
    time.sleep(1.5)
    assert outcome == [] and reader.is_alive()  # waiting on the hung loader: a hang, for TrainGuard
    # Its worker dies (the machine's OOM killer, an operator): the loader's own error, raised.
    for claimed in tmp_path.glob("hang-*.claimed.*"):
        with contextlib.suppress(ProcessLookupError):  # the first one: killed by the takeover
            os.kill(int(claimed.name.rsplit(".", 1)[1]), signal.SIGKILL)
    reader.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert str(outcome[0]).startswith("DataLoader worker (pid")
    shadow.close()


def test_a_datasets_own_error_is_raised_not_taken_over(tmp_path: Path) -> None:
    (tmp_path / "error-5").touch()
    shadow = _shadow(tmp_path, _position())
    with pytest.raises(KeyError, match="sample 5 is corrupt"):
        _take(shadow.batches(), 16)
    assert shadow.events == []


def test_threshold_follows_the_loaders_own_waits() -> None:
    shadow = ShadowLoader(Flaky(Path("/nonexistent")), _position(), {"batch_size": 2, "num_workers": 1},
                          ShadowLoaderConfig(takeover_after_s=1.0, wait_factor=4.0, first_batch_s=30.0))  # fmt: skip
    assert shadow._threshold() == 30.0  # the first lane's first batch: its workers start cold
    shadow._cold = False
    assert shadow._threshold() == 1.0
    shadow._waits.extend([0.01] * 50 + [0.6] * 2)  # a loader that often makes the loop wait 0.6 s
    assert shadow._threshold() == pytest.approx(2.4)
    shadow._gave_up = True
    assert shadow._threshold() is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"batch_size": 4, "num_workers": 2, "sampler": [1]}, "sets sampler itself"),
        ({"batch_size": 4, "num_workers": 2, "persistent_workers": False}, "sets persistent_workers"),
        ({"batch_size": 4, "num_workers": 0}, "num_workers >= 1"),
        ({"num_workers": 2}, "batch_size >= 1"),
    ],
)
def test_arguments_it_owns_or_needs(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShadowLoader(Flaky(Path("/nonexistent")), _position(), args)


def test_config_rejects_unknown_keys() -> None:
    assert load_config(ShadowLoaderConfig, {"takeover_after_s": 2}).takeover_after_s == 2
    with pytest.raises(ConfigError, match="unknown field"):
        load_config(ShadowLoaderConfig, {"takeover_after": 2})


def test_event_lines_are_the_rule_tables() -> None:
    from trainguard.detectors.rule_table import default_rule_table

    table = default_rule_table()
    takeover = LoaderEvent("takeover", "stalled", stalled_s=1.02, threshold_s=1.0, takeover_s=0.04,
                           from_lane=1, to_lane=2, epoch=3, offset=120, consumed=9000)  # fmt: skip
    gave_up = LoaderEvent("gave_up", "stalled", stalled_s=1.0, from_lane=4, takeovers=3)
    failed = LoaderEvent("standby_failed", "OSError: [Errno 24] Too many open files", to_lane=5)
    for event, rule in ((takeover, "shadow-loader-takeover"), (gave_up, "shadow-loader-gave-up"),
                        (failed, "shadow-loader-standby-failed")):  # fmt: skip
        match = table.match_line(event.line())
        assert match is not None and match.rule.id == rule, event.line()
