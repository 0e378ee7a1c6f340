"""Versions of the demo model's "user code" (the MLP activation), switched by :mod:`..codever`.

Each module defines ``activation(x)``.  ``v1`` is the good code; ``v2-buggy`` is a new "fused
kernel" push that raises a ``TypeError`` in the forward, the user-space error ByteRobust answers
with a code rollback (§4.1, §6.4).  ``v3`` is a correct follow-up used to test forward updates.
"""
