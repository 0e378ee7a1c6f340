"""KafkaConfig -> keyword arguments and credentials for aiokafka and Faust.

kafka-python takes CA/cert file paths; aiokafka and Faust take an ``ssl.SSLContext``.  This is
the one place that translates, so TLS/SASL settings mean the same thing for every client.
"""

from __future__ import annotations

import ssl
from typing import Any

from infra.config import KafkaConfig


def ssl_context(cfg: KafkaConfig) -> ssl.SSLContext | None:
    if cfg.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    ctx = ssl.create_default_context(cafile=cfg.ssl_cafile)
    if cfg.ssl_certfile:
        ctx.load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    return ctx


def aiokafka_kwargs(cfg: KafkaConfig) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "bootstrap_servers": cfg.servers,
        "client_id": cfg.client_id,
        "security_protocol": cfg.security_protocol,
        "request_timeout_ms": cfg.request_timeout_ms,
    }
    if cfg.sasl_mechanism:
        kw.update(
            sasl_mechanism=cfg.sasl_mechanism,
            sasl_plain_username=cfg.sasl_username,
            sasl_plain_password=cfg.sasl_password,
        )
    if (ctx := ssl_context(cfg)) is not None:
        kw["ssl_context"] = ctx
    return kw


def faust_broker(cfg: KafkaConfig) -> tuple[str, Any]:
    """Faust's ``broker`` URL list and ``broker_credentials``."""
    import faust

    url = ";".join(f"kafka://{s}" for s in cfg.servers)
    ctx = ssl_context(cfg)
    creds: Any = None
    if cfg.sasl_mechanism:
        creds = faust.SASLCredentials(
            username=cfg.sasl_username,
            password=cfg.sasl_password,
            mechanism=cfg.sasl_mechanism,
            ssl_context=ctx,
        )
    elif ctx is not None:
        creds = faust.SSLCredentials(ctx)
    return url, creds
