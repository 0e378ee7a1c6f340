-- name: node_transitions
-- answers: Each change of an evicted node's state on its way back into service (evicted,
-- answers: awaiting_repair, validating, returned, quarantined), oldest first: what caused it
-- answers: (eviction, repaired, validation_passed/failed, quarantine, released) and who (an
-- answers: operator, the eviction's decision id, the validation's check id).
-- param: node String = ''          the node ('' for every node)
-- param: since_ms Int64 = 0        only transitions at or after this Unix time (ms)
-- param: limit Int64 = 1000        at most this many transitions
SELECT node, ts_ms, from_state, to_state, cause, by, detail
FROM node_transitions FINAL
WHERE (%(node)s = '' OR node = %(node)s)
  AND ts_ms >= %(since_ms)s
ORDER BY node, ts_ms, seq
LIMIT %(limit)s
