"""The end-to-end demo's real training workload: a tiny 3D-parallel GPT on a simulated cluster.

A "cluster" is a directory: ``<cluster_dir>/machines/<name>/`` is one machine's local disk, and a
machine runs ``ranks_per_machine`` rank processes on this host.  The job is a real PyTorch gloo
job with TP (column/row-parallel linears), PP (send/recv between stages) and DP (gradient
all-reduce), every-step asynchronous checkpoints backed up on a cross-parallel-group peer
machine (ByteRobust §6.3), fault hooks driven by a per-machine ``faults.json`` (§4 fault kinds)
and warm standby processes (§6.2).

Modules: :mod:`.config` (job spec, cluster paths), :mod:`.corpus` (generated text), :mod:`.model`
and :mod:`.parallel` (the model and its process groups), :mod:`.data`, :mod:`.checkpoint`,
:mod:`.faults`, :mod:`.codever` (code version switch / rollback), :mod:`.trainer` (a rank, CLI),
:mod:`.standby` (warm standby process) and :mod:`.launcher` (start/stop a job's processes).
"""
