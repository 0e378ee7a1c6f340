"""KafkaConfig -> keyword arguments and credentials for aiokafka and Faust.

The translation itself (names, SASL, TLS as an ``ssl.SSLContext``) lives in
:meth:`trainguard.infra.config.KafkaConfig.client_kwargs`, shared with the kafka-python clients, so TLS/SASL
settings mean the same thing for every client; this module only adds Faust's broker URL form.
"""

from __future__ import annotations

from typing import Any

from trainguard.infra.config import KafkaConfig


def aiokafka_kwargs(cfg: KafkaConfig) -> dict[str, Any]:
    return cfg.client_kwargs("aiokafka")


def faust_broker(cfg: KafkaConfig) -> tuple[str, Any]:
    """Faust's ``broker`` URL list and ``broker_credentials``."""
    import faust

    url = ";".join(f"kafka://{s}" for s in cfg.servers)
    ctx = cfg.ssl_context()
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
