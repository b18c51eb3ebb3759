"""Kandinsky 5.0 Image (Lite, t2i and i2i): prompt templates, scaling, transformer call, LoRA targets, render.

Mirrors diffusers' `Kandinsky5T2IPipeline` (pipelines/kandinsky5/pipeline_kandinsky_t2i.py, `K5T2I`) and
`Kandinsky5I2IPipeline` (pipeline_kandinsky_i2i.py, `K5I2I`); the parity tests in tests/pipelines/test_families.py
and tests/pipelines/test_k5_i2i.py hold this file to their numbers. Images are clips of one frame: latents are
(B, 16, 1, h, w) like every family's (B, C, T, h, w).

i2i (image editing) differs from t2i in three places, all in `Kandinsky5ImageI2I`:
  - the prompt is encoded together with the source image: its own template, whose user turn ends in the image's
    vision tokens, through the Qwen2-VL processor (the checkpoint's `tokenizer`), at half the image's size;
  - the transformer (visual_cond=True) takes channels-last cat([x_t, source latent, ones]): 16 + 16 + 1 channels;
  - the source image's latent is cached by the latents stage (`image_condition`) and reaches `velocity`
    as `text["image_latent"]`. x_t itself holds only the target: no frame is given clean (conditioning_frames 0).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5I2IPipeline, Kandinsky5T2IPipeline
from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean
from PIL import Image

from loraflow.keys import content_key
from loraflow.pipelines.base import (
    RenderSettings,
    TextRow,
    load_component,
    load_pipeline,
    scaled_posterior,
    set_lora_scale,
)
from loraflow.pipelines.kandinsky5 import common as kandinsky5
from loraflow.pipelines.kandinsky5.common import CLIP_TOKENS, Kandinsky5Shared, clip_pooled
from loraflow.pipelines.kandinsky5.image.spec import I2I_TEXT_TOKENS, SPEC
from loraflow.pipelines.sources import ModelSource, as_source

if TYPE_CHECKING:
    from loraflow.pipelines.render_memory import RenderPlan

log = logging.getLogger(__name__)

# diffusers 0.42.1's T2I `prompt_template` (K5T2I:178); we crop the hidden states after its prefix (40 tokens with the
# real Qwen2.5 tokenizer, its prompt_template_encode_start_idx).
DIFFUSERS_TEMPLATE = (
    "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, "
    "texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>"
)
# The original repository's "image" template (kandinskylab/kandinsky-5 kandinsky/models/text_embedders.py), "promt"
# as it spells it: what the checkpoints were trained with (crop 41 there, its prefix).
ORIGINAL_TEMPLATE = DIFFUSERS_TEMPLATE.replace("You are a prompt engineer", "You are a promt engineer")
NEGATIVE_PROMPT = ""  # the T2I pipeline's default negative prompt (K5T2I:660)
VAE_FACTOR = 8  # the pipeline hard-codes vae_scale_factor_spatial = 8 (K5T2I:181)
IMAGE_ROPE_SCALE = (1.0, 1.0, 1.0)  # both image pipelines' scale_factor

# i2i: the original Kandinsky 5 repo's "image_edit" template (kandinskylab/kandinsky-5,
# kandinsky/models/text_embedders.py: its parts joined by "\n", "promt" as it spells it), the source image's vision
# tokens and <|im_end|> appended after the user text as its embedder does. diffusers' I2I template (K5I2I:177) fixes
# the typo and drops both "\n": not what the checkpoints were trained with (docs/families.md).
I2I_PROMPT_TEMPLATE = "\n".join((
    "<|im_start|>system\nYou are a promt engineer. Based on the provided source image (first image) and target image "
    "(second image), create an interesting text prompt that can be used together with the source image to create the "
    "target image:<|im_end|>",
    "<|im_start|>user\n{}",
)) + "<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
# The original crops 55 tokens: its 52-token prefix (real Qwen2 tokenizer) and the user turn's first 3 tokens, which
# the transformer therefore never saw. Kept, to feed the embeddings it was trained on (diffusers: 54, 5 past its 49).
I2I_CROP_PAST_PREFIX = 3
# The I2I pipeline's max_sequence_length default (K5I2I:300): tokens after the crop, vision tokens included.
I2I_MAX_TEXT_TOKENS = I2I_TEXT_TOKENS
I2I_CLOSING_TOKENS = 3  # <|vision_start|>, <|vision_end|>, <|im_end|>: the template's tokens after the user text
I2I_TEXT_SIGNATURE = content_key(template=I2I_PROMPT_TEMPLATE, crop_past_prefix=I2I_CROP_PAST_PREFIX,
                                 max_tokens=I2I_MAX_TEXT_TOKENS, clip_tokens=CLIP_TOKENS,
                                 image="source image at half size, through the checkpoint's Qwen2-VL processor")


def template_crop(tokenizer: Any, template: str = "original") -> int:
    """Tokens in the t2i template before the user text; 41 (diffusers': 40) for the real Qwen2.5 tokenizer."""
    return kandinsky5.template_crop(tokenizer, Kandinsky5Image.prompt_templates[template])


def i2i_template_crop(processor: Any) -> int:
    """Tokens cropped off the front of i2i embeddings: the template prefix and I2I_CROP_PAST_PREFIX user-turn tokens
    (55 for the real Qwen2.5 tokenizer, as the original repo; tests/pipelines/test_qwen_templates.py)."""
    return kandinsky5.template_crop(processor, I2I_PROMPT_TEMPLATE) + I2I_CROP_PAST_PREFIX


@dataclass(frozen=True)
class Kandinsky5Image(Kandinsky5Shared):
    """Text-to-image; `Kandinsky5ImageI2I` (a subclass) the i2i flavours. `make_family` picks by flavour."""

    prompt_templates: ClassVar[dict[str, str]] = {"original": ORIGINAL_TEMPLATE, "diffusers": DIFFUSERS_TEMPLATE}
    task: ClassVar[str] = "t2i"
    pipeline_class: ClassVar[type] = Kandinsky5T2IPipeline  # what `load_renderer` loads
    # flavour, template, text_components, tread_layout, comfyui_names, musubi_names, image_condition_*:
    # Kandinsky5Shared's
    name: str = SPEC.name
    spatial_multiple: int = SPEC.spatial_multiple
    vae_temporal_factor: int = SPEC.vae_temporal_factor
    default_negative_prompt: str = NEGATIVE_PROMPT
    # text_signature, max_text_tokens: Kandinsky5Shared (the template, the flavour's 512 tokens; i2i's 1024)

    def __post_init__(self) -> None:
        if self.flavour.task != self.task:
            raise ValueError(f"{type(self).__name__} is the {self.task} family; flavour '{self.flavour.name}' is "
                             f"{self.flavour.task}: build it with {__name__}.make_family, which picks the class")

    # 1. text: Kandinsky5Shared (encode_text, collate_text) ----------------------------------------

    # 2. latents ----------------------------------------------------------------------------------
    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        """uint8 (B, 1, H, W, 3) -> (B, 16, 1, H/8, W/8): Flux VAE `mode()` * scaling_factor, no shift
        (distribution: (B, 32, 1, H/8, W/8), mean and logvar scaled alike; `scaled_posterior`).

        The K5 image pipelines decode `latents / scaling_factor` (K5T2I:804) and ignore the Flux VAE's
        shift_factor; caching with the shift would train on latents the pipeline never decodes.
        """
        num_frames = frames.shape[1]
        if num_frames != 1:
            raise ValueError(f"{self.name} trains on single images; got clips of {num_frames} frames. "
                             "Set the dataset's `video.num_frames: 1`.")
        # [-1, 1] as diffusers' VaeImageProcessor computes it (x / 255 * 2 - 1), in fp32 before any cast
        pixels = (frames[:, 0].permute(0, 3, 1, 2).float() / 255.0 * 2.0 - 1.0).to(vae.dtype)  # (B, 3, H, W)
        posterior = vae.encode(pixels).latent_dist
        latents = scaled_posterior(posterior, sampling, vae.config.scaling_factor)  # (B, 16 or 32, h, w)
        return latents[:, :, None]

    # 3. transformer --------------------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        text: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """The T2I pipeline's denoiser call (K5T2I:698-722): plain 16-channel latents, RoPE scale 1."""
        if transformer.config.visual_cond:
            raise ValueError("this Kandinsky 5 image checkpoint has visual_cond=True (an image-to-image model); "
                             "the t2i flavours need a text-to-image checkpoint")
        return kandinsky5.denoise(transformer, noisy.permute(0, 2, 3, 4, 1), sigma, text, IMAGE_ROPE_SCALE)

    # lora_targets, save_lora: Kandinsky5Shared

    # 4. render ---------------------------------------------------------------------------------------
    def load_renderer(
        self, model: ModelSource | str, lora_path: str | None, device: torch.device,
        transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None,
    ) -> Kandinsky5T2IPipeline | Kandinsky5I2IPipeline:
        return load_pipeline(self.pipeline_class, model, lora_path, device, transformer, plan,
                             self.tread_layout.blocks)

    @torch.no_grad()
    def render(
        self, pipe: Kandinsky5T2IPipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
        lora_scale: float | None = 1.0, image: np.ndarray | None = None,
    ) -> np.ndarray:
        if image is not None:
            raise ValueError(f"flavour '{self.flavour.name}' is text-to-image: it takes no source image")
        embeds = self.prompt_embeds(prompt, negative, pipe._execution_device)
        return _render(pipe, embeds, settings, lora_scale, self.name)


@dataclass(frozen=True)
class Kandinsky5ImageI2I(Kandinsky5Image):
    """Image-to-image (editing): the target is generated from noise beside the source image's latent, with a
    prompt embedding that saw the source image."""

    # the original's template only (config `kandinsky5_prompt_template: diffusers` is refused for i2i)
    prompt_templates: ClassVar[dict[str, str]] = {"original": I2I_PROMPT_TEMPLATE}
    task: ClassVar[str] = "i2i"
    pipeline_class: ClassVar[type] = Kandinsky5I2IPipeline
    image_condition_name: str = "source_image"  # the latents stage caches `image_condition`: the source's latent

    # 1. text -------------------------------------------------------------------------------------
    @property
    def text_signature(self) -> str:
        """Another template, crop and limit: i2i never reuses t2i embeddings."""
        return I2I_TEXT_SIGNATURE

    @torch.no_grad()
    def encode_text(
        self, components: Mapping[str, Any], texts: list[str], images: list[np.ndarray] | None = None
    ) -> list[TextRow]:
        """`Kandinsky5I2IPipeline.encode_prompt(text, image=PIL image)` (K5I2I:184-259, 295-385), one text at a time,
        with the original repo's template and crop (`I2I_PROMPT_TEMPLATE`, `i2i_template_crop`) in place of diffusers'.

        `images`: each text's source image, uint8 (H, W, 3). Rows: `text_embeds` (L, D) = Qwen2.5-VL's last hidden
        state after the template prefix (the user text, the image's vision tokens, the closing tokens: L <= 1024),
        and `pooled_embeds` (768,) = CLIP-L of the text alone; `truncated`: the text was cut to fit beside the image.
        """
        if images is None or len(images) != len(texts):
            raise ValueError(f"flavour '{self.flavour.name}' encodes each prompt with its source image: pass one "
                             f"uint8 (H, W, 3) image per text ({len(texts)} texts, "
                             f"{'no' if images is None else len(images)} images)")
        processor, qwen = components["tokenizer"], components["text_encoder"]
        crop = i2i_template_crop(processor)
        rows = []
        for text, image in zip(texts, images, strict=True):
            text = prompt_clean(text)
            source = Image.fromarray(image)
            source = source.resize((source.width // 2, source.height // 2))  # as the pipeline does (K5I2I:212)
            fitted = _fit_text(processor, text, source, crop)
            templated = I2I_PROMPT_TEMPLATE.format(fitted)
            inputs = processor(
                text=[templated], images=[source], videos=None,
                max_length=crop + I2I_MAX_TEXT_TOKENS, truncation=True, return_tensors="pt", padding=True,
            ).to(qwen.device)
            hidden = qwen(**inputs, return_dict=True, output_hidden_states=True)["hidden_states"][-1]
            rows.append({
                "text_embeds": hidden[0, crop:].float().cpu().numpy(),  # (L, 3584)
                "pooled_embeds": clip_pooled(components, text),  # (768,): the whole text, as the pipeline
                "truncated": fitted != text,  # the caption's budget depends on the image's vision tokens
            })
        return rows

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        """A source image cut to (height, width) whose vision tokens alone overflow the 1024-token prompt (the
        encoder would fail on it: `_fit_text`); checked when clips are planned, before any decoding."""
        if not as_source(model).folder("tokenizer").is_dir():
            return ""  # no checkpoint yet (`loraflow check` says so): the clips stage needs none, text_embeds fails
        tokens = source_vision_tokens(as_source(model), height, width)
        if tokens + I2I_CLOSING_TOKENS <= I2I_MAX_TEXT_TOKENS:
            return ""
        return (f"a {width}x{height} source image gives {tokens} vision tokens, more than Kandinsky 5 i2i's "
                f"{I2I_MAX_TEXT_TOKENS}-token prompt holds")

    # 2. latents ----------------------------------------------------------------------------------
    @torch.no_grad()
    def image_condition(
        self, vae: torch.nn.Module, parts: Sequence[Any], clip: Mapping[str, Any]
    ) -> dict[str, np.ndarray]:
        """The clip's source image (`condition_frames`, uint8 (H, W, 3) at its target's size) -> `image_latent`
        float32 (16, 1, h, w): Flux VAE `mode()` * scaling_factor, no shift, as `vae_encode(..., "mode")`.

        The pipeline draws `latent_dist.sample(generator)` (K5I2I:538); the cache keeps the mode, deterministic and
        free of a per-run draw. The pipeline resizes the image to the render size first; a clip's source image
        already is at its target's size.
        """
        source = torch.from_numpy(np.array(clip["condition_frames"][0]))  # copy: Arrow is read-only
        latent = self.vae_encode(vae, source[None, None].to(next(vae.parameters()).device), "mode")[0]
        return {"image_latent": latent.float().cpu().numpy()}

    def example_image_condition(self, transformer_config: Mapping[str, Any],
                                latent_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {"image_latent": np.ones(latent_shape, np.float32)}  # the source is shaped as its target (T = 1)

    # 3. transformer --------------------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        text: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """The I2I pipeline's denoiser call (K5I2I:773-783): channels-last cat([x_t, source latent, ones]) from
        `prepare_latents` (K5I2I:535-548), with `text["image_latent"]` (B, 16, 1, h, w) from the latent rows."""
        if not transformer.config.visual_cond:
            raise ValueError("this Kandinsky 5 image checkpoint has visual_cond=False (a text-to-image model); "
                             f"flavour '{self.flavour.name}' needs an image-to-image checkpoint")
        if "image_latent" not in text:
            raise KeyError(f"flavour '{self.flavour.name}' conditions on a source image: `velocity` needs the latent "
                           "rows' `image_latent` (re-materialize `latents` for this flavour)")
        source = text["image_latent"]
        if source.shape != noisy.shape:
            raise ValueError(f"the source latent {tuple(source.shape)} must be shaped like the noisy latent "
                             f"{tuple(noisy.shape)}: the source image is cut to its target's size")
        hidden = noisy.permute(0, 2, 3, 4, 1)  # (B, 1, h, w, 16): channels-last
        source = source.to(hidden).permute(0, 2, 3, 4, 1)
        hidden = torch.cat([hidden, source, torch.ones_like(hidden[..., :1])], dim=-1)  # (B, 1, h, w, 16 + 16 + 1)
        return kandinsky5.denoise(transformer, hidden, sigma, text, IMAGE_ROPE_SCALE)

    # 4. render (load_renderer: Kandinsky5Image's, with `pipeline_class`) ------------------------------------
    @torch.no_grad()
    def render(
        self, pipe: Kandinsky5I2IPipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
        lora_scale: float | None = 1.0, image: np.ndarray | None = None,
    ) -> np.ndarray:
        """An edit of `image` (the source, uint8 (H, W, 3) at the render size); `prompt` and `negative` are rows
        that `encode_text` encoded with that same image."""
        if image is None:
            raise ValueError(f"flavour '{self.flavour.name}' renders an edit of a source image: pass `image`")
        if image.shape != (settings.height, settings.width, 3) or image.dtype != np.uint8:
            # The pipeline would resize (stretch) it silently; the caller crops to the render size instead.
            raise ValueError(f"the source image must be uint8 {(settings.height, settings.width, 3)}; "
                             f"got {image.dtype} {image.shape}")
        embeds = self.prompt_embeds(prompt, negative, pipe._execution_device)
        return _render(pipe, embeds | {"image": Image.fromarray(image)}, settings, lora_scale, self.name)


@functools.lru_cache(maxsize=256)
def source_vision_tokens(model: ModelSource | str, height: int, width: int) -> int:
    """Vision tokens of a source image of this size in the checkpoint's processor: halved as the pipeline does
    (K5I2I:212), resized by the image processor (patch and pixel bounds from its config), merge_size**2 patches
    per token, as `Qwen2VLProcessor` expands the image placeholder."""
    image_processor = _i2i_processor(model).image_processor
    grid = image_processor(images=[Image.new("RGB", (max(width // 2, 1), max(height // 2, 1)))],
                           return_tensors="np")["image_grid_thw"][0]
    return int(np.prod(grid)) // image_processor.merge_size**2


@functools.lru_cache(maxsize=4)
def _i2i_processor(model: ModelSource | str) -> Any:
    return load_component(model, "tokenizer")


def _fit_text(processor: Any, text: str, image: Image.Image, crop: int) -> str:
    """`text` cut to fit I2I_MAX_TEXT_TOKENS after the crop beside the image's vision tokens and the closing tokens.

    The pipeline's own cut (K5I2I:224-236): tokenize in full, decode the user-text tokens past the budget, and cut
    that many characters. The pipeline cuts them off the end of the whole templated string, which takes the image
    markers with them and fails inside the processor (diffusers 0.42.1: any prompt over the budget raises); here
    they come off the end of the user text, which is what its warning says it removes.
    """
    ids = processor(text=[I2I_PROMPT_TEMPLATE.format(text)], images=[image], videos=None,
                    return_tensors="pt")["input_ids"][0]
    if len(ids) <= crop + I2I_MAX_TEXT_TOKENS:
        return text
    image_tokens = int((ids == processor.image_token_id).sum())
    budget = I2I_MAX_TEXT_TOKENS - image_tokens - I2I_CLOSING_TOKENS  # user-text tokens that fit after the crop
    if budget < 0:
        raise ValueError(f"a {image.width * 2}x{image.height * 2} source image gives {image_tokens} vision tokens, "
                         f"more than Kandinsky 5 i2i's {I2I_MAX_TEXT_TOKENS}-token prompt: use smaller images")
    user = ids[ids != processor.image_token_id][crop:-I2I_CLOSING_TOKENS]  # the crop may take its first tokens
    removed = processor.decode(user[budget:])
    return text[: -len(removed)] if removed else text


def _render(
    pipe: Kandinsky5T2IPipeline | Kandinsky5I2IPipeline, inputs: dict[str, Any], settings: RenderSettings,
    lora_scale: float | None, name: str,
) -> np.ndarray:
    """Either image pipeline at exactly the settings' size -> uint8 (F=1, H, W, 3)."""
    size = (settings.width, settings.height)
    if size not in pipe.resolutions:
        # The pipeline would silently snap to its closest trained size; render what was asked instead.
        log.warning("%s: %dx%d is not a size Kandinsky 5 Image was trained at (%s); rendering it anyway",
                    name, *size, ", ".join(f"{w}x{h}" for w, h in pipe.resolutions))
        pipe.resolutions = [*pipe.resolutions, size]
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
    set_lora_scale(pipe.transformer, lora_scale)
    image = pipe(
        **inputs,
        height=settings.height,
        width=settings.width,
        num_inference_steps=settings.num_inference_steps,
        guidance_scale=settings.guidance,
        generator=torch.Generator().manual_seed(settings.seed),
        output_type="np",
    ).image  # (1, H, W, 3) in [0, 1]
    return (np.clip(image, 0, 1) * 255).round().astype(np.uint8)  # (F=1, H, W, 3)


def make_family(flavour: str | None) -> Kandinsky5Image:
    """t2i flavours: `Kandinsky5Image`; i2i flavours: `Kandinsky5ImageI2I` (source image in prompt and input)."""
    chosen = SPEC.flavour(flavour)
    return (Kandinsky5ImageI2I if chosen.edits_image else Kandinsky5Image)(flavour=chosen)
