-- name: mttr_by_category
-- answers: Mean and worst time to recover (the fault's first sign to the job's first training
-- answers: step after its recovery) per fault category (the decision's action where the
-- answers: detection named none), with how many incidents there were, how many are training
-- answers: again, and the mean of their recovery procedures alone (decision to the procedure's end).
-- param: job String = ''         the job ('' for every job)
-- param: since_ms Int64 = 0      only incidents decided at or after this Unix time (ms)
SELECT
    if(category = '', action, category) AS fault,
    count() AS incidents,
    countIf(isNotNull(recovered_s)) AS recovered,
    round(avgIf(ifNull(recovered_s, 0), isNotNull(recovered_s)), 3) AS mttr_s,
    round(maxIf(ifNull(recovered_s, 0), isNotNull(recovered_s)), 3) AS worst_s,
    round(avgIf(ifNull(procedure_s, 0), isNotNull(recovered_s)), 3) AS procedure_s
FROM ({{incidents}})
WHERE action NOT IN ('aggregate', 'none', 'ignore')
GROUP BY fault
ORDER BY fault
