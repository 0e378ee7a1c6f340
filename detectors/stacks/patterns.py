"""The pattern table that maps stack frames to roles, group-kind hints and pipeline directions.

Rules are data, not code: each is a regular expression searched in a frame's (qualified)
function name and optionally one searched in its normalised filename.  They target the frames
real training stacks show -- ``torch.distributed`` collectives and P2P, Megatron-LM's
``p2p_communication``/``tensor_parallel``/DDP grad sync, DeepSpeed's pipe engine and ZeRO,
``torch.distributed.pipelining`` (torchtitan), FSDP, the DataLoader, ``torch.save``/DCP
checkpointing and the stdlib's blocking primitives.  Callers may pass their own table.

A stack's role is decided by its innermost *decisive* frame: generic waits (``Queue.get``,
``Condition.wait``, ``select``) say the thread is blocked but not on what, so the search goes on
outwards until e.g. ``_try_get_data`` (DataLoader) or ``all_reduce`` (collective) says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    """What a process's main thread is doing."""

    COLLECTIVE = "collective"  # inside a collective: waits for every member of its group
    P2P = "p2p"  # send/recv with a pipeline neighbour
    DEVICE_SYNC = "device_sync"  # host waits for the device (whose stream may wait on NCCL)
    DATALOADER = "dataloader"  # waiting for/inside data loading
    CHECKPOINT = "checkpoint"  # saving/loading a checkpoint, or waiting for the writer
    WAIT = "wait"  # blocked on a local primitive (lock, queue, event, join) for no known subsystem
    COMPUTE = "compute"  # running code that matches nothing: model compute, user code
    MISSING = "missing"  # no dump for this rank (process gone, host unreachable, py-spy failed)


#: Roles that wait on other ranks; every other role is a candidate root ("local" roles).
WAITING_ROLES = frozenset({Role.COLLECTIVE, Role.P2P, Role.DEVICE_SYNC})


@dataclass(frozen=True)
class Rule:
    """``value`` applies to a frame whose name matches ``func`` and filename matches ``file``."""

    value: str
    func: str
    file: str = ""
    not_func: str = ""
    not_file: str = ""
    _f: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _p: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _nf: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _np: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Compiled once here; frozen dataclasses need object.__setattr__ for derived fields.
        object.__setattr__(self, "_f", re.compile(self.func))
        object.__setattr__(self, "_p", re.compile(self.file) if self.file else None)
        object.__setattr__(self, "_nf", re.compile(self.not_func) if self.not_func else None)
        object.__setattr__(self, "_np", re.compile(self.not_file) if self.not_file else None)

    def matches(self, name: str, filename: str) -> bool:
        if self._f.search(name) is None:
            return False
        if self._p is not None and self._p.search(filename) is None:
            return False
        if self._nf is not None and self._nf.search(name) is not None:
            return False
        return self._np is None or self._np.search(filename) is None


def _q(names: str) -> str:
    """Regex for a function name, bare or qualified (``Class.method``, ``f.<locals>.g``)."""
    return rf"(?:^|\.)(?:{names})$"


_C10D = r"(?:^|/)torch/distributed/(?:distributed_c10d|_functional_collectives|c10d_logger|device_mesh)\.py$"
_DS_COMM = r"(?:^|/)deepspeed/comm/"
_COLLECTIVE_OPS = (
    r"all_reduce\w*|allreduce\w*|all_gather\w*|_all_gather_base|allgather\w*|reduce_scatter\w*|"
    r"_reduce_scatter_base|all_to_all\w*|alltoall\w*|broadcast\w*|barrier|monitored_barrier|reduce|"
    r"gather\w*|scatter\w*|inference_all_reduce|wait_tensor"
)
_P2P_OPS = r"send|recv|isend|irecv|batch_isend_irecv|send_object_list|recv_object_list"
_MEGATRON_P2P = (
    r"(?:send|recv)_(?:forward|backward)(?:_recv_(?:forward|backward))?|"
    r"send_forward_backward_recv_forward_backward"
)

