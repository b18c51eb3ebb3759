"""The optimizer of a training run (`optimizer`, `loraplus_lr_ratio`), each from its maintained package.

    adamw               torch.optim.AdamW                    adamw_bf16  kernels/adamw_bf16.py
    muon                torch.optim.Muon (torch >= 2.9) over the 2-D LoRA matrices (every LoRA parameter is one;
                        the config refuses it beside CREPA's projector, whose biases would need AdamW), with
                        `match_rms_adamw` scaling so AdamW's learning rate and weight decay carry over
    prodigy             prodigyopt.Prodigy: learning_rate multiplies the step size it estimates (use 1.0)
    adamw_schedulefree  schedulefree.AdamWScheduleFree: trains at the interpolated point y; the averaged weights
                        x (what is exported and rendered) come from `eval()`. Checkpoints keep y and its state,
                        so a resume continues exactly whatever the checkpoint interval
LoRA+ (musubi-tuner's loraplus_lr_ratio): the lora_B matrices form a parameter group whose learning rate is the
step's lr times the ratio (`set_lr`). peft's `create_loraplus_optimizer` builds such groups too, but sets their lr
once: the per-step warmup/cosine lr of training would overwrite it, and CREPA's projector is not in the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from loraflow.config import LoraflowConfig
from loraflow.kernels.adamw_bf16 import AdamWBF16

WEIGHT_DECAY = 1e-2


def make_optimizer(config: LoraflowConfig, params: list[torch.nn.Parameter],
                   transformer: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """The configured optimizer over `params`, in train mode; LoRA+ finds the lora_B matrices in `transformer`."""
    groups: list = params
    if config.loraplus_lr_ratio is not None:
        named = transformer.named_parameters() if transformer is not None else ()
        b = {id(p) for name, p in named if "lora_B" in name}
        groups = [{"params": [p for p in params if id(p) not in b]},
                  {"params": [p for p in params if id(p) in b], "lr_ratio": config.loraplus_lr_ratio}]
    lr = config.learning_rate
    if config.optimizer == "adamw_bf16":
        return AdamWBF16(groups, lr=lr, weight_decay=WEIGHT_DECAY, seed=config.seed)
    if config.optimizer == "muon":
        return torch.optim.Muon(groups, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw")
    if config.optimizer == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(groups, lr=lr, weight_decay=WEIGHT_DECAY)
    if config.optimizer == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree

        optimizer = AdamWScheduleFree(groups, lr=lr, weight_decay=WEIGHT_DECAY)
        optimizer.train()
        return optimizer
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WEIGHT_DECAY)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate in every group; LoRA+'s B group gets it times its ratio."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr


def exported(optimizer: torch.optim.Optimizer) -> None:
    """Schedule-free: the parameters become the averaged weights x for good (after the last step)."""
    if hasattr(optimizer, "eval"):
        optimizer.eval()


@contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Schedule-free: x in the parameters for a render during training, then y back bit for bit (eval() then
    train() would round differently), so rendering changes no number of the run."""
    if not hasattr(optimizer, "eval"):
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, y in zip(params, kept):
                p.copy_(y)
        for group in optimizer.param_groups:
            group["train_mode"] = True

