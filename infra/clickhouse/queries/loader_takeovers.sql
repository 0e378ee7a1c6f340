-- name: loader_takeovers
-- answers: What the ranks' shadow loaders did: each takeover (a hung or dead data loader replaced
-- answers: in place on the same data position: how long the rank waited and how long the takeover
-- answers: took), each give-up (loader after loader failed: the machine or the data source) and each
-- answers: standby loader that failed to start -- by node and rank.  None of them is a decision.
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only events at or after this Unix time (ms, the rank's clock)
SELECT source_ts_ms AS ts_ms, job, node,
       visitParamExtractInt(evidence, 'rank') AS rank,
       category AS event,
       visitParamExtractString(evidence, 'reason') AS reason,
       toFloat64OrZero(replaceAll(visitParamExtractRaw(evidence, 'stalled_s'), '"', '')) AS stalled_s,
       toFloat64OrZero(replaceAll(visitParamExtractRaw(evidence, 'takeover_s'), '"', '')) AS takeover_s,
       visitParamExtractString(evidence, 'line') AS line
FROM detections FINAL
WHERE (%(job)s = '' OR job = %(job)s) AND source_ts_ms >= %(since_ms)s
  AND category IN ('loader_takeover', 'loader_failed', 'loader_standby_failed')
ORDER BY ts_ms, node
