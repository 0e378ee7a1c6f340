"""The shadow loader: a warm standby DataLoader per rank that takes over a hung or dead one in place.

A DataLoader worker that hangs (a stuck read on a network filesystem, a deadlock in a decoding
library) or dies (killed, segfault) stops its rank, then the whole job at its next collective.
Without a standby, TrainGuard finds the hang from the stacks and evicts the rank's group: a job
restart from the checkpoint, tens of seconds at best.  OVERLORD's answer is a shadow loader: a
second loader kept ready that takes over when the active one stops, so the rank loses only the
stall itself.  :class:`ShadowLoader` is that, for a standard ``torch.utils.data.DataLoader``:

* **Two lanes.**  Each lane is a DataLoader with ``persistent_workers`` driven by a thread of its
  own.  The active lane serves batches; the standby lane's workers are started (forked, the
  dataset and ``worker_init_fn`` ready) and idle, with nothing to read.
* **Exact position.**  Both lanes read the same :class:`~trainguard.streams.data_position.DataPosition`:
  a lane's batch sampler is a *plan* -- the batches of ``(epoch seed, index)`` keys from the
  position on, epoch after epoch without end (each epoch's order, batched as a DataLoader with
  the same ``batch_size`` and ``drop_last`` would) -- and :class:`~trainguard.streams.data_position.
  SeededSamples` seeds each item from its key, so the standby produces, batch for batch, the
  samples the active lane would have (and a checkpoint taken after a takeover resumes exactly,
  on a plain loader too).  The position advances only by the batches handed to the training
  loop, so nothing the hung lane had prefetched is skipped or seen twice; and a lane's workers
  prefetch across epoch boundaries (a loader restarted per epoch made every rank wait for its
  first batch at once, a stall the hang detector saw).
* **Takeover.**  The training loop waits for each batch at most a threshold: the larger of
  ``takeover_after_s`` and ``wait_factor`` x the p99 of its recent waits (a loader that is always
  slow is not a hung one).  When the active lane passes it without a batch, or its workers die,
  the standby is pointed at the position and asked for the batch; the failed lane's workers are
  killed, and a new standby starts its workers in a thread of its own meanwhile.
* **Giving up.**  More than ``max_takeovers`` within ``takeover_window_s`` means the data source
  or the machine fails, not one loader: the shadow loader says so and stops taking over.  The rank
  then waits on its loader like any other (a hang TrainGuard localises from the stacks and
  evicts), or raises the loader's error if its workers died (a crash TrainGuard restarts).

Every takeover, give-up and failed standby start goes to ``on_event`` as a :class:`LoaderEvent`,
whose :meth:`LoaderEvent.line` is the log line TrainGuard's rule table knows
(``detectors/rules/training.yaml``: ``shadow-loader-*``); the training reporter sends it with
:meth:`trainguard.streams.reporter.Reporter.log`.  ``detectors/data_path.py`` holds the decision table.

Typical use::

    sampler = ResumableSampler(len(ds), seed=1234, rank=dp_rank, world_size=dp_size)
    position = DataPosition(sampler)
    loader = ShadowLoader(ds, position, {"batch_size": 8, "num_workers": 2},
                          on_event=lambda e: rep.log(e.line()))
    for batch in loader.batches():
        ...
        rep.step(step, loss=loss, data_wait_s=loader.last_wait_s)

Torch is imported only when the first lane is built (the product's services never load it).
Only DataLoader internals of the pinned torch are touched (``_workers``, ``_shutdown_workers``
and the SIGCHLD pid registry, to stop a hung lane's workers without waiting for them);
``tests/streams/test_shadow_loader.py`` exercises them on a real multi-worker loader.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainguard.schemas.typecheck import bounds
from trainguard.streams.data_position import DataPosition, SeededSamples

log = logging.getLogger(__name__)

#: the prefix of every line the shadow loader logs (the rule table matches on it).
LINE_PREFIX = "trainguard shadow loader:"
#: DataLoader arguments the shadow loader sets itself (``batch_size`` and ``drop_last`` it takes
#: and makes its lanes' plans with).
_OWN_ARGS = ("sampler", "batch_sampler", "shuffle", "persistent_workers", "timeout", "dataset")


@dataclass(frozen=True)
class ShadowLoaderConfig:
    """Settings of :class:`ShadowLoader` (``trainguard.schemas.config.load_config``: unknown keys are
    errors)."""

    #: the least a batch is waited for before the standby takes over.  Under the stall detector's
    #: ``min_stall_s``, so the job is stepping again before TrainGuard would call it hung.
    takeover_after_s: float = field(default=1.0, metadata=bounds(0.01, 1e6))
    #: ... or this many times the p99 of the recent waits, when that is longer: a loader that
    #: always makes the loop wait is slow (the slow-data detector's case), not hung.
    wait_factor: float = field(default=4.0, metadata=bounds(0.0, 1e6))
    #: recent waits kept for the p99.
    wait_window: int = field(default=200, metadata=bounds(1, 1_000_000))
    #: the first batch of the first lane (its workers start cold) is waited for this long.
    first_batch_s: float = field(default=300.0, metadata=bounds(0.01, 1e7))
    #: a takeover waits this long for a standby that is still starting its workers.
    arm_timeout_s: float = field(default=120.0, metadata=bounds(0.01, 1e7))
    #: more takeovers than this within ``takeover_window_s``: give up (the source is failing).
    max_takeovers: int = field(default=3, metadata=bounds(0, 1_000_000))
    takeover_window_s: float = field(default=600.0, metadata=bounds(0.0, 1e9))


@dataclass(frozen=True)
class LoaderEvent:
    """Something the shadow loader did: ``takeover``, ``gave_up`` or ``standby_failed``."""

    kind: str
    #: ``stalled`` (no batch within the threshold), ``died`` (its workers exited) or the error.
    reason: str
    #: how long the failed lane was waited for, and the threshold it passed (takeover, gave_up).
    stalled_s: float = 0.0
    threshold_s: float = 0.0
    #: from giving up on the failed lane to the batch in hand from the standby (takeover).
    takeover_s: float = 0.0
    from_lane: int = 0
    to_lane: int = 0
    #: the data position at the event: epoch, sample offset in it, samples consumed in all.
    epoch: int = 0
    offset: int = 0
    consumed: int = 0
    takeovers: int = 0
    #: a takeover whose standby failed too before its first batch (``takeover_s``: until then).
    failed: bool = False

    def line(self) -> str:
        """The log line (stable: TrainGuard's rule table parses it)."""
        at = f"at epoch {self.epoch} sample {self.offset} (consumed {self.consumed})"
        if self.kind == "takeover":
            return (
                f"{LINE_PREFIX} took over from loader {self.from_lane} ({self.reason}: no batch for "
                f"{self.stalled_s:.2f} s, threshold {self.threshold_s:.2f} s) with loader {self.to_lane} "
                f"in {self.takeover_s:.3f} s{', which failed too,' if self.failed else ''} {at}"
            )
        if self.kind == "gave_up":
            return (
                f"{LINE_PREFIX} gave up after {self.takeovers} takeovers: loader {self.from_lane} "
                f"{self.reason} (no batch for {self.stalled_s:.2f} s) {at}; the data source or the "
                "machine is failing, not one loader: waiting on it"
            )
        return f"{LINE_PREFIX} standby loader {self.to_lane} failed to start: {self.reason}"


Key = tuple[int, int]
#: one planned batch: its epoch, the epoch's offset after it, its keys.
Planned = tuple[int, int, list[Key]]


def plan(position: DataPosition, batch_size: int, drop_last: bool) -> Iterator[Planned]:
    """The batches from ``position`` on, epoch after epoch without end, as a DataLoader over the
    position's sampler would make them (``batch_size``, ``drop_last``: an epoch's short tail is
    dropped).  The position is read now; the plan does not follow it.

    >>> from trainguard.streams.data_position import ResumableSampler
    >>> p = DataPosition(ResumableSampler(5, shuffle=False))
    >>> p.sampler.offset = 2
    >>> batches = plan(p, 2, drop_last=True)
    >>> [(e, off, [i for _, i in keys]) for (e, off, keys), _ in zip(batches, range(4))]
    [(0, 4, [2, 3]), (1, 2, [0, 1]), (1, 4, [2, 3]), (2, 2, [0, 1])]
    """
    return _batches_from(position, position.sampler.epoch, position.sampler.offset, batch_size, drop_last)


def _batches_from(
    position: DataPosition, epoch: int, offset: int, batch_size: int, drop_last: bool
) -> Iterator[Planned]:
    sampler = position.sampler
    while True:
        order, seed = sampler.order(epoch), position.epoch_seed(epoch)
        for start in range(offset, len(order), batch_size):
            chunk = order[start : start + batch_size]
            if len(chunk) < batch_size and drop_last:
                break
            yield epoch, start + len(chunk), [(seed, i) for i in chunk]
        epoch, offset = epoch + 1, 0


class _Plan:
    """A lane's batch sampler: the keys of :func:`plan` (replaced by the lane's thread at each
    ``iter()`` of its loader; empty until the lane is pointed)."""

    def __init__(self) -> None:
        self.batches: Iterator[Planned] = iter(())

    def __iter__(self) -> Iterator[list[Key]]:
        return (keys for _, _, keys in self.batches)

    def __len__(self) -> int:
        return 1 << 62  # without end; a DataLoader of a map-style dataset never needs it


class _Failed(Exception):
    """The active lane gave no batch: ``reason`` is ``stalled`` or ``died``."""

    def __init__(self, reason: str, waited_s: float, threshold_s: float, error: BaseException | None = None):
        super().__init__(reason)
        self.reason, self.waited_s, self.threshold_s, self.error = reason, waited_s, threshold_s, error


_BATCH, _END, _ERROR, _OK = "batch", "end", "error", "ok"


def _torch_module(name: str) -> Any:
    """A torch module, imported when the shadow loader runs -- in a training process, which has
    torch -- never when ``streams`` is imported (the product's services run without torch)."""
    return importlib.import_module(name)


def _lane_broke(exc: BaseException, workers_alive: bool) -> bool:
    """Whether a lane's error is the lane failing -- a worker that exited ("DataLoader worker
    (pid N) exited unexpectedly"), the pipe to a killed worker breaking mid-message -- rather
    than the dataset's own error, which torch re-raises with "Caught X in DataLoader worker
    process N" (of any type: a dataset may raise ConnectionResetError too)."""
    text = str(exc)
    if "in DataLoader worker process" in text:
        return False
    if text.startswith("DataLoader worker (pid"):
        return True
    return isinstance(exc, OSError | EOFError) or not workers_alive


class _Lane:
    """One DataLoader with persistent workers, and the thread that calls its iterator."""

    def __init__(self, number: int, make_loader: Callable[[_Plan], Any]) -> None:
        self.number = number
        self.plan = _Plan()
        self.loader = make_loader(self.plan)
        self.iterator: Any = None
        self.started = threading.Event()
        self.start_error: BaseException | None = None
        #: the plan the lane is to read next (sent with its next "iter") and whether that is due.
        self.pointed: Iterator[Planned] = iter(())
        self.needs_iter = False
        self.killed = False
        self._outstanding: str | None = None
        self._requests: queue.SimpleQueue[tuple[str, Iterator[Planned]] | None] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"trainguard-loader-{number}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # In this thread, not the training loop's: the iterator starts its workers here, and
            # torch installs its SIGCHLD handler only from the main thread -- a lane's workers
            # killed on purpose must not raise in the training loop.  Its plan is empty: the
            # workers start and wait.
            self.iterator = iter(self.loader)
            self._unregister()
        except BaseException as exc:
            self.start_error = exc
            self.started.set()
            return
        self.started.set()
        while (request := self._requests.get()) is not None:
            op, batches = request
            reply: tuple[str, Any]
            try:
                if op == "iter":
                    self.plan.batches = batches
                    self.iterator = iter(self.loader)  # persistent workers: a reset, no new processes
                    reply = (_OK, None)
                else:
                    reply = (_BATCH, next(self.iterator))
            except StopIteration:
                reply = (_END, None)
            except BaseException as exc:
                reply = (_ERROR, exc)
            self._replies.put(reply)
        self._shutdown()

    def call(self, op: str, limit_s: float | None) -> tuple[str, Any]:
        """Ask the lane's thread for ``op`` ("iter": start reading the ``pointed`` plan; "next": a
        batch) and wait ``limit_s`` for the answer (None: forever).  A request that was not
        answered in time stays the lane's outstanding one: asking again waits for its answer."""
        if self._outstanding is None:
            self._outstanding = op
            self._requests.put((op, self.pointed if op == "iter" else iter(())))
        elif self._outstanding != op:
            raise RuntimeError(f"lane {self.number}: {op!r} asked while {self._outstanding!r} is unanswered")
        t0 = time.perf_counter()
        try:
            reply = self._replies.get(timeout=limit_s)
        except queue.Empty:
            raise _Failed("stalled", time.perf_counter() - t0, limit_s or 0.0) from None
        self._outstanding = None
        return reply

    def workers(self) -> list[Any]:
        return list(getattr(self.iterator, "_workers", None) or [])

    def workers_alive(self) -> bool:
        return all(w.is_alive() for w in self.workers())

    def _unregister(self) -> None:
        """Take this lane's workers out of torch's SIGCHLD watch.  Torch raises "worker killed"
        *in the main thread, wherever it is* when a registered worker dies and any loader of the
        process installed the handler (one made in the main thread does): a dead lane would then
        crash the training step instead of being taken over.  The lane watches its workers
        itself (:meth:`workers_alive`, and torch's own check while it waits for a batch)."""
        it = self.iterator
        if it is not None and getattr(it, "_worker_pids_set", False):
            with contextlib.suppress(Exception):
                signal_handling = _torch_module("torch.utils.data._utils.signal_handling")
                signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False

    def kill(self) -> None:
        """Stop a failed lane at once: its workers are killed (a hung worker would not heed the
        DataLoader's own shutdown for 5 s each), then its thread, freed by their death, cleans up."""
        if self.killed:
            return
        self.killed = True
        self._unregister()
        for w in self.workers():
            with contextlib.suppress(Exception):
                w.kill()
        self._requests.put(None)

    def close(self) -> None:
        """End a healthy lane: its thread shuts its workers down."""
        self._requests.put(None)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _shutdown(self) -> None:
        it = self.iterator
        self.iterator = None
        if it is not None and hasattr(it, "_shutdown_workers"):
            with contextlib.suppress(Exception):
                it._shutdown_workers()


class ShadowLoader:
    """Batches of ``dataset`` at ``position``, from an active DataLoader with a warm standby.

    ``dataset``: a map-style dataset (wrapped in :class:`SeededSamples` unless it is one);
    ``loader_args``: the DataLoader's other arguments (``batch_size`` and ``num_workers`` >= 1
    required; the sampler, ``persistent_workers`` and ``timeout`` are the shadow loader's);
    ``on_event``: called with each :class:`LoaderEvent`, in the training loop's thread.
    """

    def __init__(
        self,
        dataset: Any,
        position: DataPosition,
        loader_args: dict[str, Any],
        config: ShadowLoaderConfig | None = None,
        on_event: Callable[[LoaderEvent], None] | None = None,
    ) -> None:
        taken = sorted(set(_OWN_ARGS) & set(loader_args))
        if taken:
            raise ValueError(f"the shadow loader sets {', '.join(taken)} itself: drop them from loader_args")
        size = loader_args.get("batch_size")
        if not isinstance(size, int) or size < 1:
            raise ValueError("loader_args needs a batch_size >= 1 (the position advances by it)")
        workers = loader_args.get("num_workers")
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(
                "loader_args needs num_workers >= 1: a loader in the training process has no standby"
            )
        self.dataset = dataset if isinstance(dataset, SeededSamples) else SeededSamples(dataset)
        self.position = position
        self.loader_args = {k: v for k, v in loader_args.items() if k not in ("batch_size", "drop_last")}
        self.batch_size = size
        self.drop_last = bool(loader_args.get("drop_last", False))
        #: the batches the active lane will deliver, in order (the main thread's copy of its plan).
        self._expected: Iterator[Planned] = iter(())
        self.config = config or ShadowLoaderConfig()
        self.on_event = on_event
        #: seconds the training loop waited for its last batch (``data_wait_s``), takeovers included.
        self.last_wait_s = 0.0
        #: every event so far, in order.
        self.events: list[LoaderEvent] = []
        self._waits: collections.deque[float] = collections.deque(maxlen=self.config.wait_window)
        self._takeovers: collections.deque[float] = collections.deque()
        self._lanes = 0
        self._active: _Lane | None = None
        self._standby: _Lane | None = None
        self._cold = True  # the active lane has not given its first batch yet
        self._gave_up = False
        self._pending: tuple[_Failed, _Lane, _Lane, float] | None = None
        self._closed = False

    # -- lanes ----------------------------------------------------------------------------------
    def _make_loader(self, batches: _Plan) -> Any:
        DataLoader = _torch_module("torch.utils.data").DataLoader
        # SeededSamples is a map-style dataset by protocol (``__getitem__``, ``__len__``), not a
        # subclass of torch's Dataset, which streams does not import at module level.
        dataset: Any = self.dataset
        return DataLoader(dataset, batch_sampler=batches, persistent_workers=True, **self.loader_args)

    def _new_lane(self) -> _Lane:
        self._lanes += 1
        return _Lane(self._lanes, self._make_loader)

    def _point(self, lane: _Lane) -> None:
        """Point ``lane`` at the position: its plan from here on (and the same plan, for the
        loop's accounting, as what to expect)."""
        lane.pointed = plan(self.position, self.batch_size, self.drop_last)
        self._expected = plan(self.position, self.batch_size, self.drop_last)
        lane.needs_iter = True

    @property
    def lanes_started(self) -> int:
        """Lanes built so far: 2 + one per takeover (the first standby and each replacement)."""
        return self._lanes

    # -- the training loop's side ---------------------------------------------------------------
    def batches(self) -> Iterator[Any]:
        """Batches epoch after epoch from the position, without end (like ``DataPosition.batches``)."""
        if self._active is not None:
            raise RuntimeError("batches() is already being iterated")
        sampler = self.position.sampler
        self._active = self._new_lane()
        self._standby = self._new_lane()
        self._point(self._active)
        try:
            while True:
                batch = self._fetch()
                epoch, offset, keys = next(self._expected)
                if epoch != sampler.epoch:
                    sampler.set_epoch(epoch)
                sampler.offset = offset
                self.position.consumed += len(keys)
                yield batch
        finally:
            self.close()

    def _threshold(self) -> float | None:
        """How long the next batch is waited for (None: without end, after giving up)."""
        cfg = self.config
        if self._gave_up:
            return None
        if self._cold:
            return max(cfg.first_batch_s, cfg.takeover_after_s)
        if not self._waits:
            return cfg.takeover_after_s
        ordered = sorted(self._waits)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return max(cfg.takeover_after_s, cfg.wait_factor * p99)

    def _fetch(self) -> Any:
        """The active lane's next batch, taking over from it while it fails."""
        t0 = time.perf_counter()
        while True:
            lane = self._active
            assert lane is not None
            limit = self._threshold()
            try:
                if lane.needs_iter:
                    kind, value = lane.call("iter", limit)
                    if kind == _ERROR:
                        raise self._judge(lane, value, time.perf_counter() - t0, limit)
                    lane.needs_iter = False
                kind, value = lane.call("next", limit)
                if kind == _ERROR:
                    raise self._judge(lane, value, time.perf_counter() - t0, limit)
            except _Failed as failure:
                failure.waited_s = time.perf_counter() - t0
                if failure.reason == "stalled" and not lane.workers_alive():
                    # Torch notices a dead worker only after 5 s of silence; the lane is dead, not slow.
                    failure.reason = "died"
                self._take_over(failure)
                continue
            break
        now = time.perf_counter()
        self.last_wait_s = now - t0
        if self._pending is not None:
            self._finish_takeover(now)
        elif not self._cold:
            self._waits.append(self.last_wait_s)
        self._cold = False
        if kind != _BATCH:  # a plan has no end: a lane that ends is broken
            raise RuntimeError(f"shadow loader: loader {self._active.number if self._active else '?'} ended")
        return value

    def _judge(self, lane: _Lane, exc: BaseException, waited_s: float, limit: float | None) -> BaseException:
        """A lane's error: its workers dying is the lane failing; anything else (the dataset's own
        exception, re-raised by the DataLoader) is the training job's, raised as it is."""
        if _lane_broke(exc, lane.workers_alive()) and not self._gave_up:
            return _Failed("died", waited_s, limit or 0.0, exc)
        return exc

    def _take_over(self, failure: _Failed) -> None:
        old = self._active
        assert old is not None
        if self._pending is not None:  # the lane that took over failed before its first batch
            self._finish_takeover(time.perf_counter(), failed=True)
        now = time.monotonic()
        window = self.config.takeover_window_s
        while self._takeovers and now - self._takeovers[0] > window:
            self._takeovers.popleft()
        standby = self._ready_standby()
        if len(self._takeovers) >= self.config.max_takeovers or standby is None:
            self._give_up(failure, old)
            return
        self._takeovers.append(now)
        old.kill()
        self._point(standby)
        # The replacement standby starts its workers now, in its own thread, beside the takeover:
        # a second failure right after the first (the same bad shard) finds it ready.
        self._active, self._standby = standby, self._new_lane()
        self._cold = False
        self._pending = (failure, old, standby, time.perf_counter())

    def _ready_standby(self) -> _Lane | None:
        """The standby once its workers run; None when it failed to start (reported)."""
        standby = self._standby
        if standby is None:
            return None
        if not standby.started.wait(self.config.arm_timeout_s):
            self._emit(LoaderEvent("standby_failed", f"not started within {self.config.arm_timeout_s:g} s",
                                   to_lane=standby.number))  # fmt: skip
            return None
        if standby.start_error is not None:
            self._standby = None
            exc = standby.start_error
            self._emit(
                LoaderEvent("standby_failed", f"{type(exc).__name__}: {exc}"[:500], to_lane=standby.number)
            )
            return None
        return standby

    def _give_up(self, failure: _Failed, lane: _Lane) -> None:
        self._gave_up = True
        sampler = self.position.sampler
        self._emit(
            LoaderEvent(
                "gave_up", failure.reason, stalled_s=failure.waited_s, threshold_s=failure.threshold_s,
                from_lane=lane.number, epoch=sampler.epoch, offset=sampler.offset,
                consumed=self.position.consumed, takeovers=len(self._takeovers),
            )
        )  # fmt: skip
        if self._standby is not None:
            self._standby.close()
            self._standby = None
        if failure.reason == "died" and failure.error is not None:
            raise failure.error  # its workers are gone: nothing to wait for
        # Stalled: wait on it without end, as a loader without a standby would -- the hang
        # TrainGuard sees in the stacks.  The request already sent is still the one answered.

    def _finish_takeover(self, now: float, failed: bool = False) -> None:
        """Report the takeover in progress: the standby's first batch came (at ``now``), or the
        standby ``failed`` too before it (the next takeover or the give-up follows)."""
        assert self._pending is not None
        failure, old, new, t_fail = self._pending
        self._pending = None
        sampler = self.position.sampler
        self._emit(
            LoaderEvent(
                "takeover", failure.reason, stalled_s=failure.waited_s, threshold_s=failure.threshold_s,
                takeover_s=now - t_fail, from_lane=old.number, to_lane=new.number, epoch=sampler.epoch,
                offset=sampler.offset, consumed=self.position.consumed, takeovers=len(self._takeovers),
                failed=failed,
            )
        )  # fmt: skip

    def _emit(self, event: LoaderEvent) -> None:
        self.events.append(event)
        log.warning("%s", event.line())
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a reporting hook must not stop the training loop
                log.exception("shadow loader: on_event failed")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop both lanes (healthy ones shut their workers down; failed ones are killed)."""
        if self._closed:
            return
        self._closed = True
        lanes = [lane for lane in (self._active, self._standby) if lane is not None]
        for lane in lanes:
            lane.close()
        for lane in lanes:
            lane.join(timeout_s)
