"""Record real NCCL Flight Recorder dumps on a GPU machine (the fixtures of
``tests/fixtures/flight_recorder_nccl``).

One GPU holds one NCCL rank (NCCL refuses two ranks of a communicator on one device), so these
are 1-rank NCCL jobs -- what they show is NCCL's dump *format* (``pg_config`` listing each
group's ranks, entries in ``scheduled`` / ``started`` / ``completed``), not a multi-rank hang:

* ``request``: a job with three process groups (the default one and two subgroups named like
  Megatron's) runs all-reduces, all-gathers and broadcasts with ``TORCH_NCCL_ENABLE_TIMING`` on,
  then queues an all-reduce behind a GPU kernel that sleeps, and dumps its recorders from Python
  while that collective is in flight -- as the training reporter does on a capture -- with each
  of PyTorch's four dump functions (NCCL's recorder and the generic one, pickle and JSON), into
  ``request/<function>/fr_trace_rank_0`` (named as PyTorch names dumps, ``<prefix><rank>``);
* ``timeout``: a job whose training reporter (:class:`trainguard.streams.reporter.Reporter`, created before
  ``init_process_group``) set ``TORCH_FR_DUMP_TEMP_FILE`` and ``TORCH_NCCL_DUMP_ON_TIMEOUT``,
  with a 5 s collective timeout, queues an all-reduce behind a 30 s kernel: PyTorch's watchdog
  times it out and writes the dump itself, into the reporter's ``fr/timeout/rank_0`` -- the file
  the node exporter collects.

``--pair OUT`` records a 2-rank hang (``OUT/pair_pickle/fr_trace_rank_{0,1}``) on a machine with
two GPUs.  ``python3 scripts/record_nccl_fr.py OUT`` writes ``OUT/request/<function>/fr_trace_rank_0``,
``OUT/timeout/rank_0`` and ``OUT/manifest.json`` (torch and NCCL versions, the API used, dump
times, the timeout job's exit).  Needs CUDA and NCCL; the repository root on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(ranks: list[int], desc: str) -> Any:
    import torch.distributed as dist

    try:
        return dist.new_group(ranks, group_desc=desc)
    except TypeError:  # an older torch: no group_desc
        return dist.new_group(ranks)


def request_job(out: Path) -> dict[str, object]:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # entries move to "started" and record durations
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    tp, dp = _group([0], "tensor_model_parallel"), _group([0], "data_parallel")
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(20):
        dist.all_reduce(x, group=tp)
        outs = [torch.empty_like(x)]
        dist.all_gather(outs, x, group=tp)
        dist.all_reduce(x, group=dp)
        dist.broadcast(x, 0)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))  # about 2 s of GPU time: the next collective waits behind it
    dist.all_reduce(x, group=dp)
    time.sleep(0.5)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    info: dict[str, object] = {"torch": torch.__version__, "nccl": nccl}
    from torch._C import _distributed_c10d as c10d

    # NCCL groups have a recorder of their own (CUDA events): the generic one (_dump_fr_trace*)
    # holds the other backends' collectives.  Each of the four is written, with its size.
    for name in ("_dump_nccl_trace", "_dump_nccl_trace_json", "_dump_fr_trace", "_dump_fr_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is None:
            info[name] = "missing"
            continue
        data = fn()
        data = data.encode() if isinstance(data, str) else bytes(data)
        folder = out / name.removeprefix("_dump_")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fr_trace_rank_0").write_bytes(data)
        info[name] = {"bytes": len(data), "dumped_at_ns": time.time_ns()}
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return info


def pair_rank(out: Path, rank: int, port: int) -> None:
    """One of two ranks, each on a GPU of its own: 10 all-reduces, then rank 1 skips the 11th
    while rank 0 enters it; both dump 4 s later (a real 2-rank hang in NCCL's recorder).  Needs two
    GPUs: on one, NCCL refuses the pair ("Duplicate GPU detected : rank 0 and rank 1 both on CUDA
    device", NCCL 2.28.9 on the lent H100, 2026-11-27)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    x = torch.ones(1 << 20, device=device)
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 0:
        dist.all_reduce(x)  # rank 1 never joins
    time.sleep(4)
    from torch._C import _distributed_c10d as c10d

    data = getattr(c10d, "_dump_nccl_trace")()  # noqa: B009 -- not in the type stubs
    (out / "pair_pickle").mkdir(parents=True, exist_ok=True)
    (out / "pair_pickle" / f"fr_trace_rank_{rank}").write_bytes(data)
    print(f"rank {rank}: dumped {len(data)} bytes at {time.time_ns()}", flush=True)
    os._exit(0)  # the hung collective would block a clean exit


def timeout_job(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from trainguard.streams.reporter import Reporter

    out.mkdir(parents=True, exist_ok=True)
    rep = Reporter(
        job="nccl-timeout", rank=0, node="gpu0", socket_path=str(out / "reporter.sock"),
        capture_exceptions=False, capture_sigterm=False,
    )  # fmt: skip
    print("reporter set:", {k: v for k, v in os.environ.items() if k.startswith("TORCH_")}, flush=True)
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    dist.init_process_group(
        "nccl", rank=0, world_size=1, timeout=timedelta(seconds=5), device_id=torch.device("cuda:0")
    )
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(6e10))  # about 30 s: the all-reduce behind it times out after 5 s
    dist.all_reduce(x)
    print("all_reduce queued behind a 30 s kernel; waiting for the watchdog", flush=True)
    time.sleep(90)
    rep.close()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--pair":
        out, port = Path(sys.argv[2]), _port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs = [
            subprocess.Popen([sys.executable, __file__, "--pair-rank", str(out), str(r), str(port)], env=env)
            for r in (0, 1)
        ]
        for proc in procs:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("pair exits:", [proc.returncode for proc in procs], flush=True)
        return 0
    if len(sys.argv) == 5 and sys.argv[1] == "--pair-rank":
        pair_rank(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] in ("--request", "--timeout"):
        out = Path(sys.argv[2])
        if sys.argv[1] == "--request":
            info = request_job(out)
            (out / "info.json").write_text(json.dumps(info))
        else:
            timeout_job(out)
        return 0
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    manifest: dict[str, object] = {}
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, __file__, "--request", str(out / "request")], env=env, timeout=120)
    info_file = out / "request" / "info.json"
    request: dict[str, object] = {"exit": rc, "seconds": round(time.monotonic() - t0, 1)}
    if info_file.exists():
        request.update(json.loads(info_file.read_text()))
        info_file.unlink()
    manifest["request"] = request
    tdir = Path(tempfile.mkdtemp(prefix="nccl-timeout-"))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--timeout", str(tdir)], env=env)
    dump = tdir / "fr" / "timeout" / "rank_0"
    last, settled = -1, 0
    while time.monotonic() - t0 < 150 and settled < 3:
        time.sleep(1)
        size = dump.stat().st_size if dump.exists() else -1
        settled = settled + 1 if size > 0 and size == last else 0
        last = size
        if proc.poll() is not None and size <= 0 and time.monotonic() - t0 > 20:
            break
    appeared = round(time.monotonic() - t0, 1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    manifest["timeout"] = {"exit": proc.returncode, "dump_bytes": last, "seconds_until_settled": appeared}
    if dump.exists():
        (out / "timeout").mkdir(exist_ok=True)
        (out / "timeout" / "rank_0").write_bytes(dump.read_bytes())
        manifest["timeout"]["dumped_at_ns"] = dump.stat().st_mtime_ns  # type: ignore[index]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
