"""Real-size dry runs beyond tests/pipelines/test_released_dry_runs.py (whose helpers they use): NABLA attention,
fp8-layerwise training, and a validation render, on the released configs built on fake tensors.

- NABLA (Kandinsky 5's 10 s checkpoints): `family.velocity` as eval loss calls it (no grad), so `nabla_params`
  runs the pipeline's own `get_sparse_params` (the STA mask from the latent's size), then diffusers' `nablaT_v2`
  builds the flex-attention BlockMask from the block-averaged q·k map, and flex attention runs on it. Exercised: every
  shape at released token counts (the mask's (S/64)² blocks against the query and key lengths flex checks). Not
  exercised: the mask's values (fake q·k has none, so its sparsity is unknown), the fused GPU kernel, and the
  backward (loraflow refuses NABLA training off CUDA: flex has no CPU backward, and a fake CUDA backward needs a
  CUDA context).
- fp8-layerwise: `prepare_transformer` enables diffusers' layerwise casting; each layer's hooks cast its weights to
  bf16 before its forward and back to fp8 after it with `Module.to`, which on fake parameters must swap them, and
  a swap is refused while anything else references the parameter (autograd saves the weight's transposed view for
  backward). `fresh_saves` has autograd save a fresh fake of each tensor instead (fake tensors have no values to
  lose). Without gradient checkpointing: its recompute keeps the views itself (torch.utils.checkpoint's own
  saved-tensor hooks), so fp8 + checkpointing is not run here.
- Validation: `family.render` on the family's real diffusers pipeline class, built from the fake transformer and
  VAE with a real scheduler, one denoising step with classifier-free guidance, then the VAE decode at the
  flavour's validation size, up to the pipeline's numpy conversion, which fake tensors cannot make: the video it
  was handed is read from that frame of the error's traceback. Twice: as an fp32 render, and as one on a small card
  (`SMALL_CARD`: fp8 storage, blocks swapped, the transformer and the VAE taking turns, the VAE tiled, as
  `load_pipeline` places them for that plan), with HunyuanVideo 1.5's key-mask attention in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from loraflow.estimates.fake_tensors import fake_mode, fresh_saves, known_values, released_model
from loraflow.kernels.attention_backend import attention_backend_of
from loraflow.kernels.quantize import frozen_dtype, store_frozen
from loraflow.pipelines import get_family
from loraflow.pipelines.base import RenderSettings
from loraflow.pipelines.kandinsky5 import common as kandinsky5
from loraflow.pipelines.kandinsky5.video.family import I2V_MIN_FRAMES
from loraflow.pipelines.released import released_config
from loraflow.pipelines.render_memory import RenderPlan, place
from loraflow.training.batches import MicroBatch
from loraflow.training.step import flow_terms, routing, uses_autocast
from tests.factory import (
    DEPTH,
    Case,
    as_loaded,
    depth,
    dry_config,
    latent_shape,
    released_batch,
    released_transformer,
    text_batch,
)

pytestmark = pytest.mark.released


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex_attention compiles its operator with dynamo, which refuses to trace under a Python dispatch mode
    (`known_values`); eager, the same operator runs its fake-tensor rule (shapes). torch's own switch for it."""
    from torch.nn.attention import flex_attention

    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


@contextmanager
def recorded_calls(transformer: torch.nn.Module) -> Iterator[list[dict[str, Any]]]:
    """The keyword arguments of every transformer call (a forward pre-hook)."""
    calls: list[dict[str, Any]] = []
    hook = transformer.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        yield calls
    finally:
        hook.remove()


