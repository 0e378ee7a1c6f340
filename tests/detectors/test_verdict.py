"""Whole-log verdicts (detectors/verdict.py), ``classify-log --verdict`` and the exit classifier
that runs the same logic on a rank's stderr.

The logs are real lines from public reports, cited per block; where lines of two reports are put
together to make one failure (a fault on one rank, the watchdogs of the others), the test says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.commands.classify import classify_log
from trainguard.detectors.log_classifier import classify_exit
from trainguard.detectors.verdict import LogVerdict, log_verdict
from trainguard.schemas.enums import Action

# https://github.com/kohya-ss/sd-scripts/issues/1434 -- the end of a rank's ECC traceback and its
# watchdog's message (in this order in the report).
ECC_RANK = [
    "Traceback (most recent call last):",
    '  File "/home/Ubuntu/Desktop/kohya_ss/sd-scripts/library/sdxl_original_unet.py", line 257, in get_timestep_embedding',
    "    exponent = exponent / (half_dim - downscale_freq_shift)",
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
    "[E ProcessGroupNCCL.cpp:916] [Rank 1] NCCL watchdog thread terminated with exception: CUDA error: uncorrectable ECC error encountered",
]
# https://github.com/XPixelGroup/BasicSR/issues/737 -- watchdog timeouts of ranks waiting on a peer.
WATCHDOGS = [
    "[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.",
    "[rank1]:[E626 06:24:44.906457629 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at work: 808, last enqueued NCCL work: 811, last completed NCCL work: 807.",
    "[rank0]:[E626 06:24:44.159932949 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600030 milliseconds before timing out.",
    "[rank2]:[E626 06:24:44.173078629 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600061 milliseconds before timing out.",
]
# KubeCon + CloudNativeCon Hong Kong 2024, DaoCloud's 'Sit Back and Relax with Fault Awareness and
# Robust Instant Recovery for Large Scale AI Workloads' slides: one rank's NCCL failure, in order.
KUBECON_NCCL = [
    "node-1:185:1027 [7] NCCL INFO [Service thread] Connection closed by localRank 0",
    "node-1:178:828 [0] NCCL INFO comm 0x55555da97ba0 rank 16 nranks 32 cudaDev 0 busId 1b000 - Abort COMPLETE",
    "[E ProcessGroupNCCL.cpp:481] Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.",
    "[E ProcessGroupNCCL.cpp:487] To avoid data inconsistency, we are taking the entire process down.",
    "[E ProcessGroupNCCL.cpp:852] [Rank 16] NCCL watchdog thread terminated with exception: NCCL error: remote process exited or there was a network error, NCCL version 2.19.3",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "Last error:",
    "NET/IB : Got completion from peer 10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244",
    "terminate called after throwing an instance of 'std::runtime_error'",
]
# https://github.com/DeepChainBio/bio-transformers/issues/21 -- an import after an upgrade.
IMPORT_AFTER_UPGRADE = [
    "Traceback (most recent call last):",
    '  File "main.py", line 1, in <module>',
    "    from biotransformers import BioTransformers",
    '  File "/om2/user/kaiyi/anaconda/envs/bio-transformers/lib/python3.7/site-packages/biotransformers/__init__.py", line 1, in <module>',
    "    from biotransformers.bio_transformers import BioTransformers  # noqa",
    '  File "/om2/user/kaiyi/anaconda/envs/bio-transformers/lib/python3.7/site-packages/biotransformers/lightning_utils/data.py", line 11, in <module>',
    "    from torch._six import int_classes as _int_classes",
    "ImportError: cannot import name 'int_classes' from 'torch._six' (/om2/user/kaiyi/anaconda/envs/bio-transformers/lib/python3.7/site-packages/torch/_six.py)",
]
# https://github.com/cubiq/ComfyUI_IPAdapter_plus/issues/309 -- importlib loading a module after a
# torch update.
IMPORTLIB = [
    "Traceback (most recent call last):",
    '  File "/sd/ComfyUI/nodes.py", line 1888, in load_custom_node',
    "    module_spec.loader.exec_module(module)",
    '  File "<frozen importlib._bootstrap_external>", line 883, in exec_module',
    '  File "<frozen importlib._bootstrap>", line 241, in _call_with_frames_removed',
    '  File "/sd/ComfyUI/custom_nodes/ComfyUI_IPAdapter_plus/__init__.py", line 17, in <module>',
    "    from .IPAdapterPlus import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS",
    '  File "/sd/ComfyUI/custom_nodes/ComfyUI_IPAdapter_plus/IPAdapterPlus.py", line 13, in <module>',
    "    import torchvision.transforms.v2 as T",
    "ModuleNotFoundError: No module named 'torchvision.transforms.v2'",
]
# https://github.com/raspberrypi/linux/issues/2482 -- NFS stops answering, a task hangs on it.
NFS_HANG = [
    "[ 3223.539141] nfs: server ease not responding, still trying",
    "[ 3224.612015] nfs: server ease OK",
    "[ 3438.580109] INFO: task objcopy:24916 blocked for more than 120 seconds.",
    "[ 3438.583905]       Tainted: G         C      4.14.31-1-ARCH #1",
    "[ 3438.595231] objcopy         D    0 24916  24912 0x00000000",
    "[ 3438.599109] [<80a87848>] (__schedule) from [<80a88018>] (schedule+0x3c/0xa0)",
    "[ 3438.629666] [<80233190>] (filemap_write_and_wait_range) from [<803db1c4>] (nfs_file_fsync+0x30/0x280)",
]


def test_the_first_cause_wins_over_the_watchdogs_that_follow() -> None:
    """An uncorrectable ECC error on one rank, then every rank's watchdog: the GPU, not a hang.
    (ECC_RANK and WATCHDOGS are two real reports put together.)"""
    v = log_verdict(ECC_RANK + WATCHDOGS)
    assert (v.action, v.category, v.rule, v.role) == (Action.EVICT, "gpu_memory_error", "cuda-ecc", "cause")
    assert v.cause_line == "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    # after it: its own watchdog's line and the three timeouts ("Exception ... detected by
    # watchdog" matches no row)
    assert v.line_no == 4 and v.consequences == 4


def test_watchdogs_printed_before_the_fault_still_yield() -> None:
    v = log_verdict(WATCHDOGS[:2] + ECC_RANK + WATCHDOGS[2:])
    assert (v.rule, v.line_no) == ("cuda-ecc", 6)


def test_only_watchdogs_is_a_hang() -> None:
    v = log_verdict(WATCHDOGS)
    assert (v.action, v.category, v.rule, v.role, v.line_no) == (
        Action.DIAGNOSE,
        "comm_timeout",
        "watchdog-timeout",
        "secondary",
        1,
    )


def test_the_network_error_nccl_reports_last_is_the_cause() -> None:
    v = log_verdict(KUBECON_NCCL)
    assert (v.action, v.category, v.rule) == (Action.DIAGNOSE, "network_error", "ib-completion-error")
    assert v.classification is not None and v.classification.fields["status"] == 5


def test_an_import_error_after_an_upgrade_is_a_rollback() -> None:
    v = log_verdict(IMPORT_AFTER_UPGRADE)
    assert (v.action, v.category, v.rule) == (Action.ROLLBACK, "user_code", "import-time-error")
    assert v.classification is not None and v.classification.fields["import_time"] is True
    v2 = log_verdict(IMPORTLIB)
    assert (v2.action, v2.rule) == (Action.ROLLBACK, "import-time-error")


def test_a_type_error_raised_while_importing_is_a_rollback_even_without_a_user_frame() -> None:
    """Synthetic: a library's top-level code fails after an upgrade (all frames site-packages)."""
    tb = [
        "Traceback (most recent call last):",
        '  File "/usr/local/lib/python3.10/site-packages/torch/distributed/run.py", line 9, in <module>',
        '  File "/usr/local/lib/python3.10/site-packages/apex/__init__.py", line 3, in <module>',
        "RuntimeError: apex was built against a different torch",
    ]
    assert log_verdict(tb).action is Action.ROLLBACK
    # The same error raised while running (one <module> frame: the script's) is a crash.
    running = [
        tb[0],
        tb[1],
        '  File "/usr/local/lib/python3.10/site-packages/apex/x.py", line 3, in f',
        tb[3],
    ]
    v = log_verdict(running)
    assert (v.action, v.rule) == (Action.DIAGNOSE, "python-exception")