ROLE_RULES: tuple[Rule, ...] = (
    # torch.distributed and DeepSpeed comm primitives.
    Rule(Role.P2P, _q(_P2P_OPS), _C10D),
    Rule(Role.COLLECTIVE, _q(_COLLECTIVE_OPS), _C10D),
    Rule(Role.P2P, _q(_P2P_OPS), _DS_COMM),
    Rule(Role.COLLECTIVE, _q(_COLLECTIVE_OPS), _DS_COMM),
    # Pipeline engines that wait on P2P handles (Work.wait() is C++: no Python frame of its own).
    Rule(
        Role.P2P, _q(r"_communicate|_communicate_shapes|_p2p_ops|_batched_p2p_ops"), r"p2p_communication\.py$"
    ),
    Rule(Role.P2P, _q(_P2P_OPS + r"|wait|_send|_recv"), r"(?:^|/)deepspeed/runtime/pipe/p2p\.py$"),
    Rule(Role.P2P, _q(r"_exec_(?:send|recv)_(?:activations|grads)")),
    Rule(Role.P2P, _q(r"_batch_p2p|_sorted_batch_p2p|_wait_batch_p2p"), r"torch/distributed/pipelining/"),
    Rule(Role.P2P, _q(_MEGATRON_P2P)),
    # Grad/param sync that blocks on async collective handles (Megatron DDP, DeepSpeed ZeRO, FSDP).
    Rule(
        Role.COLLECTIVE,
        _q(
            r"finish_grad_sync|finish_param_sync|start_grad_sync|_wait_for_handle|allreduce_gradients|"
            r"reduce_gradients|allreduce_bucket|average_tensor|reduce_ipg_grads|wait_for_unshard|"
            r"_wait_unshard_streams|foreach_all_gather\w*|foreach_reduce\w*|_all_gather_params"
        ),
    ),
    Rule(Role.DEVICE_SYNC, _q(r"synchronize|current_stream_synchronize"), r"torch/(?:cuda|npu|xpu|mps)/"),
    # Data loading: the DataLoader (main side, workers, in-process fetch) and common dataset libs.
    Rule(
        Role.DATALOADER,
        r".",
        r"(?:^|/)(?:torch/utils/data|torchdata|webdataset|megatron/core/datasets|megatron/legacy/data|streaming/base)/",
    ),
    # TrainGuard's shadow loader: a training loop waiting on it waits for its DataLoader's lane.
    Rule(Role.DATALOADER, r".", r"(?:^|/)streams/shadow_loader\.py$"),
    # Checkpointing: torch.save/load, DCP, framework checkpoint modules, or a function named so
    # (but not activation checkpointing, which is recomputation inside forward/backward).
    Rule(
        Role.CHECKPOINT,
        r".",
        r"(?:^|/)(?:torch/serialization\.py|torch/distributed/checkpoint/|megatron/core/dist_checkpointing/|"
        r"megatron/training/checkpointing\.py|megatron/checkpointing\.py|deepspeed/runtime/checkpoint_engine/|"
        r"torchsnapshot/|safetensors/|torchtitan/components/checkpoint\.py)",
    ),
    Rule(
        Role.CHECKPOINT,
        r"(?i)checkpoint|ckpt",
        not_func=r"(?i)CheckpointFunction|checkpoint_wrapper|CheckpointWrapper|activation|recompute|checkpointed",
        not_file=r"(?:^|/)torch/utils/checkpoint\.py$|(?:^|/)tensor_parallel/random\.py$",
    ),
    # Generic blocking primitives: not decisive, the search continues outwards.
    Rule(
        Role.WAIT,
        r".",
        r"^(?:threading|queue|selectors|subprocess|socket|ssl)\.py$|^(?:multiprocessing|concurrent/futures|asyncio)/",
    ),
)

#: Which parallel group a collective runs in, from the frames around it (innermost hit wins).
KIND_RULES: tuple[Rule, ...] = (
    Rule(
        "tp",
        r"(?i)tensor_model_parallel|tensor_parallel|_reduce_from|_gather_along|_reduce_scatter_along|"
        r"_split_along|copy_to_tensor|RowParallel|ColumnParallel|VocabParallel|vocab_parallel|"
        r"sequence_parallel|(?:^|[._])tp_|_tp(?:$|_)",
    ),
    Rule("tp", r".", r"(?:^|/)(?:megatron/core/tensor_parallel|fairscale/nn/model_parallel)/"),
    Rule(
        "pp",
        r"(?i)embedding_grads|word_embedding|pipeline_model_parallel|(?:^|[._])pp_|_pp(?:$|_)",
    ),
    Rule(
        "dp",
        r"(?i)finalize_model_grads|grad_sync|param_sync|allreduce_gradients|reduce_gradients|data_parallel|"
        r"allreduce_bucket|average_tensor|reduce_ipg|_reduce_and_partition|reduce_scatter_grad|"
        r"foreach_reduce|foreach_all_gather|(?:^|[._])dp_|_dp(?:$|_)",
    ),
    Rule(
        "dp",
        r".",
        r"(?:^|/)(?:torch/distributed/fsdp|torch/nn/parallel/distributed\.py|deepspeed/runtime/zero)",
    ),
)

#: Which pipeline neighbour a P2P operation waits on: activations come from the previous stage
#: and go to the next, gradients come from the next stage and go to the previous.
PEER_RULES: tuple[Rule, ...] = (
    Rule("next", r"(?i)send_forward_recv_backward"),
    Rule("prev", r"(?i)send_backward_recv_forward"),
    Rule("both", r"(?i)send_forward_recv_forward|send_backward_recv_backward|send_forward_backward_recv"),
    Rule("prev", r"(?i)recv_forward|recv_activations|recv_act\b|fwd_recv|forward_recv|recv_fwd"),
    Rule("prev", r"(?i)send_backward|send_grads|bwd_send|backward_send|send_bwd"),
    Rule("next", r"(?i)recv_backward|recv_grads|bwd_recv|backward_recv|recv_bwd"),
    Rule("next", r"(?i)send_forward|send_activations|fwd_send|forward_send|send_fwd"),
)

#: A helper process (DataLoader worker, checkpoint writer) whose first non-wait frame is one of
#: these is idle, waiting for its next job; anything else means it is busy doing that job.
IDLE_LOOP_RULES: tuple[Rule, ...] = (
    Rule("idle", _q(r"_worker_loop|_pin_memory_loop")),
    Rule("idle", r"(?i)(?:_loop|worker|writer|_subprocess|_serve|_main)$"),
)


@dataclass(frozen=True)
class PatternTable:
    """The four rule lists used to read stacks; replace any of them to support another framework."""

    roles: tuple[Rule, ...] = ROLE_RULES
    kinds: tuple[Rule, ...] = KIND_RULES
    peers: tuple[Rule, ...] = PEER_RULES
    idle_loops: tuple[Rule, ...] = IDLE_LOOP_RULES