def test_nabla_velocity_at_released_size(eager_flex: None) -> None:
    """Kandinsky 5 Video Lite 10 s (the Pro 10 s checkpoints take the same attention_* values)."""
    flavour = "t2v-lite-sft-10s"
    config = dry_config(Case("kandinsky5-video", flavour, ""))
    family = get_family(config)
    released = released_config(flavour, "transformer")
    assert released["attention_type"] == "nabla"
    shape = latent_shape(family)  # 241 frames at 512x768: (1, 16, 61, 64, 96), 93,696 visual tokens
    text = text_batch(family, shape)
    with fake_mode():
        transformer = as_loaded(released_model(flavour, "transformer", **depth(released)), torch.bfloat16)
        with recorded_calls(transformer) as seen, torch.no_grad(), known_values():
            velocity = family.velocity(transformer, torch.randn(shape), torch.full((1,), 0.5), text)
    assert tuple(velocity.shape) == shape
    (call,) = seen
    blocks = shape[2] * (shape[3] // 2) * (shape[4] // 2) // 64  # NABLA's 64-token blocks of 2x2 patches
    assert tuple(call["sparse_params"]["sta_mask"].shape) == (1, 1, blocks, blocks)
    assert kandinsky5.uses_nabla(transformer) and attention_backend_of(transformer) == "flex"


def test_fp8_layerwise_training_step_at_released_size() -> None:
    """Kandinsky 5 Video Lite's training step with its frozen weights stored in fp8, as `train_lora` prepares it."""
    case = Case("kandinsky5-video", "t2v-lite-sft-5s", "tread")
    config = dry_config(case).model_copy(update={"base_model_precision": "fp8-layerwise",
                                                 "gradient_checkpointing": False})
    family = get_family(config)
    _, text, draws, x0 = released_batch(config, family)
    with fake_mode():
        transformer, params = released_transformer(case, config, family)
        transformer.train()
        with fresh_saves(), known_values(), routing(transformer, family, config, draws.seed):
            loss = flow_terms(transformer, family, MicroBatch([], x0, text, draws), torch.device("cpu"),
                                uses_autocast(config, torch.device("cpu"))).flow
            loss.backward()
    assert loss.shape == () and loss.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    # after the step every cast layer is stored in fp8 again (its hooks put it back), the LoRA in fp32
    query = transformer.visual_transformer_blocks[0].self_attention.to_query
    assert query.base_layer.weight.dtype == torch.float8_e4m3fn
    assert query.lora_A["default"].weight.dtype == torch.float32


# a validation render per family; Kandinsky 5 Video's i2v (its pipeline also encodes the conditioning image at the
# render size; t2v's pipeline differs only in leaving that out)
RENDERS = [Case("kandinsky5-video", "i2v-lite-5s", ""),
           Case("kandinsky5-image", "t2i-lite-sft", ""), Case("hunyuanvideo-1.5", "t2v-480p", ""),
           Case("kandinsky6", "pro-i2v", "")]  # its tail frame at Pro's width; video alone (no audio VAE, vocoder)


def fake_pipeline(family: Any, flavour: str, plan: RenderPlan = RenderPlan(), mode: Any = None) -> Any:
    """The family's diffusers render pipeline from the released transformer and VAE on fake tensors, a real scheduler
    and, for HunyuanVideo 1.5, its real guider; no text encoders (renders read cached embeddings: `load_pipeline`
    leaves them out too). As `load_pipeline` makes it for `plan`: both in the plan's dtype, the transformer stored
    in its precision (`store_frozen`), then placed (`render_memory.place`: offload, parking, tiling). `mode`: the fake
    mode the render will run in (a fake parameter moved by `Module.to` must be that mode's own)."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    released = released_config(flavour, "transformer")
    hv15 = family.name == "hunyuanvideo-1.5"
    real = {"scheduler": FlowMatchEulerDiscreteScheduler(),  # real: set_timesteps computes in numpy
            **({"guider": ClassifierFreeGuidance()} if hv15 else {})}
    dtype = frozen_dtype(plan.precision)
    pipeline = HunyuanVideo15Pipeline if hv15 else family.pipeline_class
    with mode or fake_mode():
        transformer = as_loaded(released_model(flavour, "transformer", **depth(released)), dtype)
        store_frozen(transformer, plan.precision, plan.kept)
        vae = as_loaded(released_model(flavour, "vae"), dtype)
        family.setup_vae(vae)  # as the family's `load_renderer` does
        pipe = pipeline(transformer=transformer, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, **real)
        place(pipe, plan, family.tread_layout.blocks, torch.device("cpu"))
    return pipe


# the render on a small card (render_memory.RenderPlan): fp8 storage (Kandinsky 5's kept modules in bf16), the last
# blocks swapped, the transformer and the VAE taking turns on the device, the VAE in bf16 and tiled
SMALL_CARD = RenderPlan(precision="fp8-layerwise", kept="bf16", blocks_to_swap=DEPTH - 1, vae_tiling=True, park=True)


@pytest.mark.parametrize("plan", [RenderPlan(), SMALL_CARD], ids=["fp32", "small-card"])
@pytest.mark.parametrize("case", RENDERS, ids=lambda c: c.flavour)
def test_validation_render_at_released_size(case: Case, plan: RenderPlan) -> None:
    family = get_family(dry_config(case))
    height, width = family.flavour.size
    # the small card's video renders at Kandinsky 5 i2v's fewest frames: the tiled decode's seam blending is a Python
    # loop over pixel rows, minutes on fake tensors at the flavour's own length
    frames = family.flavour.num_frames if plan == RenderPlan() or family.flavour.num_frames == 1 else I2V_MIN_FRAMES
    settings = RenderSettings(height=height, width=width, num_frames=frames,
                              num_inference_steps=1, guidance=5.0, seed=0, flow_shift=5.0)
    mode = fake_mode()
    pipe = fake_pipeline(family, case.flavour, plan, mode)
    row = family.example_text_row(pipe.transformer.config, 512)
    image = {"image": np.zeros((height, width, 3), np.uint8)} if family.flavour.image_is_first_frame else {}
    # the pipeline asks values of the conditioning image it preprocesses (is it in [0, 1]): known up to its size
    with mode, recorded_calls(pipe.transformer) as calls, known_values(limit=height * width * 3):
        with pytest.raises(RuntimeError, match=r"\.numpy\(\) is not supported for tensor subclasses") as error:
            family.render(pipe, row, row, settings, lora_scale=None, **image)
    # the pipeline's numpy conversion (diffusers' pt_to_numpy) was handed the decoded (F, 3, H, W) video
    decoded = error.traceback[-1].frame.f_locals["images"]
    assert tuple(decoded.shape) == (frames, 3, height, width)
    assert len(calls) == 2  # one step: with the prompt and with the negative
    assert pipe.vae.use_tiling == plan.vae_tiling and pipe.vae.dtype == frozen_dtype(plan.precision)
    query = pipe.transformer.get_submodule(QUERY[family.name])
    assert query.weight.dtype == (torch.float8_e4m3fn if plan.precision == "fp8-layerwise" else torch.float32)
    blocks = getattr(pipe.transformer, family.tread_layout.blocks)
    assert [hasattr(b, "_diffusers_hook") and b._diffusers_hook.get_hook("group_offloading") is not None
            for b in blocks] == [i >= DEPTH - plan.blocks_to_swap for i in range(DEPTH)]
    assert hasattr(pipe.vae, "_hf_hook") == plan.park


QUERY = {"kandinsky5-video": "visual_transformer_blocks.0.self_attention.to_query",
         "kandinsky5-image": "visual_transformer_blocks.0.self_attention.to_query",
         "hunyuanvideo-1.5": "transformer_blocks.0.attn.to_q",
         "kandinsky6": "visual_transformer_blocks.0.video_dec_block.self_attention.to_query"}

