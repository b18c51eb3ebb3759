"""The lora stage: a training run. Here the run itself (`run`, `loop`, `model_setup`, `batches`, `row_cache`,
`checkpoints`); in `options/` what a run can switch on (adapter kinds, optimizers, EMA, CREPA, progress renders,
tracking); in `launch/` how a run spans processes (torch.distributed, the loopback launcher)."""