def test_a_software_failure_after_a_code_change_is_a_rollback() -> None:
    running = [
        "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 9, in <module>',
        '  File "/workspace/train.py", line 3, in step',
        "RuntimeError: something new went wrong",
    ]
    lines = ["iteration 100 | loss 2.1", *running]
    assert log_verdict(lines).action is Action.DIAGNOSE
    after = log_verdict(lines, code_changed_line=1)
    assert (after.action, after.rule) == (Action.ROLLBACK, "python-exception") and after.notes
    assert log_verdict(lines, code_changed_line=6).action is Action.DIAGNOSE  # the change came later
    # A hardware fault after a code change is still the hardware.
    assert log_verdict(ECC_RANK, code_changed_line=1).action is Action.EVICT
    timed = ["2024-05-01T10:00:05Z " + line for line in lines]
    assert log_verdict(timed, code_changed_ts=1714557600.0).action is Action.ROLLBACK
    assert log_verdict(timed, code_changed_ts=1714557700.0).action is Action.DIAGNOSE


def test_an_alert_tolerated_once_is_the_cause_of_what_follows() -> None:
    """A NIC going down once is tolerated; when a hang follows, the link is why."""
    lines = ["[ 5521.118340] mlx5_core 0000:5e:00.0 ib0: Link down", *WATCHDOGS]
    v = log_verdict(lines)
    assert (v.action, v.rule, v.role, v.line_no) == (Action.EVICT, "nic-link-down", "tolerated", 1)
    alone = log_verdict(lines[:1])
    assert (alone.action, alone.role) == (Action.IGNORE, "recorded")


