"""Validation's estimate (`estimates.render`): an image family decodes with its 2D VAE, and the render plan is the
least the card needs added.
"""

from __future__ import annotations

import torch

from loraflow import estimates
from loraflow.estimates import fake_tensors
from loraflow.pipelines import get_family
from tests.estimates.measured import GIB


def test_validation_of_an_image_family_decodes_with_its_2d_vae() -> None:
    """Kandinsky 5 Image renders through the Flux VAE, a 2D one: the estimate decodes the latent as its pipeline
    does, (B, C, h, w), at the released configs (a small render: the fake step costs seconds)."""
    from loraflow.config import parse_config
    from loraflow.pipelines.released import released_config

    config = parse_config({"model_family": "kandinsky5-image", "pretrained_model_name_or_path": "org/model",
                           "validation_resolution": "64x64",
                           "datasets": [{"id": "i", "dataset_type": "image", "instance_data_dir": "images"}]})
    configs = {c: released_config(config.flavour.name, c) for c in ("transformer", "vae")}
    (stage,) = estimates.estimate(config, get_family(config), configs, (1, 64, 64), stages=("validation",))
    vae_weights = estimates.weights_bytes(fake_tensors.meta_model(configs["vae"], torch.float32))
    assert stage.parts["weights"] > vae_weights > 0 and stage.parts["activations"] > 0

def test_the_render_plan_is_the_least_added_that_fits_the_card() -> None:
    """`render_plan` on phases of round sizes (GiB): transformer 10 (8 blocks of 1), VAE 1, one denoise call 4, the
    decode 30 whole and 6 tiled. With a card the transformer and the VAE always take turns on it (parked: never on it
    together); each swapped block but the one computing leaves it."""
    from loraflow.config import parse_config
    from loraflow.pipelines.render_memory import RenderPlan

    phases = estimates.RenderPhases(transformer=10 * GIB, blocks=[GIB] * 8, lora=0, vae=GIB, denoise=4 * GIB,
                                    decode=30 * GIB, decode_tiled=6 * GIB, tflop=0.0)
    config = parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": "m",
                           "base_model_precision": "bf16", "datasets": [{"id": "d", "instance_data_dir": "x"}]})

    def card(usable_gib: float) -> float:  # the card whose usable share is this
        return (usable_gib * GIB + estimates.CUDA_CONTEXT) / estimates.FIT_SHARE / GIB

    asked = RenderPlan(precision="bf16", kept="bf16")
    assert estimates.render_plan(config, phases, None) == asked  # no card: what the config asks
    parked = RenderPlan(precision="bf16", kept="bf16", park=True)
    assert estimates.render_plan(config, phases, card(45)) == parked  # 10 + 4 and 1 + 30 fit
    assert estimates.render_plan(config, phases, card(31)) == parked  # the decode, 1 + 30, is the peak
    # denoise 10 + 4, decode 1 + 6: parked and tiled, nothing swapped
    assert estimates.render_plan(config, phases, card(16)) == RenderPlan("bf16", "bf16", vae_tiling=True, park=True)
    # denoise fits at 10 resident - (5 - 1) swapped + 4: five blocks swapped
    assert estimates.render_plan(config, phases, card(10)) == RenderPlan("bf16", "bf16", 5, vae_tiling=True,
                                                                       park=True)
    assert estimates.render_plan(config, phases, card(10)).describe() == (
        "transformer bf16, 5 blocks swapped, VAE tiled, transformer and VAE take turns on the GPU")
    tiled = config.model_copy(update={"vae_enable_tiling": True})
    assert estimates.render_plan(tiled, phases, card(45)) == RenderPlan("bf16", "bf16", vae_tiling=True, park=True)
    none_fits = estimates.render_plan(config, phases, card(1))
    assert none_fits.offload_all and none_fits.park and none_fits.vae_tiling  # the least memory there is
    # the denoise: the 2 outside the blocks, the block computing and the next one (prefetched on a CUDA stream), 4
    assert phases.estimate(none_fits).peak_bytes == 8 * GIB
