-- name: node_checks
-- answers: Node test runs (preflights before jobs) that did not pass, newest first: which node,
-- answers: when, for which scheduler job, what was found and what was done to the node
-- answers: (drained, cordoned, warned).  failed_only = 0 lists the passing runs too.
-- param: node String = ''          the node ('' for every node)
-- param: since_ms Int64 = 0        only checks at or after this Unix time (ms)
-- param: failed_only Int32 = 1     1: failed and error runs only; 0: every run
-- param: limit Int64 = 100         at most this many runs
SELECT node, ts_ms, origin, job, level, outcome, action, policy, failed_tests, reason
FROM node_checks FINAL
WHERE (%(node)s = '' OR node = %(node)s)
  AND ts_ms >= %(since_ms)s
  AND (%(failed_only)s = 0 OR outcome != 'passed')
ORDER BY ts_ms DESC, node
LIMIT %(limit)s
