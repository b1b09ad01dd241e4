-- Every per-step mean, maximum, count and ratio of kldiag's `steps` table (docs/metrics.md)
-- that SQL computes exactly: all but the histogram quantiles (p50..p999). bench/analyze.py
-- checks that the result equals kldiag's, column by column, before timing it.
-- Same semantics: masked tokens; a mean over the tokens whose value is finite; log-probs
-- that are null mean absent (logp_old null: on-policy, x = 0).
WITH t AS (
  SELECT step, seq, mask, advantage::DOUBLE AS adv, logp::DOUBLE AS s,
         COALESCE(logp_old, logp)::DOUBLE AS o, logp_ref::DOUBLE AS r, logp_sampler::DOUBLE AS m,
         NOT (isfinite(logp) AND COALESCE(isfinite(logp_old), true) AND COALESCE(isfinite(logp_ref), true)
              AND COALESCE(isfinite(logp_sampler), true)) AS nonfinite,
         -- DuckDB orders NaN above every number: NaN > 0 is true there, not in IEEE
         COALESCE(logp > 0 AND NOT isnan(logp), false) OR COALESCE(logp_old > 0 AND NOT isnan(logp_old), false)
           OR COALESCE(logp_ref > 0 AND NOT isnan(logp_ref), false)
           OR COALESCE(logp_sampler > 0 AND NOT isnan(logp_sampler), false) AS invalid
  FROM read_parquet('{glob}')
), u AS (
  SELECT step, seq, mask, adv, nonfinite, invalid,
         CASE WHEN mask AND isfinite(r - s) THEN r - s END AS d,
         CASE WHEN mask AND isfinite(s - o) THEN s - o END AS x,
         CASE WHEN mask AND isfinite(o - m) THEN o - m END AS z,
         CASE WHEN mask THEN COALESCE(m, o) - s END AS y
  FROM t
), v AS (
  SELECT step, seq, mask, adv, nonfinite, invalid, d, x, y, exp(d) - 1 - d AS k3, abs(exp(d) - 1) AS w,
         exp(x) AS rho, exp(z) - 1 - z AS kz
  FROM u
), tok AS (
  SELECT step, seq, mask::INT AS mask, adv, nonfinite::INT AS nonfinite, invalid::INT AS invalid, d, x, y,
         w, rho * abs(d) AS w_is, rho,
         CASE WHEN isfinite(k3) THEN k3 END AS k3, CASE WHEN isfinite(w) THEN w END AS wf,
         CASE WHEN isfinite(rho * k3) THEN rho * k3 END AS k3_is,
         CASE WHEN isfinite(rho * abs(d)) THEN rho * abs(d) END AS w_isf,
         CASE WHEN isfinite(rho) THEN rho END AS rhof, CASE WHEN isfinite(rho * rho) THEN rho * rho END AS rho2f,
         CASE WHEN isfinite(kz) THEN kz END AS kz,
         (COALESCE(d > ln({tau}), false) OR (mask AND (COALESCE(w > {limit}, false)
           OR COALESCE(k3 > {clamp}, false) OR nonfinite OR invalid)))::INT AS flagged
  FROM v
), seqs AS (  -- DeepSeek's off-policy sequence mask, per sequence
  SELECT step, avg(CASE WHEN isfinite(adv) THEN adv END) AS adv,
         coalesce(sum(CASE WHEN isfinite(y) THEN y END), 0) / greatest(sum(mask), 1) AS y_mean
  FROM tok GROUP BY step, seq
), opsm AS (
  SELECT step, avg((adv < 0 AND y_mean > {delta})::INT) FILTER (WHERE adv IS NOT NULL) AS opsm_masked_frac
  FROM seqs GROUP BY step
), steps AS (
  SELECT step, sum(mask) AS tokens,
    avg(-d) AS k1_mean, avg(0.5 * d * d) AS k2_mean, avg(k3) AS k3_mean, avg(k3_is) AS k3_is_mean,
    avg(wf) AS weight_k3_abs_mean, max(w) AS weight_k3_abs_max,
    avg(w_isf) AS weight_k3_is_abs_mean, max(w_is) AS weight_k3_is_abs_max,
    coalesce(sum(wf * flagged), 0) / sum(wf) AS blame_share,
    sum((d > ln({tau}))::INT) AS theta_ll_ref_count,
    sum((w > {limit})::INT) AS weight_blowup_count, sum((k3 > {clamp})::INT) AS clamp_saturated_count,
    sum(nonfinite) AS nonfinite_count, sum(invalid) AS invalid_count, sum(flagged) / sum(mask) AS flagged_frac,
    avg(rhof) AS rho_mean, min(rho) AS rho_min, max(rho) AS rho_max,
    sum(rhof) ^ 2 / (count(rhof) * sum(rho2f)) AS rho_ess,
    sum((rho < {clip_lo} OR rho > {clip_hi})::INT) / count(x) AS rho_clip_frac,
    avg(abs(x)) AS drift_abs_mean, avg(kz) AS mismatch_kl
  FROM tok GROUP BY step
)
SELECT * FROM steps JOIN opsm USING (step) ORDER BY step
