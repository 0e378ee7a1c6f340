-- name: mttr_by_category
-- answers: Mean and worst time to recover (fault's first sign to the recovery's success) per
-- answers: fault category (the decision's action where the detection named none), with how many
-- answers: incidents there were and how many recovered.
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only incidents decided at or after this Unix time (ms)
SELECT
    if(category = '', action, category) AS fault,
    count() AS incidents,
    countIf(outcome = 'succeeded') AS recovered,
    round(avgIf(ifNull(recovered_s, 0), outcome = 'succeeded'), 3) AS mttr_s,
    round(maxIf(ifNull(recovered_s, 0), outcome = 'succeeded'), 3) AS worst_s
FROM ({{incidents}})
WHERE action NOT IN ('aggregate', 'none', 'ignore')
GROUP BY fault
ORDER BY fault
