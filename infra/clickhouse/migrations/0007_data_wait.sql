-- Per step, the time the training loop waited for its batch (TrainingStep.data_wait_s): with
-- step_time_s, the fraction of a step a slow data loader starved compute.  Null for steps of
-- reporters that do not measure it (older ones included).

ALTER TABLE training_steps ADD COLUMN data_wait_s Nullable(Float64);
