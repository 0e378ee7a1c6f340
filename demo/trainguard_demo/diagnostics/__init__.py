"""Stop-time diagnostics of the demo cluster: the tests (:mod:`.tests`), the torch-preloading
fork server that runs them (:mod:`.server`) and the comparison across machines (:mod:`.runner`)."""

from trainguard_demo.diagnostics.runner import LOCAL_TESTS, LocalFaults, free_port, ring_pairs, run_local
from trainguard_demo.diagnostics.server import prewarm
from trainguard_demo.diagnostics.tests import alignment_digest

__all__ = [
    "LOCAL_TESTS",
    "LocalFaults",
    "alignment_digest",
    "free_port",
    "prewarm",
    "ring_pairs",
    "run_local",
]
