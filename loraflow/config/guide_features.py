"""The seed guides' training features, under SimpleTuner's names: part of the one config model (`LoraflowConfig`
inherits these fields), kept here so loraflow_config.py stays readable. Each is off by default and `when_set`: a run
that does not use it keeps the key it had before the feature existed.
"""

from __future__ import annotations

from typing import Literal

from loraflow.config.run_key import StrictModel, setting


class GuideFeatures(StrictModel):
    """Scheduled sampling (kernels/scheduled_sampling.py) and CREPA (kernels/crepa.py,
    training/options/crepa_training.py)."""

    # Scheduled sampling (SimpleTuner's names, kernels/scheduled_sampling.py): off while max_step_offset is 0
    scheduled_sampling_max_step_offset: int = setting(
        0, run_key="when_set", ge=0, description="longest rollout in timesteps (1/1000 in sigma); 0: off")
    scheduled_sampling_probability: float = setting(
        0.0, run_key="when_set", ge=0, le=1, description="chance a sample is rolled out (without a ramp)")
    scheduled_sampling_ramp_steps: int = setting(
        0, run_key="when_set", ge=0, description="ramp the probability from prob_start to prob_end over N steps")
    scheduled_sampling_start_step: int = setting(0, run_key="when_set", ge=0, description="the ramp's first step")
    scheduled_sampling_prob_start: float | None = setting(
        None, run_key="when_set", ge=0, le=1, description="the ramp's start; default: probability")
    scheduled_sampling_prob_end: float | None = setting(
        None, run_key="when_set", ge=0, le=1, description="the ramp's end; default: probability")
    scheduled_sampling_ramp_shape: Literal["linear", "cosine"] = setting("linear", run_key="when_set")
    scheduled_sampling_strategy: Literal["uniform", "biased_early", "biased_late"] = setting(
        "uniform", run_key="when_set", description="how rollout lengths are drawn in 0..max_step_offset")
    scheduled_sampling_sampler: Literal["euler"] = setting(
        "euler", run_key="when_set", description="the rollout's solver; only euler (the importer maps unipc to it)")

    # CREPA (SimpleTuner's names, kernels/crepa.py): block N's tokens aligned to cached teacher features
    crepa_enabled: bool = setting(False, run_key="when_set", description="add the CREPA term to the flow loss")
    crepa_block_index: int = setting(8, run_key="when_set", ge=0, description="the visual block whose output aligns")
    crepa_lambda: float = setting(0.5, run_key="when_set", ge=0, description="weight of the CREPA term")
    crepa_adjacent_distance: int = setting(
        1, run_key="when_set", ge=0, description="neighbour frames aligned too (0: each frame to its own only)")
    crepa_adjacent_tau: float = setting(1.0, run_key="when_set", gt=0, description="neighbour weight exp(-k / tau)")
    crepa_cumulative_neighbors: bool = setting(
        False, run_key="when_set", description="every neighbour 1..distance, not only the one at distance")
    crepa_normalize_by_frames: bool = setting(True, run_key="when_set", description="divide by the frame count")
    crepa_spatial_align: bool = setting(
        True, run_key="when_set", description="patch-wise alignment (teacher resampled to the token grid); false: "
        "one mean token per frame")
    crepa_encoder: str = setting(
        "dinov2_vitg14", run_key="when_set", description="the teacher's name (a label; the weights come from "
        "crepa_encoder_path)")
    crepa_encoder_path: str | None = setting(
        None, run_key="when_set", description="local folder of the teacher (transformers save_pretrained, DINOv2); "
        "nothing is downloaded")
    crepa_encoder_image_size: int = setting(
        518, run_key="when_set", gt=0, description="frames go to the teacher at this square size")
