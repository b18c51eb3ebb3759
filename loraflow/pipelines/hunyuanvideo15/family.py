"""HunyuanVideo 1.5 (t2v and i2v, 480p/720p): prompt template, glyph text, scaling, transformer call, LoRA targets,
image condition, render.

Mirrors diffusers' `HunyuanVideo15Pipeline` (pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py) and
`HunyuanVideo15ImageToVideoPipeline` (..._image2video.py, `HVI`); the parity tests in tests/pipelines/test_families.py
and tests/pipelines/test_hv_i2v.py hold this file to their numbers. i2v differs from t2v only in the transformer's
conditioning: the `cond` channels carry the image's latent (`latent_dist.mode()` * scaling, HVI:375-388) in frame 0
and zeros elsewhere, the mask is 1 on frame 0 (HVI:594-632), and `image_embeds` are SigLIP's `last_hidden_state` of
the image (HVI:391-402). x_t itself is not touched: every latent frame, frame 0 included, is noised and stepped
(HVI:851-931), so the flavour has no `conditioning_frames` and the loss covers every frame. The latents stage caches
the image latent and the SigLIP tokens of each clip's first frame (`image_condition`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts
from PIL import Image

from loraflow.kernels.tread import TokenLayout
from loraflow.keys import content_key
from loraflow.pipelines.base import (
    AS_T2V,
    RenderSettings,
    TextRow,
    compute_dtype,
    first_frame,
    load_pipeline,
    padded,
    save_transformer_lora,
    scaled_posterior,
    set_lora_scale,
)
from loraflow.pipelines.comfyui import ComfyRule
from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.hunyuanvideo15.attention import key_mask_attention
from loraflow.pipelines.hunyuanvideo15.spec import GLYPH_TOKENS, IMAGE_TOKENS, SPEC, TEXT_TOKENS
from loraflow.pipelines.sources import ModelSource

if TYPE_CHECKING:
    from loraflow.pipelines.render_memory import RenderPlan

# The pipeline's system turn (HV:227-232), byte for byte: its backslash continuations keep the
# 8-space indents, and the text encoder sees them.
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects:         "
    "1. The main content and theme of the video.         "
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.         "
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.         "
    "4. background environment, light, style and atmosphere.         "
    "5. camera angles, movements, and transitions used in the video."
)
MAX_TEXT_TOKENS = TEXT_TOKENS  # the pipeline's tokenizer_max_length (after the template): every flavour's
HIDDEN_LAYER = -3  # hidden_states[-3]: the pipeline skips the last two decoder layers
IMAGE_COMPONENTS = ("image_encoder", "feature_extractor")  # SigLIP, loaded by the latents stage for i2v
TEXT_SIGNATURE = content_key(system=SYSTEM_MESSAGE, max_tokens=MAX_TEXT_TOKENS, layer=HIDDEN_LAYER,
                             glyph_tokens=GLYPH_TOKENS, glyph="extract_glyph_texts")
# Main dual-stream blocks only: the same projection names also exist in the token refiner
# (context_embedder.token_refiner.refiner_blocks.*), which a LoRA should leave alone.
ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                     "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
FFN_TARGETS = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
# The last block's text-stream output is discarded, so these adapters there never get a gradient
# (add_q_proj: exactly 0; the others: None). Harmless; DDP needs find_unused_parameters for them.
DEAD_IN_LAST_BLOCK = ("attn.add_q_proj", "attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2")
# ComfyUI runs HunyuanVideo 1.5 on its HunyuanVideo model (comfyanonymous/ComfyUI comfy/ldm/hunyuan_video/model.py),
# whose double blocks are Flux's DoubleStreamBlock (comfy/ldm/flux/layers.py): img_attn.qkv / txt_attn.qkv fuse q, k, v
# in that order along the output dim (its forward views the output as (B, L, 3, heads, head_dim)), img_attn.proj, and
# img_mlp.0 / img_mlp.2 (Linear, GELU, Linear). diffusers' names come from Tencent's split ones
# (huggingface/diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py: img_attn_q -> attn.to_q, txt_attn_q ->
# attn.add_q_proj, img_attn_proj -> attn.to_out.0, txt_attn_proj -> attn.to_add_out, img_mlp.fc1 -> ff.net.0.proj,
# txt_mlp.fc2 -> ff_context.net.2). ComfyUI has no key for Tencent's split q/k/v, so q/k/v LoRAs are fused.
_BLOCK = r"transformer_blocks\.(\d+)\."
HUNYUANVIDEO15_COMFYUI_NAMES = (
    ComfyRule(_BLOCK + r"attn\.to_q", r"double_blocks.\1.img_attn.qkv", 0, 3),
    ComfyRule(_BLOCK + r"attn\.to_k", r"double_blocks.\1.img_attn.qkv", 1, 3),
    ComfyRule(_BLOCK + r"attn\.to_v", r"double_blocks.\1.img_attn.qkv", 2, 3),
    ComfyRule(_BLOCK + r"attn\.add_q_proj", r"double_blocks.\1.txt_attn.qkv", 0, 3),
    ComfyRule(_BLOCK + r"attn\.add_k_proj", r"double_blocks.\1.txt_attn.qkv", 1, 3),
    ComfyRule(_BLOCK + r"attn\.add_v_proj", r"double_blocks.\1.txt_attn.qkv", 2, 3),
    ComfyRule(_BLOCK + r"attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    ComfyRule(_BLOCK + r"attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    ComfyRule(_BLOCK + r"ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.0"),
    ComfyRule(_BLOCK + r"ff\.net\.2", r"double_blocks.\1.img_mlp.2"),
    ComfyRule(_BLOCK + r"ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.0"),
    ComfyRule(_BLOCK + r"ff_context\.net\.2", r"double_blocks.\1.txt_mlp.2"),
)
# musubi-tuner's HunyuanVideo 1.5 model keeps Tencent's split names (kohya-ss/musubi-tuner hunyuan_video_1_5/
# hunyuan_video_1_5_modules.py `MMDoubleStreamBlock`, `MLP` at 30c658c4f4b0): diffusers' renames above, undone
_MUSUBI_PARTS = {"attn.to_q": "img_attn_q", "attn.to_k": "img_attn_k", "attn.to_v": "img_attn_v",
                 "attn.add_q_proj": "txt_attn_q", "attn.add_k_proj": "txt_attn_k", "attn.add_v_proj": "txt_attn_v",
                 "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
                 "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
                 "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2"}
HUNYUANVIDEO15_MUSUBI_NAMES = tuple(ComfyRule(_BLOCK + diffusers.replace(".", r"\."), rf"double_blocks.\1.{musubi}")
                                    for diffusers, musubi in _MUSUBI_PARTS.items())


def chat(text: str) -> list[dict[str, str]]:
    """The pipeline's conversation (HV:64-80): an empty prompt becomes a single space."""
    return [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": text or " "}]


def template_crop(tokenizer: Any) -> int:
    """Tokens before the user text in the chat template; 108 for the real Qwen2.5 tokenizer.

    Computed, not hard-coded: a different tokenizer (the tiny offline one) splits the prefix differently.
    """
    marker = "\x00prompt\x00"
    rendered = tokenizer.apply_chat_template([chat(marker)], tokenize=False, add_generation_prompt=True)[0]
    return len(tokenizer(rendered.split(marker)[0])["input_ids"])


def lora_pattern(include_ffn: bool) -> str:
    """A peft regex (full match on module names) for the main blocks' projections."""
    names = ATTENTION_TARGETS + (FFN_TARGETS if include_ffn else ())
    alternatives = "|".join(n.replace(".", r"\.") for n in names)
    return rf"transformer_blocks\.\d+\.({alternatives})"


@dataclass(frozen=True)
class HunyuanVideo15:
    flavour: Flavour
    name: str = SPEC.name
    spatial_multiple: int = SPEC.spatial_multiple
    vae_temporal_factor: int = SPEC.vae_temporal_factor
    text_components: tuple[str, ...] = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    default_negative_prompt: str = ""  # the pipeline's default (encoded as " ")
    text_signature: str = TEXT_SIGNATURE  # part of every text key: a new template re-encodes
    max_text_tokens: int = MAX_TEXT_TOKENS  # caption tokens kept by encode_text; longer ones are truncated
    # block(hidden, context, temb, context_mask, (cos, sin) per token) -> (hidden, context): see kernels/tread.py
    tread_layout: TokenLayout = TokenLayout("transformer_blocks", rope_arg=4, rope_token_dim=0, output_index=0,
                                            depth="num_layers")
    comfyui_names: tuple[ComfyRule, ...] = HUNYUANVIDEO15_COMFYUI_NAMES  # the ComfyUI file
    musubi_names: tuple[ComfyRule, ...] = HUNYUANVIDEO15_MUSUBI_NAMES  # the musubi-tuner file
    text_twin: ClassVar[None] = None  # no other family encodes its texts alike

    @property
    def image_condition_components(self) -> tuple[str, ...]:
        """What the latents stage loads beside the VAE for `image_condition` (i2v only)."""
        return IMAGE_COMPONENTS if self.flavour.image_is_first_frame else ()

    @property
    def image_condition_name(self) -> str:
        """i2v: the latents stage caches `image_condition` of each clip's first frame."""
        return "first_frame" if self.flavour.image_is_first_frame else ""

    # 1. text -------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_text(
        self, components: Mapping[str, Any], texts: list[str], images: list[np.ndarray] | None = None
    ) -> list[TextRow]:
        """Qwen2.5-VL `hidden_states[-3]` after the template + Glyph-ByT5 on the quoted text, one text at a time.

        Rows keep the valid tokens only: `text_embeds` (L, D) and `byt5_embeds` (L2, D2) with `byt5_mask` (L2,).
        A text without quotes has no glyph tokens; it stores one zero token with mask 0, because the store
        cannot hold empty tensors (the DiT drops masked tokens, so this equals the pipeline's 256 zeros).
        Text only: i2v's image reaches the transformer as its condition, not through the prompt (`images` is None).
        """
        if images is not None:
            raise ValueError(f"{self.name} {self.flavour.name} encodes prompts alone; got source images")
        tokenizer, qwen = components["tokenizer"], components["text_encoder"]
        crop = template_crop(tokenizer)
        rows = []
        for text in texts:
            # Unpadded: with a causal LM the valid tokens do not see the pipeline's right padding.
            ids = tokenizer.apply_chat_template(
                [chat(text)], add_generation_prompt=True, tokenize=True, return_dict=True,
                max_length=crop + MAX_TEXT_TOKENS, truncation=True, return_tensors="pt",
            ).to(qwen.device)
            templated = tokenizer.apply_chat_template([chat(text)], add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"][0]
            hidden = qwen(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                          output_hidden_states=True).hidden_states[HIDDEN_LAYER]
            byt5, byt5_mask = self._glyph_embeds(components, text)
            rows.append({
                "text_embeds": hidden[0, crop:].float().cpu().numpy(),  # (L, 3584)
                "byt5_embeds": byt5,  # (L2, 1472)
                "byt5_mask": byt5_mask,  # (L2,)
                "truncated": len(templated) > crop + MAX_TEXT_TOKENS,  # the template's end is cut first
            })
        return rows

    @staticmethod
    def _glyph_embeds(components: Mapping[str, Any], text: str) -> tuple[np.ndarray, np.ndarray]:
        tokenizer, byt5 = components["tokenizer_2"], components["text_encoder_2"]
        glyphs = extract_glyph_texts(text)  # 'Text "a". Text "b". ' or None
        if glyphs is None:
            return np.zeros((1, byt5.config.d_model), np.float32), np.zeros(1, np.float32)
        # Padded to 256 exactly as the pipeline calls it (bidirectional encoder; cheap), then trimmed.
        tokens = tokenizer(glyphs, padding="max_length", max_length=GLYPH_TOKENS, truncation=True,
                           add_special_tokens=True, return_tensors="pt").to(byt5.device)
        embeds = byt5(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask.float())[0]
        valid = tokens.attention_mask[0].bool()
        return embeds[0, valid].float().cpu().numpy(), np.ones(int(valid.sum()), np.float32)

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        """Right-pad to the longest valid length in the batch, with masks.

        Shorter than the pipeline's 1000/256 padding, and exact: the DiT zeroes and masks invalid tokens.
        """
        text, text_mask = padded([r["text_embeds"] for r in rows], [np.ones(len(r["text_embeds"])) for r in rows])
        byt5, byt5_mask = padded([r["byt5_embeds"] for r in rows], [r["byt5_mask"] for r in rows])
        return {"text_embeds": text.to(device), "text_mask": text_mask.to(device),
                "byt5_embeds": byt5.to(device), "byt5_mask": byt5_mask.to(device)}

    def example_text_row(self, transformer_config: Mapping[str, Any], n_tokens: int) -> TextRow:
        """A quoted caption's row: the glyph encoder's full GLYPH_TOKENS, all valid."""
        return {"text_embeds": np.zeros((n_tokens, transformer_config["text_embed_dim"]), np.float32),
                "byt5_embeds": np.zeros((GLYPH_TOKENS, transformer_config["text_embed_2_dim"]), np.float32),
                "byt5_mask": np.ones(GLYPH_TOKENS, np.float32)}

    def example_image_condition(self, transformer_config: Mapping[str, Any],
                                latent_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        if not self.flavour.image_is_first_frame:
            return {}
        channels, _, height, width = latent_shape
        return {"image_latent": np.ones((channels, 1, height, width), np.float32),
                "image_embeds": np.ones((IMAGE_TOKENS, transformer_config["image_embed_dim"]), np.float32)}

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        return ""  # any bucket size trains

    # 2. latents ----------------------------------------------------------------------------------
    def setup_vae(self, vae: torch.nn.Module) -> None:
        """Each mid-block attention of this VAE builds its mask with `frame_causal_mask` (an attribute of the block,
        which its forward looks up before the class's staticmethod)."""
        for block in vae.modules():
            if isinstance(block, HunyuanVideo15AttnBlock):
                block.prepare_causal_attention_mask = frame_causal_mask

    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        """uint8 (B, F, H, W, 3) -> (B, 32, T, H/16, W/16); `latent_dist.mode()` * scaling, as the i2v pipeline
        encodes its image (HVI:386-387) and the decoder divides by scaling only (HV:825). Distribution:
        (B, 64, T, H/16, W/16), mean and logvar scaled alike (`scaled_posterior`)."""
        latents = []
        for clip in frames:  # one clip at a time: this VAE's mid-block mask breaks for batch > 1
            # [-1, 1] as diffusers' VaeImageProcessor computes it (x / 255 * 2 - 1), in fp32 before any cast
            pixels = (clip.permute(3, 0, 1, 2)[None].float() / 255.0 * 2.0 - 1.0).to(vae.dtype)  # (1, 3, F, H, W)
            latents.append(scaled_posterior(vae.encode(pixels).latent_dist, sampling, vae.config.scaling_factor))
        return torch.cat(latents)

    @torch.no_grad()
    def image_condition(
        self, vae: torch.nn.Module, parts: Sequence[Any], clip: Mapping[str, Any]
    ) -> dict[str, np.ndarray] | None:
        """i2v: the clip's first frame, uint8 (H, W, 3) at the clip's size, as the i2v pipeline conditions on it, with
        `parts` the loaded `image_condition_components` (SigLIP and its processor); None for t2v.

        `image_latent` (32, 1, h, w): the frame encoded alone, `latent_dist.mode()` * scaling (HVI:375-388), whatever
        `latent_sampling` says (the pipeline never samples it). `image_embeds` (729, D): SigLIP's last_hidden_state
        after the feature extractor's resize (HVI:391-402). The pipeline first crops the image to its bucket; clips
        already are at their bucket's size, so the frame goes in as it is.
        """
        if not self.flavour.image_is_first_frame:
            return None
        image_encoder, feature_extractor = parts
        frame = torch.from_numpy(np.array(clip["frames"][0]))  # copy: Arrow is read-only
        latent = self.vae_encode(vae, frame[None, None].to(next(vae.parameters()).device), "mode")[0]
        inputs = feature_extractor.preprocess(images=Image.fromarray(frame.cpu().numpy()), do_resize=True,
                                              return_tensors="pt", do_convert_rgb=True)
        encoder_dtype = next(image_encoder.parameters()).dtype
        pixels = inputs["pixel_values"].to(next(image_encoder.parameters()).device, encoder_dtype)
        embeds = image_encoder(pixel_values=pixels).last_hidden_state[0]
        return {"image_latent": latent.float().cpu().numpy(), "image_embeds": embeds.float().cpu().numpy()}

    # 3. transformer --------------------------------------------------------------------------------
    def velocity(
        self,
        transformer: torch.nn.Module,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        text: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """The pipeline's denoiser call (HV:737-785): t2v with zero condition latents, zero mask, zero image; i2v
        (HVI:851-909) with `text["image_latent"]` (B, 32, 1, h, w) in frame 0 of the condition channels, mask 1 on
        frame 0 and `text["image_embeds"]` (B, 729, D), as cached by the latents stage."""
        key_mask_attention(transformer)
        cond, mask, image_embeds = self._condition(transformer, noisy, text)
        dtype = compute_dtype(transformer)
        timestep = (sigma * 1000).to(dtype)
        # Mean flow (step-distilled): the model predicts the average velocity from t down to timestep_r (the
        # pipeline's next step, HVI:855-862); over the empty interval r = t that is the instantaneous velocity,
        # the flow-matching target trained here.
        interval = {"timestep_r": timestep} if transformer.config.use_meanflow else {}
        out = transformer(
            hidden_states=torch.cat([noisy, cond, mask], dim=1).to(dtype),  # (B, 32+32+1, T, h, w)
            image_embeds=image_embeds.to(dtype),
            timestep=timestep,
            **interval,
            encoder_hidden_states=text["text_embeds"].to(dtype),
            encoder_attention_mask=text["text_mask"].to(dtype),
            encoder_hidden_states_2=text["byt5_embeds"].to(dtype),
            encoder_attention_mask_2=text["byt5_mask"].to(dtype),
            attention_kwargs=None,
            return_dict=False,
        )[0]
        return out.float()  # (B, 32, T, h, w)

    def _condition(
        self, transformer: torch.nn.Module, noisy: torch.Tensor, text: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cond, mask, image_embeds) for the flavour's task; t2v's for a batch an i2v run trains as t2v (`AS_T2V`)."""
        batch, _, frames, height, width = noisy.shape
        cond = torch.zeros_like(noisy)
        mask = torch.zeros(batch, 1, frames, height, width, dtype=noisy.dtype, device=noisy.device)
        if not self.flavour.image_is_first_frame or AS_T2V in text:
            image_embeds = torch.zeros(batch, IMAGE_TOKENS, transformer.config.image_embed_dim, device=noisy.device)
            return cond, mask, image_embeds
        if "image_latent" not in text or "image_embeds" not in text:
            raise KeyError(f"flavour '{self.flavour.name}' conditions on a first frame: `velocity` needs the latent "
                           "rows' `image_latent` and `image_embeds` (re-materialize `latents` for this flavour)")
        # Every row of an i2v batch carries its own SigLIP tokens: the DiT drops the image stream only when the
        # whole batch's tokens are 0 (HVT:701), so t2v and i2v rows never share a batch (one flavour per run).
        cond[:, :, :1] = text["image_latent"].to(cond.dtype)  # frames 1.. stay zero (HVI:625-626)
        mask[:, :, 0] = 1
        return cond, mask, text["image_embeds"]

    def lora_targets(self, include_ffn: bool) -> str:
        """A regex, not suffixes: the suffixes alone would also adapt the token refiner (see ATTENTION_TARGETS)."""
        return lora_pattern(include_ffn)

    def save_lora(
        self, state_dict: dict[str, torch.Tensor], out_dir: str | Path, adapter_config: dict | None = None
    ) -> None:
        """diffusers format (HV1.5 pipelines have no LoRA mixin): `save_transformer_lora`."""
        save_transformer_lora(state_dict, out_dir, adapter_config)

    def encodes_like_twin(self, tokenizer: Any, text: str) -> bool:
        return False  # no twin

    # 4. render ---------------------------------------------------------------------------------------
    def load_renderer(
        self, model: ModelSource | str, lora_path: str | None, device: torch.device,
        transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None,
    ) -> HunyuanVideo15Pipeline:
        """The t2v pipeline, or for i2v the image-to-video one (which also loads image_encoder, feature_extractor)."""
        pipeline = HunyuanVideo15ImageToVideoPipeline if self.flavour.image_is_first_frame else HunyuanVideo15Pipeline
        pipe = load_pipeline(pipeline, model, lora_path, device, transformer, plan, self.tread_layout.blocks)
        self.setup_vae(pipe.vae)
        return pipe

    @torch.no_grad()
    def render(
        self, pipe: HunyuanVideo15Pipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
        lora_scale: float | None = 1.0, image: np.ndarray | None = None,
    ) -> np.ndarray:
        """t2v, or i2v from `image` (uint8 (H, W, 3) at the render size) as the first frame."""
        inputs = self._image_input(pipe, image, settings)
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
        pipe.guider = pipe.guider.new(guidance_scale=settings.guidance)  # __call__ has no guidance argument
        set_lora_scale(pipe.transformer, lora_scale)
        key_mask_attention(pipe.transformer)
        pos = self.collate_text([prompt], pipe._execution_device)
        neg = self.collate_text([negative], pipe._execution_device)
        video = pipe(
            **inputs,
            prompt_embeds=pos["text_embeds"],
            prompt_embeds_mask=pos["text_mask"],
            prompt_embeds_2=pos["byt5_embeds"],
            prompt_embeds_mask_2=pos["byt5_mask"],
            negative_prompt_embeds=neg["text_embeds"],
            negative_prompt_embeds_mask=neg["text_mask"],
            negative_prompt_embeds_2=neg["byt5_embeds"],
            negative_prompt_embeds_mask_2=neg["byt5_mask"],
            num_frames=settings.num_frames,
            num_inference_steps=settings.num_inference_steps,
            generator=torch.Generator().manual_seed(settings.seed),
            output_type="np",
        ).frames[0]
        return (np.clip(video, 0, 1) * 255).round().astype(np.uint8)  # (F, H, W, 3)

    def _image_input(self, pipe: Any, image: np.ndarray | None, settings: RenderSettings) -> dict[str, Any]:
        """i2v: {"image": PIL} (checked: size, and that the pipeline renders at that size); t2v: height, width."""
        picture = first_frame(self.flavour, image, settings)
        if picture is None:
            return {"height": settings.height, "width": settings.width}
        # The i2v pipeline takes no height/width: it crop-resizes the image to the bucket of transformer
        # target_size closest to its aspect (HVI:756-759). Another size would render silently at that bucket.
        bucket = pipe.video_processor.calculate_default_height_width(settings.height, settings.width, pipe.target_size)
        if tuple(bucket) != (settings.height, settings.width):
            raise ValueError(f"`validation_resolution` {settings.width}x{settings.height}: HunyuanVideo 1.5 i2v "
                             f"renders at its size bucket {bucket[1]}x{bucket[0]} (WxH) for that aspect "
                             f"(target_size {pipe.target_size}); set validation_resolution to it")
        return {"image": picture}


def frame_causal_mask(n_frame: int, n_hw: int, dtype: torch.dtype, device: torch.device,
                      batch_size: int | None = None) -> torch.Tensor:
    """diffusers' HunyuanVideo15AttnBlock.prepare_causal_attention_mask (a token sees its own latent frame and the
    earlier ones: 0, else -inf), filled one frame's rows at a time instead of one row at a time: the same tensor and
    the same single allocation, in n_frame steps instead of n_frame * h * w (25,440 Python steps at 480p x 61: a
    kernel launch each on a GPU, and minutes on fake tensors)."""
    seq_len = n_frame * n_hw
    mask = torch.full((seq_len, seq_len), float("-inf"), dtype=dtype, device=device)
    for frame in range(n_frame):
        mask[frame * n_hw:(frame + 1) * n_hw, :(frame + 1) * n_hw] = 0
    return mask if batch_size is None else mask.unsqueeze(0).expand(batch_size, -1, -1)



def make_family(flavour: str | None) -> HunyuanVideo15:
    """t2v and i2v flavours; i2v trains with the cached first-frame latent and SigLIP tokens (never zeros)."""
    return HunyuanVideo15(flavour=SPEC.flavour(flavour))
