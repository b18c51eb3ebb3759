"""NABLA attention (Kandinsky 5's 10 s checkpoints): loraflow passes the transformer what the pipeline passes.

The tiny Kandinsky 5 Video checkpoint with its transformer config switched to `attention_type: nabla` (the weights do
not depend on it), loaded through the real `from_pretrained`. The comparison is of the arguments of the real
transformer calls (a forward pre-hook records them), not of outputs: on the CPU, torch's flex attention runs
unfused and applies only a BlockMask's mask_mod, which NABLA leaves empty, so it attends densely and the output
cannot tell a dropped `sparse_params` apart. On a GPU the fused kernel skips the masked blocks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from loraflow.pipelines.kandinsky5.video import family as kandinsky5_video
from loraflow.validation.validate import RenderSettings
from tests.factory import text_rows

SETTINGS = RenderSettings(height=128, width=128, num_frames=5, num_inference_steps=1, guidance=3.0, seed=0,
                          flow_shift=5.0)  # latents (2, 16, 16): 2 x 8 x 8 patches, NABLA's 64-token blocks


def recorded_sparse_params(transformer: torch.nn.Module, call: Any) -> list[dict | None]:
    seen: list[dict | None] = []
    hook = transformer.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs["sparse_params"]),
                                                 with_kwargs=True)
    try:
        call()
    finally:
        hook.remove()
    return seen


def assert_same(ours: dict | None, theirs: dict | None) -> None:
    assert theirs is not None and ours is not None, (ours, theirs)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if torch.is_tensor(value) else ours[key] == value, key


@pytest.mark.parametrize("flavour", ["t2v-lite-sft-5s", "i2v-lite-5s"])
def test_velocity_passes_the_pipelines_nabla_params(nabla_k5: Path, flavour: str) -> None:
    family = kandinsky5_video.make_family(flavour)
    pipe = family.load_renderer(str(nabla_k5), None, torch.device("cpu"))
    prompt, negative = text_rows()
    i2v = "i2v" in flavour
    settings = dataclasses.replace(SETTINGS, num_frames=17) if i2v else SETTINGS  # K5 i2v's minimum
    image = {"image": np.full((settings.height, settings.width, 3), 128, np.uint8)} if i2v else {}
    # the pipeline's own render: it builds sparse_params itself (and runs only with the flex backend we set)
    theirs = recorded_sparse_params(pipe.transformer, lambda: family.render(pipe, prompt, negative, settings,
                                                                            lora_scale=0.0, **image))
    assert len(theirs) == 2  # one step, with and without the prompt
    noisy = torch.randn(1, 16, (settings.num_frames - 1) // 4 + 1, 16, 16, generator=torch.Generator().manual_seed(0))
    text = family.collate_text([prompt], "cpu")
    with torch.no_grad():  # training, eval loss and in-training renders all go through family.velocity
        (ours,) = recorded_sparse_params(
            pipe.transformer, lambda: family.velocity(pipe.transformer, noisy, torch.tensor([0.5]), text))
    assert_same(ours, theirs[0])


def test_a_regular_checkpoint_gets_no_sparse_params(tiny_k5: Path) -> None:
    family = kandinsky5_video.make_family("t2v-lite-sft-5s")
    pipe = family.load_renderer(str(tiny_k5), None, torch.device("cpu"))
    text = family.collate_text([text_rows()[0]], "cpu")
    with torch.no_grad():
        seen = recorded_sparse_params(pipe.transformer, lambda: family.velocity(
            pipe.transformer, torch.zeros(1, 16, 2, 16, 16), torch.tensor([0.5]), text))
    assert seen == [None]


def test_nabla_training_on_the_cpu_fails_with_what_to_do(nabla_k5: Path) -> None:
    family = kandinsky5_video.make_family("t2v-lite-sft-5s")
    pipe = family.load_renderer(str(nabla_k5), None, torch.device("cpu"))
    text = family.collate_text([text_rows()[0]], "cpu")
    with pytest.raises(ValueError, match="trains on CUDA only"):  # flex attention has no CPU backward
        family.velocity(pipe.transformer, torch.zeros(1, 16, 2, 16, 16), torch.tensor([0.5]), text)


def test_flex_attention_stays_with_the_nabla_model(nabla_k5: Path, tiny_k5: Path) -> None:
    """diffusers' set_attention_backend also sets the process-wide default: a regular model loaded next must still
    train on the CPU (flex attention has no CPU backward)."""
    family = kandinsky5_video.make_family("t2v-lite-sft-5s")
    family.load_renderer(str(nabla_k5), None, torch.device("cpu"))
    regular = family.load_renderer(str(tiny_k5), None, torch.device("cpu")).transformer.requires_grad_(True)
    text = family.collate_text([text_rows()[0]], "cpu")
    family.velocity(regular, torch.zeros(1, 16, 2, 16, 16), torch.tensor([0.5]), text).sum().backward()
