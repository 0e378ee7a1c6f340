"""Kubernetes helpers shared by the stack, the ``kubernetes`` executor and the manifests' tests.

``controlplane/`` is not Python: it is the Go module the stack builds its control plane from.
"""
