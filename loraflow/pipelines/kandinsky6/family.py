"""Kandinsky 6.0 (Lite/Pro; pretrain, sft, π-Flow distilled; t2v and i2v): text, latents, the transformer call, LoRA
targets and file, renders.

Mirrors diffusers' `Kandinsky6TI2VAPipeline` (pipelines/kandinsky6/pipeline_kandinsky6_ti2va.py, `K6`) and
`Kandinsky6Transformer3DModel` (models/transformers/transformer_kandinsky6.py, `K6T`).

What it shares with Kandinsky 5 Video is the same computation, imported from `kandinsky5`: the text encoders
(Qwen2.5-VL's last hidden state after the original "promt" template, cropped at its prefix, and CLIP-L's pooled
output: `Kandinsky5Shared`) and the video VAE (AutoencoderKLHunyuanVideo, `encode_video`). Two text differences, both
the release's: Kandinsky 6 keeps up to 1024 caption tokens (Kandinsky 5 Video 256) and encodes the text as given
(Kandinsky 5's pipelines `prompt_clean` it first). A text both encode alike (clean, and within 256 tokens) is keyed
as Kandinsky 5 Video keys it (`text_twin`), and a clip's latent key names the clip and the VAE only: a Kandinsky 5
dataset's caches serve a Kandinsky 6 run over the same clips.

The transformer takes a text mask (K6:294-296, K6T `encoder_attention_mask`), so a batch pads its texts
(`collate_text`). i2v (`tail_cond_first_frame`, K6:848-867 and 877-887): the image's latent is one extra clean latent
frame after the generated ones, masked in the condition channels, token type 1, at the rotary position of frame 0;
its prediction is dropped. The distilled (π-Flow) transformers output `n_grid` velocities per latent channel, each
anchored at the same x_t (`PiflowScheduler`, schedulers/scheduling_piflow.py: `DXPolicy` turns output g into
x0_g = x_t - sigma * output_g): trained on clips, every one of them has the flow-matching target noise - x0
(`kernels.flow_matching.flow_mse` compares each with it).

Sound (`train_audio`, `trains_audio`): the pipeline denoises the audio latents beside the video's in the same
transformer call (K6:889-899, `audio_hidden_states`) at the same timestep: K6T `forward` takes one `timestep`,
"shared by both modalities" (K6T:760-761), and embeds it for each stream (K6T:794 and 800); the audio's scheduler is
a copy of the video's (K6:818), stepped with the same `t` (K6:920-921). So `velocity` takes the noisy audio latents
at the sample's one sigma and returns both predictions; the LoRA then also targets the audio stream and the two
cross-modal attentions (`lora_pattern`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline, PiflowScheduler
from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean

from loraflow.kernels.tread import TokenLayout
from loraflow.keys import content_key
from loraflow.media.types import Sound
from loraflow.pipelines.base import (
    AS_T2V,
    Rendered,
    RenderSettings,
    TextRow,
    compute_dtype,
    first_frame,
    load_pipeline,
    padded,
    save_transformer_lora,
    set_lora_scale,
    stacked,
)
from loraflow.pipelines.comfyui import ComfyRule
from loraflow.pipelines.kandinsky5.common import CLIP_TOKENS, Kandinsky5Shared, encode_video, template_crop
from loraflow.pipelines.kandinsky5.video.family import NEGATIVE_PROMPT, ORIGINAL_TEMPLATE, Kandinsky5Video
from loraflow.pipelines.kandinsky5.video.spec import SPEC as K5_VIDEO
from loraflow.pipelines.kandinsky6.spec import SPEC
from loraflow.pipelines.sources import ModelSource

if TYPE_CHECKING:
    from loraflow.pipelines.render_memory import RenderPlan

PROJECTIONS = ("to_query", "to_key", "to_value", "out_layer")
FFN = (r"feed_forward\.net\.0\.proj", r"feed_forward\.net\.2")  # diffusers' FeedForward: GELU's proj, the out linear
# ComfyUI runs Kandinsky 6 through the original's custom node (kandinskylab/kandinsky-6 comfyui/kandinsky6), whose
# model is a ComfyUI BaseModel (`diffusion_model.` + its DiT's names, model_base.py) that loads diffusers checkpoints
# by renaming their keys (register.py `_native_key`: visual_transformer_blocks. -> visual_blocks., .video_dec_block.
# -> .videoT., .audio_dec_block. -> .audioT., .feed_forward.net.0.proj. -> .feed_forward.in_layer., .net.2. ->
# .out_layer., a text block's .attn. -> .self_attention.; `_K6_REQUIRED_KEYS` lists the renamed ones). ComfyUI's
# comfy/lora.py then takes `diffusion_model.<name>` LoRA keys for those names (loraflow/pipelines/comfyui.py).
_FUSED = r"visual_transformer_blocks\.(\d+)\."
_STREAM = _FUSED + r"(video|audio)_dec_block\."
_TEXT = r"((?:video|audio)_text_transformer_blocks\.\d+)\."
KANDINSKY6_COMFYUI_NAMES = (
    ComfyRule(_STREAM + r"((?:self|cross)_attention\.\w+)", r"visual_blocks.\1.\2T.\3"),
    ComfyRule(_STREAM + r"feed_forward\.net\.0\.proj", r"visual_blocks.\1.\2T.feed_forward.in_layer"),
    ComfyRule(_STREAM + r"feed_forward\.net\.2", r"visual_blocks.\1.\2T.feed_forward.out_layer"),
    ComfyRule(_FUSED + r"((?:va|av)_cross_attention\.\w+)", r"visual_blocks.\1.\2"),
    ComfyRule(_TEXT + r"attn\.(\w+)", r"\1.self_attention.\2"),
    ComfyRule(_TEXT + r"feed_forward\.net\.0\.proj", r"\1.feed_forward.in_layer"),
    ComfyRule(_TEXT + r"feed_forward\.net\.2", r"\1.feed_forward.out_layer"),
)


def lora_pattern(include_ffn: bool, audio: bool) -> str:
    """A peft regex (full match) for the video stream's attention (its text blocks' self-attention, each fused
    block's video self- and cross-attention), with `audio` the audio stream's and the two cross-modal attentions too;
    `include_ffn` adds their feed-forwards. Suffixes would not do: the video and audio streams share every name."""
    streams = ("video", "audio") if audio else ("video",)
    projections = "|".join(PROJECTIONS)
    stream = "|".join(streams)
    parts = [rf"({stream})_text_transformer_blocks\.\d+\.attn\.({projections})",
             rf"visual_transformer_blocks\.\d+\.({stream})_dec_block\.(self|cross)_attention\.({projections})"]
    if audio:
        parts.append(rf"visual_transformer_blocks\.\d+\.(va|av)_cross_attention\.({projections})")
    if include_ffn:
        ffn = "|".join(FFN)
        parts += [rf"({stream})_text_transformer_blocks\.\d+\.({ffn})",
                  rf"visual_transformer_blocks\.\d+\.({stream})_dec_block\.({ffn})"]
    return "|".join(f"({p})" for p in parts)


@dataclass(frozen=True)
class Kandinsky6(Kandinsky5Shared):
    # The original's template (kandinsky-6 comfyui nodes.py PROMPT_TEMPLATE, K6 `_PROMPT_TEMPLATE`): Kandinsky 5's
    prompt_templates: ClassVar[dict[str, str]] = {"original": ORIGINAL_TEMPLATE}
    cleans_prompts: ClassVar[bool] = False  # K6:279 and the original's text embedder encode the text as given
    # flavour, template, text_components: Kandinsky5Shared's
    name: str = SPEC.name
    spatial_multiple: int = SPEC.spatial_multiple
    vae_temporal_factor: int = SPEC.vae_temporal_factor
    default_negative_prompt: str = NEGATIVE_PROMPT  # K6 `_DEFAULT_NEGATIVE_PROMPT`, Kandinsky 5's
    # fused block(visual (B, N, D), audio, text_v, text_a, (t_v, t_a), visual rope (N, 1, d/2, 2, 2), audio rope,
    # mask) -> (visual, audio)
    tread_layout: TokenLayout = TokenLayout("visual_transformer_blocks", rope_arg=5, rope_token_dim=0,
                                            output_index=0, depth="num_visual_blocks")
    comfyui_names: tuple[ComfyRule, ...] = KANDINSKY6_COMFYUI_NAMES
    musubi_names: tuple[ComfyRule, ...] = ()  # musubi-tuner has no Kandinsky 6 model (pipelines/musubi.py)
    image_condition_components: tuple[str, ...] = ()  # the VAE alone encodes the image
    # i2v: "first_frame", the latents stage caches each clip's first frame encoded alone (the appended tail frame);
    # `make_family` sets it from the flavour
    image_condition_name: str = ""
    # `train_audio` (get_family sets it): the LoRA targets the audio stream and the cross-modal attentions too
    trains_audio: bool = False

    # 1. text: Kandinsky5Shared's encoders, as given, 1024 tokens; padded batches with a mask -------------------
    @property
    def text_signature(self) -> str:
        return content_key(template=self.prompt_template, max_tokens=self.max_text_tokens, clip_tokens=CLIP_TOKENS,
                           cleaned=False)

    @property
    def text_twin(self) -> Kandinsky5Video:
        """Kandinsky 5 Video with the same template: its rows are this family's for a text `prompt_clean` leaves
        as it is and its 256-token limit does not cut (`encodes_like_twin`)."""
        return Kandinsky5Video(flavour=K5_VIDEO.flavour(None))

    def encodes_like_twin(self, tokenizer: Any, text: str) -> bool:
        twin = self.text_twin
        if prompt_clean(text) != text:
            return False
        limit = template_crop(tokenizer, twin.prompt_template) + twin.max_text_tokens
        return twin.templated_tokens(tokenizer, text) <= limit

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        """Right-padded to the batch's longest text, with `text_mask` (bool) where any row is shorter: the pipeline's
        padding mask (K6:294-296: none when no prompt is padded)."""
        embeds, mask = padded([r["text_embeds"] for r in rows], [np.ones(len(r["text_embeds"])) for r in rows])
        text = {"text_embeds": embeds.to(device), "pooled_embeds": stacked(rows, "pooled_embeds").to(device)}
        if not bool(mask.all()):
            text["text_mask"] = mask.bool().to(device)
        return text

    # 2. latents -------------------------------------------------------------------------------------------------
    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        return encode_video(vae, frames, sampling)

    @torch.no_grad()
    def image_condition(self, vae: torch.nn.Module, parts: Sequence[Any], clip: Mapping[str, Any]
                        ) -> dict[str, np.ndarray] | None:
        """i2v: {"image_latent" (16, 1, h, w)}: the clip's first frame encoded alone, as the pipeline encodes its image
        (K6 `encode_image`), whose posterior it samples: the mode is cached, the same every epoch. None for t2v."""
        if not self.flavour.image_is_first_frame:
            return None
        frame = torch.from_numpy(np.array(clip["frames"][0]))  # copy: Arrow is read-only
        latent = self.vae_encode(vae, frame[None, None].to(next(vae.parameters()).device), "mode")[0]
        return {"image_latent": latent.float().cpu().numpy()}

    def example_image_condition(self, transformer_config: Mapping[str, Any],
                                latent_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        if not self.flavour.image_is_first_frame:
            return {}
        channels, _, height, width = latent_shape
        return {"image_latent": np.ones((channels, 1, height, width), np.float32)}

    # 3. transformer ---------------------------------------------------------------------------------------------
    def velocity(
        self, transformer: torch.nn.Module, noisy: torch.Tensor, sigma: torch.Tensor, text: Mapping[str, torch.Tensor],
        audio: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's denoiser call (K6:877-900) on noisy latents (B, 16, T, h, w) -> (B, 16 n_grid, T, h, w):
        t2v with zero condition channels; i2v with `text["image_latent"]` (B, 16, 1, h, w) as the clean tail frame.
        The timestep is sigma * 1000 in float32, as the pipeline passes its scheduler's timesteps.

        With `audio`, noisy audio latents (B, C_a, L) at the same sigma (the layout the pipeline takes and returns
        them in; it hands the transformer (B, L, C_a), K6:617-620 and 943): the joint call, which returns (video
        prediction, audio prediction (B, C_a n_grid, L)); the transformer builds the audio's rotary positions itself
        (arange over L, K6T:819-821), as the pipeline leaves it to."""
        hidden = noisy.permute(0, 2, 3, 4, 1)  # (B, T, h, w, C): channels-last DiT layout
        batch, frames, height, width, _ = hidden.shape
        tail = self.flavour.image_is_first_frame and AS_T2V not in text
        types = positions = None
        if tail:
            if "image_latent" not in text:
                raise KeyError(f"flavour '{self.flavour.name}' conditions on a first frame: `velocity` needs the "
                               "latent rows' `image_latent` (re-materialize `latents` for this flavour)")
            image = text["image_latent"].to(hidden.dtype).permute(0, 2, 3, 4, 1)  # (B, 1, h, w, C)
            hidden = torch.cat([hidden, image], dim=1)
            types = torch.zeros(batch, frames + 1, dtype=torch.long, device=hidden.device)
            types[:, -1] = 1
            patch_t, patch_h, patch_w = transformer.config.patch_size
            positions = (torch.cat([torch.arange(frames // patch_t, device=hidden.device),
                                    torch.zeros(1, dtype=torch.long, device=hidden.device)]),
                         torch.arange(height // patch_h, device=hidden.device),
                         torch.arange(width // patch_w, device=hidden.device))
        if transformer.config.visual_cond:  # [latent | zero condition latent | mask], the mask 1 on the tail
            mask = torch.zeros(*hidden.shape[:-1], 1, dtype=hidden.dtype, device=hidden.device)
            if tail:
                mask[:, -1] = 1
            hidden = torch.cat([hidden, torch.zeros_like(hidden), mask], dim=-1)
        dtype = compute_dtype(transformer)
        out = transformer(
            hidden_states=hidden.to(dtype),
            audio_hidden_states=None if audio is None else audio.permute(0, 2, 1).to(dtype),
            encoder_hidden_states=text["text_embeds"].to(dtype),
            pooled_projections=text["pooled_embeds"].to(dtype),
            timestep=sigma.float() * 1000,
            visual_rope_pos=positions,
            encoder_attention_mask=text.get("text_mask"),
            visual_token_type_ids=types,
            return_dict=False,
        )
        video = out[0][:, :frames].permute(0, 4, 1, 2, 3).float()  # the tail's prediction dropped
        return video if audio is None else (video, out[1].permute(0, 2, 1).float())

    def lora_targets(self, include_ffn: bool) -> str:
        return lora_pattern(include_ffn, audio=self.trains_audio)

    def save_lora(self, state_dict: dict[str, torch.Tensor], out_dir: str | Path,
                  adapter_config: dict | None = None) -> None:
        """diffusers format: Kandinsky6TI2VAPipeline has no LoRA mixin; its transformer's `load_lora_adapter` reads
        what `save_transformer_lora` writes."""
        save_transformer_lora(state_dict, out_dir, adapter_config)

    # 4. render --------------------------------------------------------------------------------------------------
    def load_renderer(self, model: ModelSource | str, lora_path: str | None, device: torch.device,
                      transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None
                      ) -> Kandinsky6TI2VAPipeline:
        """The TI2VA pipeline (t2v and i2v alike: one checkpoint, the image decides), its scheduler the checkpoint's
        (FlowMatchEulerDiscreteScheduler, or PiflowScheduler for the distilled ones)."""
        return load_pipeline(self.pipeline_class, model, lora_path, device, transformer, plan,
                             self.tread_layout.blocks)

    @property
    def pipeline_class(self) -> type:
        return Kandinsky6TI2VAPipeline

    @torch.no_grad()
    def render(self, pipe: Kandinsky6TI2VAPipeline, prompt: TextRow, negative: TextRow, settings: RenderSettings,
               lora_scale: float | None = 1.0, image: np.ndarray | None = None, sound: bool = False
               ) -> np.ndarray | Rendered:
        """t2v, or i2v from `image` (uint8 (H, W, 3) at the render size): the video alone (`sample_audio=False`; a
        π-Flow distilled flavour samples its sound all the same, as the original must: `Flavour.sound_required`), or
        with `sound` both streams denoised together, as the release renders (K6:667 `sample_audio` defaults to True),
        and the waveform the vocoder makes of the audio latents (K6:950-955: (B, samples) at the audio VAE's
        `sample_rate`, K6:254-256) over the video's span. The pipeline renders whole audio latent frames
        (K6:835-841: ceil(F / fps x rate / latent hop)), so its waveform runs up to one latent hop (1024 samples)
        past the last frame: cut at F / fps seconds."""
        picture = first_frame(self.flavour, image, settings)
        if isinstance(pipe.scheduler, PiflowScheduler) and settings.guidance != 1.0:
            raise ValueError(f"`validation_guidance` {settings.guidance}: flavour '{self.flavour.name}' is π-Flow "
                             "distilled, which renders without classifier-free guidance (PiflowScheduler needs "
                             "guidance 1.0, the release's); set validation_guidance: 1.0 or leave it out")
        scheduler = PiflowScheduler if isinstance(pipe.scheduler, PiflowScheduler) else FlowMatchEulerDiscreteScheduler
        pipe.scheduler = scheduler.from_config(pipe.scheduler.config, shift=settings.flow_shift)
        set_lora_scale(pipe.transformer, lora_scale)
        pos, neg = self.collate_text([prompt], pipe.device), self.collate_text([negative], pipe.device)
        out = pipe(
            image=picture, prompt_embeds=pos["text_embeds"], pooled_prompt_embeds=pos["pooled_embeds"],
            negative_prompt_embeds=neg["text_embeds"], negative_pooled_prompt_embeds=neg["pooled_embeds"],
            height=settings.height, width=settings.width, num_frames=settings.num_frames,
            frame_rate=self.flavour.fps, num_inference_steps=settings.num_inference_steps,
            guidance_scale=settings.guidance, generator=torch.Generator().manual_seed(settings.seed),
            sample_audio=sound or bool(self.flavour.sound_required), output_type="np",
        )
        video = (np.clip(out.frames[0], 0, 1) * 255).round().astype(np.uint8)  # (F, H, W, 3)
        if not sound:  # a distilled flavour's sound is sampled all the same (`Flavour.sound_required`), not returned
            return video
        rate = int(pipe.audio_sample_rate)
        samples = round(settings.num_frames / self.flavour.fps * rate)
        waveform = out.audio[0]
        if len(waveform) < samples:
            raise RuntimeError(f"the pipeline rendered {len(waveform)} audio samples for {settings.num_frames} "
                               f"frames at {self.flavour.fps} fps, fewer than their {samples}: a bug")
        return Rendered(video, Sound(waveform[:samples].astype(np.float32), rate))


def make_family(flavour: str | None) -> Kandinsky6:
    picked = SPEC.flavour(flavour)
    return Kandinsky6(flavour=picked, image_condition_name="first_frame" if picked.image_is_first_frame else "")

