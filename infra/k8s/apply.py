"""Server-side apply of Kubernetes manifests (files, or a kustomize base's resource list).

What ``kubectl apply --server-side [-k DIR] [--dry-run=server]`` does, through the Python client's
dynamic client, so the stack and the tests need no kubectl of the right version: every document is
sent as an apply patch under one field manager (idempotent; the server merges and validates).
A kustomize directory is read by its ``resources:`` list only (plain files and sub-directories);
anything kustomize would transform (patches, generators, name prefixes) is refused, not ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

FIELD_MANAGER = "trainguard"
#: kustomization keys this reader honours; any other key would change the objects.
_KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "labels", "commonAnnotations"}


class ManifestError(ValueError):
    """A manifest file this reader cannot apply as written."""


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The objects of a YAML file, or of a kustomize directory (its ``resources`` in order)."""
    if path.is_dir():
        kfile = path / "kustomization.yaml"
        if not kfile.exists():
            raise ManifestError(f"{path}: no kustomization.yaml")
        k = yaml.safe_load(kfile.read_text()) or {}
        extra = set(k) - _KUSTOMIZE_KEYS
        if extra:
            raise ManifestError(
                f"{kfile}: keys {sorted(extra)} are not supported by this reader; use kubectl -k"
            )
        if k.get("labels") or k.get("commonAnnotations"):
            raise ManifestError(f"{kfile}: labels/commonAnnotations are not supported by this reader")
        docs: list[dict[str, Any]] = []
        for res in k.get("resources") or []:
            docs += load_documents(path / res)
        return docs
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise ManifestError(f"{path}: a document without apiVersion/kind")
    return docs


def apply_documents(
    api_client: Any, docs: Iterable[dict[str, Any]], dry_run: bool = False, force: bool = True
) -> list[str]:
    """Server-side apply each object; returns ``kind/namespace/name`` of each, in order."""
    from kubernetes.dynamic import DynamicClient

    dyn = DynamicClient(api_client)
    done = []
    for doc in docs:
        res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        meta = doc.get("metadata") or {}
        kwargs: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force_conflicts": force}
        if dry_run:
            kwargs["dry_run"] = "All"
        dyn.server_side_apply(res, body=doc, namespace=meta.get("namespace"), **kwargs)
        done.append(f"{doc['kind']}/{meta.get('namespace', '')}/{meta.get('name', '')}")
    return done
