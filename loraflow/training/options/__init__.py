"""What a training run can switch on: adapter kinds, optimizers, EMA, CREPA, progress renders, experiment tracking."""
