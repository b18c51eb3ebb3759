"""The peers' loss types, optimizer options and flow schedules, under their own names (SimpleTuner's where it has
one, musubi-tuner's otherwise): part of the one config model (`LoraflowConfig` inherits these fields). Each is off
by default and `when_set`: a run that does not use it keeps the key and the numbers it had before it existed.
Computed in kernels/losses.py, kernels/flow_matching.py and training/options/optimizers.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from loraflow.config.run_key import StrictModel, setting


class TrainingOptions(StrictModel):
    """Loss (SimpleTuner), LoRA+ (musubi-tuner), flow schedules (SimpleTuner; the timestep range: musubi-tuner)."""

    loss_type: Literal["l2", "huber", "smooth_l1"] = setting(
        "l2", run_key="when_set", description="the flow loss: l2 (MSE); huber: 2c(sqrt(r^2+c^2)-c), ~r^2 below c "
        "and linear above; smooth_l1: the same divided by c (kernels/losses.py)")
    huber_c: float = setting(0.1, run_key="when_set", gt=0, le=1, description="huber/smooth_l1: the transition c")
    huber_schedule: Literal["snr", "exponential", "constant"] = setting(
        "snr", run_key="when_set", description="huber/smooth_l1: c per sample from its sigma; snr: "
        "(1-c)/(1+sqrt((1-sigma)/sigma))^2 + c; exponential: c**sigma; constant: c")
    loraplus_lr_ratio: float | None = setting(
        None, run_key="when_set", gt=0, description="LoRA+: the lora_B matrices learn at learning_rate times this "
        "(musubi-tuner's name; its paper suggests 16); unset: one learning rate")
    flow_use_beta_schedule: bool = setting(
        False, run_key="when_set", description="draw training sigmas from Beta(alpha, beta) instead of "
        "flow_sigma_sampling (then shifted as usual)")
    flow_beta_schedule_alpha: float = setting(2.0, run_key="when_set", gt=0)
    flow_beta_schedule_beta: float = setting(2.0, run_key="when_set", gt=0)
    flow_schedule_auto_shift: bool = setting(
        False, run_key="when_set", description="shift from each batch's token count as SimpleTuner computes it: "
        "exp(mu), mu linear from 0.5 at 256 to 1.15 at 4096 latent tokens (frames x h/2 x w/2); needs "
        "flow_schedule_shift unset")
    min_timestep: int | None = setting(
        None, run_key="when_set", ge=0, le=999, description="musubi-tuner's range: shifted sigmas are mapped "
        "linearly onto [min_timestep, max_timestep] / 1000; default 0")
    max_timestep: int | None = setting(None, run_key="when_set", ge=1, le=1000, description="default 1000")
    # SimpleTuner's names (its default clips per value: `import-simpletuner` writes it where a config leaves it unset)
    grad_clip_method: Literal["norm", "value"] = setting(
        "norm", run_key="when_set", description="norm: scale the gradient down to a total norm of max_grad_norm; "
        "value: clamp each gradient element to [-max_grad_norm, max_grad_norm] (SimpleTuner's default, "
        "torch.nn.utils.clip_grad_value_)")
    peft_lora_target_modules: tuple[str, ...] | None = setting(
        None, run_key="when_set", description="lora_type standard: the module-name suffixes peft adapts (its "
        "`target_modules`) instead of the family's attention projections, e.g. SimpleTuner's Kandinsky 5 "
        "[to_key, to_query, to_value]; unset: the family's (docs/families.md)")

    @model_validator(mode="after")
    def _schedules(self) -> TrainingOptions:
        sampling = getattr(self, "flow_sigma_sampling", "sigmoid")  # LoraflowConfig's fields, as these
        if self.flow_use_beta_schedule and sampling != "sigmoid":
            raise ValueError(f"`flow_use_beta_schedule` replaces flow_sigma_sampling {sampling!r}: remove one")
        if self.flow_schedule_auto_shift and getattr(self, "flow_schedule_shift", None) is not None:
            raise ValueError("`flow_schedule_auto_shift` computes the shift that `flow_schedule_shift` sets: remove "
                             "one of them")
        if (self.min_timestep or 0) >= (1000 if self.max_timestep is None else self.max_timestep):
            raise ValueError(f"`min_timestep` {self.min_timestep} must be below `max_timestep` "
                             f"{self.max_timestep or 1000}")
        if self.loraplus_lr_ratio is not None and getattr(self, "optimizer", None) == "prodigy":
            raise ValueError("`loraplus_lr_ratio` with optimizer prodigy: Prodigy estimates one step size for all "
                             "parameters; remove loraplus_lr_ratio or choose another optimizer")
        if getattr(self, "optimizer", None) == "muon" and (getattr(self, "crepa_enabled", False)
                                                           or getattr(self, "fsdp", False)):
            raise ValueError("optimizer muon orthogonalises whole LoRA matrices: not with crepa_enabled (the "
                             "projector trains too) or fsdp (sharded matrices); untested together: choose adamw")
        self._adapter_options()
        return self

    def _adapter_options(self) -> None:
        if self.grad_clip_method == "value" and getattr(self, "fsdp", False):
            raise ValueError("`grad_clip_method: value` with fsdp: the sharded gradients are clipped by norm only "
                             "(SimpleTuner skips value clipping under FSDP): set grad_clip_method: norm")
        targets = self.peft_lora_target_modules
        if targets is None:
            return
        if not targets or any(not t.strip() for t in targets):
            raise ValueError("`peft_lora_target_modules` lists module-name suffixes (e.g. to_query): none may be "
                             "empty; remove the key for the family's own")
        if getattr(self, "lora_type", "standard") != "standard" or getattr(self, "lora_include_ffn", False):
            raise ValueError("`peft_lora_target_modules` names every adapted module of a lora_type standard LoRA: "
                             "not with lora_type lycoris or lora_include_ffn (add the feed-forward's names to the "
                             "list instead)")


def trained_with(config: TrainingOptions) -> dict[str, str]:
    """What trained the adapter, in words, for the `lora` asset's metadata (a LoraflowConfig)."""
    optimizer = getattr(config, "optimizer", "adamw")
    if config.loraplus_lr_ratio is not None:
        optimizer += f" + LoRA+ (lora_B at {config.loraplus_lr_ratio:g} x the learning rate)"
    loss = config.loss_type if config.loss_type == "l2" else \
        f"{config.loss_type} (huber_c {config.huber_c:g}, {config.huber_schedule} schedule)"
    return {"optimizer": optimizer, "loss_type": loss}
