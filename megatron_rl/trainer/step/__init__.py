"""One RL step's phases: the batch (`rl_batch`, `step_plan`), old-policy and reference scores, the critic's values
and advantages, the updates and their loss, the step's metrics; `rl_step` runs them in order."""