def test_a_hung_task_on_nfs_is_the_storage() -> None:
    v = log_verdict(NFS_HANG)
    assert (v.rule, v.action, v.line_no) == ("nfs-not-responding", Action.DIAGNOSE, 1)
    hang = log_verdict(NFS_HANG[2:])
    assert (hang.rule, hang.category, hang.line_no) == ("hung-task-shared-fs", "filesystem_mount", 1)
    assert hang.cause_line == NFS_HANG[-1]


def test_an_xid_chain_is_judged_by_its_cause() -> None:
    # https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150
    lines = [
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
        "kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145",
    ]
    v = log_verdict(lines)
    assert (v.action, v.category, v.rule) == (Action.EVICT, "nvlink_error", "xid-chain")


def test_a_slurm_node_failure_explains_the_ranks_errors() -> None:
    """salloc's line (nebius/soperator#854) before the surviving ranks' watchdogs."""
    v = log_verdict(["salloc: error: Node failure on worker-1", *WATCHDOGS])
    assert (v.action, v.category, v.rule) == (Action.EVICT, "node_failure", "slurm-node-failure")


def test_megatron_nan_and_benign_overflow() -> None:
    # https://github.com/NVIDIA/Megatron-LM/issues/5026 ; overflow line: zai-org/CogVideo#233
    lines = [
        "[2024-09-11 17:52:18,030] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4294967296, reducing to 2147483648",
        "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 3 at iteration #3 invocation #2 (message='found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication collective')",
    ]
    assert (log_verdict(lines).rule, log_verdict(lines).action) == ("megatron-rerun-nan", Action.DIAGNOSE)
    benign = log_verdict(lines[:1])
    assert (benign.action, benign.rule, benign.role) == (Action.IGNORE, "fp16-overflow-skip", "recorded")


def test_nothing_matched() -> None:
    v = log_verdict(["iteration 100 | loss 2.1", ""])
    assert v == LogVerdict()
    assert v.to_json() == {"action": "none", "category": None, "rule": None, "cause_line": None}


# --- the worker: a rank's stderr at exit ---------------------------------------------------------


def test_exit_classification_uses_the_verdict() -> None:
    c = classify_exit(1, None, "\n".join(ECC_RANK + WATCHDOGS))
    assert (c.action, c.rule, c.fields["exit_code"]) == (Action.EVICT, "cuda-ecc", 1)


def test_exit_classification_blames_the_first_exception_of_a_chain() -> None:
    text = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "/workspace/llm/data.py", line 12, in batch',
            "KeyError: 'attention_mask'",
            "",
            "During handling of the above exception, another exception occurred:",
            "",
            "Traceback (most recent call last):",
            '  File "/workspace/llm/train.py", line 40, in step',
            "RuntimeError: batch failed",
        ]
    )
    c = classify_exit(1, None, text)
    assert (c.action, c.rule, c.fields["exception"]) == (Action.ROLLBACK, "user-exception", "KeyError")


# --- the command ---------------------------------------------------------------------------------


def _run(tmp_path: Path, lines: list[str], *args: str) -> str:
    p = tmp_path / "job.log"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    res = CliRunner().invoke(classify_log, [*args, str(p)])
    assert res.exit_code == 0, res.output
    return res.output


def test_cli_verdict_json_is_one_object(tmp_path: Path) -> None:
    out = _run(tmp_path, ECC_RANK + WATCHDOGS, "--verdict", "--json")
    assert out.count("\n") == 1
    assert json.loads(out) == {
        "action": "evict",
        "category": "gpu_memory_error",
        "rule": "cuda-ecc",
        "cause_line": "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    }


def test_cli_verdict_text_and_code_change(tmp_path: Path) -> None:
    out = _run(tmp_path, ECC_RANK + WATCHDOGS, "--verdict")
    assert "verdict: evict" in out and "line 4" in out and "cuda-ecc" in out
    crash = ["Traceback (most recent call last):", '  File "/w/t.py", line 3, in f', "RuntimeError: boom"]
    assert json.loads(_run(tmp_path, crash, "--verdict", "--json"))["action"] == "diagnose"
    out = _run(tmp_path, crash, "--verdict", "--json", "--code-changed-at", "1")
    assert json.loads(out)["action"] == "rollback"
    assert "none" in _run(tmp_path, ["hello"], "--verdict")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--code-changed-at", "3"], "needs --verdict"),
        (["--verdict", "--code-changed-at", "soon"], "neither a line number nor a timestamp"),
        (["--verdict", "--code-changed-at", "0"], "starts at 1"),
    ],
)
def test_cli_code_change_errors(tmp_path: Path, args: list[str], message: str) -> None:
    p = tmp_path / "job.log"
    p.write_text("x\n", encoding="utf-8")
    res = CliRunner().invoke(classify_log, [*args, str(p)])
    assert res.exit_code == 2 and message in res.output
