"""A tiny DDP job for the agent's tests and bench: 2 ranks, gloo on CPU.

Each rank appends one JSON line per event to ``$AGENT_TEST_OUT/rank<R>.jsonl``: ``first_step`` once
its first all-reduced step is done (with the wall time, generation, world and code version), then
it trains until it is stopped.  ``marker.py`` beside the script names the code version's behaviour.
"""

import json
import os
import time
from datetime import timedelta

import marker  # the code version's own module (a hot update swaps it)
import torch
import torch.distributed as dist


def say(**event: object) -> None:
    path = os.path.join(os.environ["AGENT_TEST_OUT"], f"rank{os.environ['RANK']}.jsonl")
    with open(path, "a") as fh:
        fh.write(json.dumps({**event, "ts": time.time()}) + "\n")


def main() -> None:
    started = time.time()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    joined = time.time()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            say(
                event="first_step",
                generation=int(os.environ.get("TRAINGUARD_GENERATION", "0")),
                world=dist.get_world_size(),
                rank=dist.get_rank(),
                node=os.environ.get("TRAINGUARD_NODE", ""),
                port=os.environ["MASTER_PORT"],
                version=marker.VERSION,
                started=started,
                joined=joined,
            )
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    main()
