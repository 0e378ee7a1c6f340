"""The node exporter: every signal ByteRobust's Robust Agent watches, published to Kafka.

One process per training machine (``trainguard exporter``).  Sources (``sources/``) sample the
machine; :mod:`.delivery` spools every event to disk and ships it to Kafka; :mod:`.commands`
follows the node's command topic (stack captures, interval changes).  Nothing here imports faust.
"""
