"""Rows made for issue #41, each tested on the real line(s) it was made from.

Every entry quotes a line as it was printed in a public source, cited next to it (GitHub
threads by repository and number, other pages by address).  Lines marked ``REAL = False`` were
not found printed anywhere public: they are built from the program's own format string (the
source is cited instead) and say so; ``test_every_new_row_has_a_real_line`` keeps that list
short and explicit.  Nothing here is copied from another project's test data.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from trainguard.detectors.log_classifier import LogClassifier
from trainguard.detectors.rule_table import Rule, default_rule_table
from trainguard.schemas.enums import Action

TABLE = default_rule_table()


@dataclass(frozen=True)
class Quote:
    rule: str
    line: str
    source: str
    real: bool = True


KUBECON = (
    "KubeCon + CloudNativeCon Hong Kong 2024, 'Sit Back and Relax with Fault Awareness and Robust "
    "Instant Recovery for Large Scale AI Workloads' (DaoCloud), slides: dmesg of an H100 node"
)
DCGM_ERRORS = "NVIDIA/DCGM dcgmlib/dcgm_errors.h (format string, instantiated)"
MEGATRON_RSM = "NVIDIA/Megatron-LM megatron/core/rerun_state_machine.py, log_failure() (format, instantiated)"

QUOTES = [
    # --- GPU faults without an Xid number ---------------------------------------------------
    Quote(
        "nvrm-gsp-timeout",
        "Mar 21 21:42:01 kernel: NVRM: GPU0 _kgspIsHeartbeatTimedOut: Heartbeat timed out, currentTimeMs 322227881 heartbeat 0 heartbeatWithOffsetMs 318098841 diff 4129040 timeout 5200",
        "https://github.com/ublue-os/bazzite/issues/4449",
    ),
    Quote(
        "nvrm-gsp-timeout",
        "Mar 21 21:42:01 kernel: NVRM: GPU0 _kgspRpcRecvPoll: GSP RM heartbeat timed out",
        "https://github.com/ublue-os/bazzite/issues/4449",
    ),
    Quote(
        "nvrm-gsp-timeout",
        "192.168.11.119: kern: warning: [2026-04-22T21:30:51.803749334Z]: NVRM: _issueRpcAndWait: rpcRecvPoll timedout for fn 76 sequence 4129!",
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/446",
    ),
    Quote(
        "nvrm-gsp-timeout",
        "192.168.11.119: kern: warning: [2026-04-22T21:30:51.526447914Z]: NVRM: nvAssertFailedNoLog: Assertion failed: Back to back GSP RPC timeout detected! GPU marked for reset @ kernel_gsp.c:2387",
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/446",
    ),
    Quote(
        "nvrm-gsp-timeout",
        "[349525.895155] NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:07:00 (printing 1 of every 30).  The GPU likely needs to be reset.",
        "https://github.com/NVIDIA/DCGM/issues/144",
    ),
    Quote(
        "nvrm-pmu-halt",
        "Mar 27 17:40:36 kernel: NVRM: GPU0 _kgspRpcGspEventPmuHalted: Received signal from GSP that PMU has halted.",
        "https://forums.developer.nvidia.com/t/xid-62-xid-154-gsp-pmu-halt-crash-on-rtx-pro-6000-blackwell-during-llm-inference/364958",
    ),
    Quote(
        "nvidia-probe-failed",
        "nvidia 0000:01:00.0: probe with driver nvidia failed with error -1",
        "https://github.com/pop-os/cosmic-epoch/issues/2146",
    ),
    Quote(
        "nvidia-probe-failed", "[14387.210134] nvidia: probe of 0000:5d:00.0 failed with error -1", KUBECON
    ),
    Quote(
        "nvidia-probe-failed",
        "[14387.274303] NVRM: The NVIDIA probe routine failed for 1 device(s).",
        KUBECON,
    ),
    Quote(
        "nvidia-probe-failed",
        "[188497.595099] NVRM: No NVIDIA graphics adapter probed!",
        "https://github.com/mattshma/bigdata/issues/133",
    ),
    # The driver prints "fallen off the bus" on the third line of a three-line message, no Xid.
    Quote(
        "nvrm-gpu-lost",
        "               NVRM: fallen off the bus and is not responding to commands.",
        KUBECON,
    ),
    Quote("nvrm-gpu-lost", "[ 4254.197871] NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.", KUBECON),
    Quote(
        "nvrm-gpu-lost",
        "[87669.726572] NVRM: rm_init_adapter failed for device bearing minor number 0",
        "https://github.com/Bumblebee-Project/Bumblebee/issues/722",
    ),
    Quote(
        "gpu-memory-no-xid", "Detected 2 volatile double-bit ECC error(s) in GPU 3.", DCGM_ERRORS, real=False
    ),
    Quote(
        "gpu-memory-no-xid",
        "GPU 5 had uncorrectable memory errors and row remapping failed.",
        DCGM_ERRORS,
        real=False,
    ),
    Quote(
        "gpu-memory-no-xid",
        "Pending page retirements together with a DBE were detected on GPU 0.",
        DCGM_ERRORS,
        real=False,
    ),
    Quote(
        "gpu-memory-remap-pending",
        "GPU 2 had memory errors and row remappings are pending",
        DCGM_ERRORS,
        real=False,
    ),
    Quote(
        "nvrm-info",
        "[ 4254.197816] NVRM: GPU at PCI:0000:5d:00: GPU-f1906b9b-557a-e961-045c-9fe4be3ce012",
        KUBECON,
    ),
    Quote(
        "nvrm-info",
        "[349507.495072] NVRM: GPU Board Serial Number: 1320221025612",
        "https://github.com/NVIDIA/DCGM/issues/144",
    ),
    Quote(
        "nvrm-info",
        "[349507.527722] NVRM: GPU0 RPC history (CPU -> GSP):",
        "https://github.com/NVIDIA/DCGM/issues/144",
    ),
    Quote(
        "nvrm-info",
        "[   84.738345] NVRM:      0    4124 GSP_LOCKDOWN_NOTICE            0 0x0000000000000000 0x0000000000000000 0x000655d53b56deca 0x000655d53b56deca",
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1230",
    ),
    Quote(
        "nvrm-unknown",
        "[87669.726589] NVRM: nvidia_frontend_open: minor 0, module->open() failed, error -5",
        "https://github.com/Bumblebee-Project/Bumblebee/issues/722",
    ),
    Quote(
        "nvrm-unknown",
        "[   98.991758] NVRM: failed to copy vbios to system memory.",
        "https://github.com/Bumblebee-Project/Bumblebee/issues/111",
    ),
    Quote(
        "nvrm-unknown",
        "Mar 21 21:42:01 kernel: NVRM: GPU0 nvAssertFailedNoLog: Assertion failed: 0 @ kernel_gsp.c:1446",
        "https://github.com/ublue-os/bazzite/issues/4449",
    ),
    # --- Xid chains -------------------------------------------------------------------------
    Quote(
        "xid-chain",
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150",
    ),
    Quote(
        "xid-chain",
        "kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145",
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150",
    ),
    # --- fabric and switch ------------------------------------------------------------------
    Quote(
        "sxid",
        "[   38.178720] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ interrupt",
        "https://github.com/NVIDIA/nvtrust/issues/124",
    ),
    Quote(
        "sxid",
        "[   38.180708] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Severity 0 Engine instance 44 Sub-engine instance 00",
        "https://github.com/NVIDIA/nvtrust/issues/124",
    ),
    Quote(
        "sxid",
        "kern  :err   : 2025-01-25T10:34:54,859532+00:00 nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data {0x000001c0, 0x00bd5c8a, 0x00000500, 0x00000064, 0x00000000, 0x40008000, 0x5a001100, 0x00000000, 0x00000000}",
        "https://github.com/leptonai/gpud/pull/338 (a dmesg line pasted in the description)",
    ),
    Quote(
        "sxid-fatal",
        "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 24007, Fatal, Link 44 sourcetrack timeout error (First)",
        "the nvidia-nvswitch driver's SXid format of the real line above with severity 'Fatal'",
        real=False,
    ),
    Quote(
        "ofi-network-error",
        "nccl-tests-worker-1:35:89 [5] ofi_process_cq:1039 NCCL WARN NET/OFI Request 0x7fbb944701b8 completed with error. RC: 20. Error: unknown error. Completed length: 0, Request: { buffer_index: 255, dev: 1, size: 0, state: CREATED, direction: SEND }",
        "https://github.com/aws/aws-ofi-nccl/issues/156",
    ),
    Quote(
        "ofi-network-error",
        "NCCL WARN NET/OFI Request completed with error. RC: 21. Error: unknown error",
        "https://github.com/aws/aws-ofi-nccl/issues/161 (title)",
    ),
    Quote(
        "ofi-network-error",
        "algo-1:17778:17848 [5] nccl_net_ofi_create_plugin:259 NCCL WARN NET/OFI aws-ofi-nccl initialization failed",
        "https://github.com/aws/aws-ofi-nccl/issues/715",
    ),
    Quote(
        "ofi-network-error",
        "nccl_net_ofi_domain_get_ep:969 NCCL WARN NET/OFI Creating new endpoint for domain 0x7f9befa99380 failed: Invalid argument",
        "https://github.com/aws/aws-ofi-nccl/issues/889",
    ),
    Quote(
        "ofi-network-error",
        "[1,23]<stdout>:ip-172-32-45-165:72593:73427 [7] create_nccl_ofi_component:459 NCCL WARN NET/OFI Couldn't open AV. RC: -22, ERROR: Invalid argument",
        "https://github.com/aws/aws-ofi-nccl/issues/24",
    ),
    Quote(
        "ofi-network-error",
        "libfabric:451707:1708520807::efa:cq:efa_rdm_txe_handle_error():737<warn> err: 5, message: Invalid address My EFA addr: fi_addr_efa://[fe80::13:c2ff:fe6f:f03d]:0:1072483550 My host id: i-0db7083f3fcbebb65 Peer EFA addr: fi_addr_efa://[fe80::b8:aff:fe44:425]:0:947699476 Peer host id: i-0ce6d3d57139f053c (7)",
        "https://github.com/aws/aws-ofi-nccl/issues/346",
    ),
    Quote(
        "ib-completion-error",
        "NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
        "https://github.com/NVIDIA/nccl/issues/902",
    ),
    Quote(
        "ib-completion-error",
        "NET/IBP:Got completion from peer 7.6.13.83<36315> with status=12 opcode=32698 len=32696 vendor err 129 (Send)",
        "https://github.com/NVIDIA/nccl/issues/1664",
    ),
    Quote(
        "ib-completion-error",
        "kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer 10.216.210.236<54862> with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid fd00:1148:9000:5000:4:200:3:ff22 remoteGidsfd00:1148:9000:5000:4:200:3:ff1f",
        "https://github.com/NVIDIA/nccl/issues/1405",
    ),
    Quote(
        "ib-completion-error",
        "hostname-test:984:1357 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion from peer 172.36.143.59<44206> with status=5 opcode=32656 len=32659 vendor err 249 (Recv) localGid ::ffff:29.87.88.182 remoteGids::ffff:29.87.4.221",
        "https://github.com/NVIDIA/nccl/issues/1814",
    ),
    Quote(
        "ib-completion-error",
        "NET/IB : Got completion from peer 10.42.0.2<47534> with error 5, opcode 48, len 32764, vendor err 244",
        KUBECON,
    ),
    # --- scheduler and storage --------------------------------------------------------------
    Quote(
        "slurm-node-failure",
        "salloc: error: Node failure on worker-1",
        "https://github.com/nebius/soperator/issues/854",
    ),
    Quote(
        "slurm-node-failure",
        "slurmstepd: error: *** STEP 1943824.0 ON jean-zay-iam17 CANCELLED AT 2023-03-06T03:17:51 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***",
        "a public repository's job-failure notes (the GitHub code index; repository not identified); "
        "format: SchedMD Slurm slurmstepd '*** %s ON %s CANCELLED AT %s DUE TO NODE FAILURE, ...'",
    ),
    Quote(
        "nfs-not-responding",
        "[ 3223.539141] nfs: server ease not responding, still trying",
        "https://github.com/raspberrypi/linux/issues/2482",
    ),
    Quote(
        "nfs-not-responding",
        "NFS server bl870ci2 not responding still trying",
        "https://github.com/cfg2html/cfg2html/issues/51 (HP-UX)",
    ),
    Quote("nfs-ok", "[ 3224.612015] nfs: server ease OK", "https://github.com/raspberrypi/linux/issues/2482"),
    Quote(
        "lustre-error",
        "[Mon Oct 16 10:06:17 2017] LustreError: 11-0: jmain01-MDT0000-mdc-ffff88203810d800: operation obd_ping to node 172.31.126.88@o2ib failed: rc = -107",
        "https://github.com/jade-hpc-gpu/jade-hpc-gpu.github.io/issues/14",
    ),
    Quote(
        "lustre-error",
        "[Mon Oct 16 10:00:12 2017] Lustre: 2449:0:(client.c:2141:ptlrpc_expire_one_request()) @@@ Request sent has failed due to network error: [sent 1508144508/real 1508144518]  req@ffff880eb14da700 x1570198182041824/t0(0) o250->MGC172.31.126.87@o2ib@172.31.126.87@o2ib:26/25 lens 520/544 e 0 to 1 dl 1508144563 ref 1 fl Rpc:eXN/0/ffffffff rc 0/-1",
        "https://github.com/jade-hpc-gpu/jade-hpc-gpu.github.io/issues/14",
    ),
    Quote(
        "lustre-error",
        "[Mon Oct 16 09:54:43 2017] LNet: 2431:0:(o2iblnd_cb.c:3174:kiblnd_check_conns()) Timed out tx for 172.31.126.87@o2ib: 403055 seconds",
        "https://github.com/jade-hpc-gpu/jade-hpc-gpu.github.io/issues/14",
    ),
    Quote(
        "hung-task-shared-fs",
        "[ 3438.629666] [<80233190>] (filemap_write_and_wait_range) from [<803db1c4>] (nfs_file_fsync+0x30/0x280)",
        "https://github.com/raspberrypi/linux/issues/2482",
    ),
    Quote(
        "hung-task-shared-fs",
        "[ 3600.851751]  [<ffffffffc05523b4>] llog_process_or_fork+0x244/0x450 [obdclass]",
        "https://github.com/whamcloud/integrated-manager-for-lustre/pull/329",
    ),
    # --- training-framework signals ---------------------------------------------------------
    Quote(
        "megatron-rerun-nan",
        "ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 3 at iteration #3 invocation #2 (message='found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication collective')",
        "https://github.com/NVIDIA/Megatron-LM/issues/5026",
    ),
    Quote(
        "megatron-rerun-nan",
        # quoted up to "(nan = nan)."; the line goes on "Need to rerun on a different GPU ..."
        "ERROR:megatron.core.rerun_state_machine:Rank 3, node core-ci-test-1779833921-task-1-0, device 3, iteration #3: First rerun: unexpected result is reproducible within the tolerance (nan = nan).",
        "https://github.com/NVIDIA/Megatron-LM/issues/5026",
    ),
    Quote(
        "megatron-rerun-hardware",
        "Rank 3, node node-7, device 3, iteration #1200: Possible transient error!!",
        MEGATRON_RSM,
        real=False,
    ),
    Quote(
        "megatron-rerun-correct",
        "Rank 5, node node-2, device 5, iteration #1200: Correct result (but possible Application error) (loss is NaN)!",
        MEGATRON_RSM,
        real=False,
    ),
    Quote(
        "loss-scale-minimum",
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        "https://github.com/ymcui/Chinese-LLaMA-Alpaca/issues/534 (title)",
    ),
    Quote(
        "fp16-overflow-skip",
        "[2024-09-11 17:52:18,030] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 4294967296, reducing to 2147483648",
        "https://github.com/zai-org/CogVideo/issues/233",
    ),
    Quote(
        "fp16-overflow-skip",
        "[2021-06-08 12:02:45,001] [INFO] [stage3.py:2323:_overflow_clean_up] [deepscale] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 16777216.0, reducing to 8388608.0",
        "https://github.com/dredwardhyde/gpt-neo-fine-tuning-example/issues/7",
    ),
    Quote(
        "fp16-overflow-skip",
        "[2023-04-28 06:51:29,903] [INFO] [loss_scaler.py:188:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. Reducing hysteresis to 1",
        "https://github.com/deepspeedai/DeepSpeed/issues/931",
    ),
    Quote(
        "fp16-overflow-skip",
        "[2022-07-05 16:29:55,795] [INFO] [logging.py:69:log_dist] [Rank 0] Overflow detected. Skipping step. Attempted loss scale: 268435456.0, reducing to 134217728.0",
        "https://github.com/deepspeedai/DeepSpeed/issues/2069",
    ),
    Quote(
        "fp16-overflow-skip",
        "[2022-07-05 16:29:55,795] [INFO] [fused_optimizer.py:383:_update_scale] Reducing dynamic loss scale from 268435456.0 to 134217728.0",
        "https://github.com/deepspeedai/DeepSpeed/issues/2069",
    ),
    Quote(
        "fp16-overflow-skip",
        "Grad overflow on iteration 5",
        "https://github.com/deepspeedai/DeepSpeed/issues/2069",
    ),
    Quote(
        "lazy-import-failed",
        "RuntimeError: Failed to import transformers.models.t5.modeling_t5 because of the following error (look up to see its traceback):",
        "https://github.com/huggingface/transformers/issues/21293",
    ),
    Quote(
        "lazy-import-failed",
        "RuntimeError: Failed to import transformers.trainer because of the following error (look up to see its traceback):",
        "https://github.com/project-baize/baize-chatbot/issues/24",
    ),
]

#: rows added for issue #41; each must be quoted above (import-time-error: see test_verdict.py,
#: where whole real tracebacks exercise it).
NEW_ROWS = {
    "nvrm-gsp-timeout",
    "nvrm-pmu-halt",
    "nvidia-probe-failed",
    "nvrm-gpu-lost",
    "gpu-memory-no-xid",
    "gpu-memory-remap-pending",
    "nvrm-info",
    "nvrm-unknown",
    "xid-chain",
    "sxid",
    "sxid-fatal",
    "ofi-network-error",
    "ib-completion-error",
    "slurm-node-failure",
    "nfs-not-responding",
    "lustre-error",
    "hung-task-shared-fs",
    "megatron-rerun-nan",
    "megatron-rerun-hardware",
    "megatron-rerun-correct",
    "loss-scale-minimum",
    "fp16-overflow-skip",
    "lazy-import-failed",
}
#: rows whose only lines are built from the program's format (no printed line found in public).
CONSTRUCTED_ONLY = {
    "gpu-memory-no-xid",
    "gpu-memory-remap-pending",
    "sxid-fatal",
    "megatron-rerun-hardware",
    "megatron-rerun-correct",
}


def _where(rule: Rule) -> dict[str, bool]:
    return {
        "in_traceback": rule.context in ("traceback", "import"),
        "in_import": rule.context == "import",
        "in_kernel_trace": rule.context == "kernel_trace",
    }


@pytest.mark.parametrize("q", QUOTES, ids=[f"{q.rule}-{i}" for i, q in enumerate(QUOTES)])
def test_quoted_line_matches_its_row(q: Quote) -> None:
    assert q.source
    m = TABLE.match_line(q.line, **_where(TABLE.get(q.rule)))
    assert m is not None and m.rule.id == q.rule, (q.line, m and m.rule.id)


def test_every_new_row_has_a_real_line() -> None:
    quoted = {q.rule for q in QUOTES}
    real = {q.rule for q in QUOTES if q.real}
    assert quoted >= NEW_ROWS
    assert NEW_ROWS - real == CONSTRUCTED_ONLY


def test_gpu_faults_without_xid_act_on_the_gpu() -> None:
    for rid in ("nvrm-gsp-timeout", "nvrm-pmu-halt", "nvidia-probe-failed", "gpu-memory-no-xid"):
        assert TABLE.get(rid).action is Action.EVICT, rid
    unknown = TABLE.match_line("NVRM: something this table has never seen")
    assert unknown is not None and (unknown.rule.id, unknown.rule.action) == ("nvrm-unknown", Action.DIAGNOSE)
    assert TABLE.get("nvrm-unknown").secondary


def test_xid_chain_is_judged_by_its_cause() -> None:
    c = LogClassifier().classify(
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149"
    )
    assert (c.rule, c.action, c.category) == ("xid-chain", Action.EVICT, "nvlink_error")
    assert (c.fields["xid"], c.fields["caused_by"], c.fields["catalog_bucket"]) == (45, 149, "reset_gpu")
    plain = LogClassifier().classify("NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001")
    assert (plain.rule, plain.action) == ("xid-45", Action.IGNORE)
    app = LogClassifier().classify(
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=p, Ch 1 caused by previous Xid 13"
    )
    assert (app.action, app.category) == (Action.RESTART, "gpu_app_fault")
    unlisted = LogClassifier().classify(
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1, name=p, caused by previous Xid 999"
    )
    assert (unlisted.rule, unlisted.action, unlisted.category) == ("xid-chain", Action.DIAGNOSE, "xid")


def test_ib_completion_formats_extract_status_and_vendor_error() -> None:
    got = []
    for q in QUOTES:
        if q.rule == "ib-completion-error":
            m = TABLE.match_line(q.line)
            assert m is not None
            got.append((m.fields.get("status"), m.fields.get("vendor_err")))
    assert got == [(12, 129), (12, 129), (12, 129), (5, 249), (5, 244)]


def test_sxid_severity_decides() -> None:
    fatal = TABLE.match_line("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 3 egress error")
    assert fatal is not None and fatal.rule.action is Action.EVICT and fatal.fields["sxid"] == 12028
    clf = LogClassifier()
    non_fatal = clf.classify(QUOTES_BY_RULE["sxid"][0], ts=0.0)
    assert (non_fatal.rule, non_fatal.action) == ("sxid", Action.IGNORE)


def test_hung_task_in_a_shared_filesystem_is_storage() -> None:
    """The hung-task line, then its call trace (real lines, raspberrypi/linux#2482, in order)."""
    lines = [
        "[ 3438.580109] INFO: task objcopy:24916 blocked for more than 120 seconds.",
        "[ 3438.583905]       Tainted: G         C      4.14.31-1-ARCH #1",
        '[ 3438.587697] "echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
        "[ 3438.595231] objcopy         D    0 24916  24912 0x00000000",
        "[ 3438.599109] [<80a87848>] (__schedule) from [<80a88018>] (schedule+0x3c/0xa0)",
        "[ 3438.603019] [<80a88018>] (schedule) from [<8015c138>] (io_schedule+0x14/0x3c)",
        "[ 3438.629666] [<80233190>] (filemap_write_and_wait_range) from [<803db1c4>] (nfs_file_fsync+0x30/0x280)",
    ]
    clf = LogClassifier()
    out = [clf.feed(line, host="n1") for line in lines]
    assert [(c.rule, c.action) for c in out if c.rule] == [
        ("hung-task", Action.DIAGNOSE),
        ("hung-task-shared-fs", Action.DIAGNOSE),
    ]
    assert out[-1].fields["function"] == "nfs_file_fsync" and out[-1].category == "filesystem_mount"
    # The same frame without a hung task before it is just a line.
    assert LogClassifier().feed(lines[-1], host="n1").rule is None


def test_megatron_and_fp16_signals() -> None:
    nan = TABLE.get("megatron-rerun-nan")
    assert (nan.action, nan.category) == (Action.DIAGNOSE, "nan_value")
    assert TABLE.get("fp16-overflow-skip").action is Action.IGNORE
    assert TABLE.get("loss-scale-minimum").action is Action.DIAGNOSE
    # DeepSpeed raises the loss-scale exception at the end of a traceback: the row still wins.
    tb = [
        "Traceback (most recent call last):",
        '  File "/workspace/train.py", line 10, in <module>',
        "    engine.step()",
        '  File "/usr/local/lib/python3.10/site-packages/deepspeed/runtime/fp16/loss_scaler.py", line 170, in update_scale',
        "    raise Exception(",
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
    ]
    clf = LogClassifier()
    assert [clf.feed(line) for line in tb][-1].rule == "loss-scale-minimum"


QUOTES_BY_RULE: dict[str, list[str]] = {}
for _q in QUOTES:
    QUOTES_BY_RULE.setdefault(_q.rule, []).append(_q.line)
