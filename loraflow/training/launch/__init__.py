"""Launching a training run across processes: torch.distributed setup and the local multi-process launcher."""
