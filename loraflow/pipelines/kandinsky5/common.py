"""What Kandinsky 5.0 Video and Image share: the Qwen2.5-VL + CLIP text path, the transformer's LoRA targets and
file format, the pipelines' prompt-embedding arguments, and the adapters' fields of equal value. Both families' adapters
subclass `Kandinsky5Shared` and name their own `prompt_templates` (the only difference on the text side, except for
Image i2i, whose Qwen path also sees the source image: `image/family.py` `Kandinsky5ImageI2I.encode_text`).

Two templates per family (config `kandinsky5_prompt_template`): "original", the original repository's (its system
prompt says "You are a promt engineer", as the checkpoints were trained with, and as ComfyUI, FastVideo, musubi-tuner
and diffusers before 0.42 encode), the default; and "diffusers", diffusers 0.42.1's ("prompt" spelled right). The crop
is each template's prefix, counted with the checkpoint's tokenizer: 129 / 41 and 128 / 40 with the real Qwen2.5 one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers.loaders import KandinskyLoraLoaderMixin
from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean
from transformers import ProcessorMixin

from loraflow.kernels.tread import TokenLayout
from loraflow.keys import content_key
from loraflow.pipelines.base import TextRow, compute_dtype, scaled_posterior, stacked
from loraflow.pipelines.comfyui import ComfyRule
from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.sources import ModelSource

CLIP_TOKENS = 77
PROMPT_TEMPLATES = ("original", "diffusers")  # config `kandinsky5_prompt_template`; the first is the default
# ComfyUI's Kandinsky5 model (comfyanonymous/ComfyUI comfy/ldm/kandinsky5/model.py) keeps the original checkpoint's
# module names, which are also diffusers' (models/transformers/transformer_kandinsky.py):
# text_/visual_transformer_blocks.N.self_attention|cross_attention.to_query|to_key|to_value|out_layer,
# .feed_forward.in_layer|out_layer. So the ComfyUI name is the diffusers name (ComfyUI's comfy/lora.py even accepts it
# with a `transformer.` prefix, but then ignores lora_alpha). Video and image use the same transformer class.
KANDINSKY5_COMFYUI_NAMES = (
    ComfyRule(
        r"((?:text|visual)_transformer_blocks\.\d+\.(?:self_attention|cross_attention|feed_forward)\.\w+)", r"\1"
    ),
)
# musubi-tuner's Kandinsky 5 DiT (kohya-ss/musubi-tuner kandinsky5/models/dit.py, nn.py at 30c658c4f4b0) keeps the
# same module names too: its names are the diffusers ones (pipelines/musubi.py)
KANDINSKY5_MUSUBI_NAMES = KANDINSKY5_COMFYUI_NAMES


def template_crop(tokenizer: Any, template: str) -> int:
    """Tokens in `template` before the user text (with the real Qwen2.5 tokenizer: 129 video, 41 image for the
    original templates, 128 / 40 for diffusers 0.42.1's).

    Computed, not hard-coded: a different tokenizer (the tiny offline one) splits the prefix differently.
    `tokenizer` may be a Qwen2-VL processor (Image i2i's): its text tokenizer counts.
    """
    if isinstance(tokenizer, ProcessorMixin):
        tokenizer = tokenizer.tokenizer
    return len(tokenizer(template.split("{}")[0])["input_ids"])


def clip_pooled(components: Mapping[str, Any], text: str) -> np.ndarray:
    """CLIP-L pooled output (768,) of a cleaned text, padded to 77 tokens as in every K5 pipeline's
    `_encode_prompt_clip`."""
    return pooled_output(components, text).float().cpu().numpy()


def pooled_output(components: Mapping[str, Any], text: str) -> torch.Tensor:
    """`clip_pooled` as a tensor on the encoder's device."""
    clip_tokenizer, clip = components["tokenizer_2"], components["text_encoder_2"]
    clip_ids = clip_tokenizer(
        [text], max_length=CLIP_TOKENS, truncation=True, padding="max_length", return_tensors="pt"
    ).to(clip.device)
    return clip(**clip_ids)["pooler_output"][0]


def encode_video(vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
    """uint8 (B, F, H, W, 3) -> AutoencoderKLHunyuanVideo's scaled latents (B, 16, T, h, w) (`scaled_posterior`), as
    Kandinsky 5 Video encodes its clips: Kandinsky 6 encodes its clips with this same function, so a latent of one is
    a latent of the other (the latent key names the clip and the VAE, not the family)."""
    pixels = frames.permute(0, 4, 1, 2, 3).to(vae.dtype) / 127.5 - 1.0  # (B, 3, F, H, W) in [-1, 1]
    posterior = vae.encode(pixels).latent_dist
    return scaled_posterior(posterior, sampling, vae.config.scaling_factor)  # the pipeline divides by it, no shift


def cu_seqlens(embeds: torch.Tensor) -> torch.Tensor:
    """Cumulative text lengths of a batch of unpadded, equal-length rows, as the pipelines take them."""
    batch, length = embeds.shape[:2]
    return torch.arange(batch + 1, dtype=torch.int32) * length


def uses_nabla(transformer: torch.nn.Module) -> bool:
    """The checkpoint attends with NABLA (block-sparse; the 10 s video checkpoints' config says so)."""
    return transformer.config.get("attention_type") == "nabla"


def use_flex_attention(transformer: torch.nn.Module) -> None:
    """NABLA's mask is a flex-attention BlockMask, which only diffusers' "flex" backend takes (the default native
    backend fails on it): this model's attention runs flex (kernels/attention_backend.py, for this model only)."""
    from loraflow.kernels.attention_backend import set_attention_backend

    set_attention_backend(transformer, "flex")


def nabla_params(pipeline: type, transformer: torch.nn.Module, hidden: torch.Tensor) -> dict[str, Any] | None:
    """The `sparse_params` the video `pipeline` passes to every transformer call for a latent of `hidden`'s shape
    (B, T, h, w, C): NABLA's when the checkpoint uses it, else None. Computed by the pipeline's own
    `get_sparse_params`, which reads nothing of the pipeline but its transformer, so training, eval loss and renders
    pass exactly what inference passes."""
    if not uses_nabla(transformer):
        return None
    if torch.is_grad_enabled() and hidden.device.type != "cuda":
        raise ValueError("this checkpoint's transformer uses NABLA attention (attention_type: nabla), which trains on "
                         "CUDA only: torch's flex attention has no backward on the CPU. Train on a GPU, or use a 5 s "
                         "checkpoint (attention_type flash)")
    use_flex_attention(transformer)
    as_pipeline = SimpleNamespace(transformer=transformer, fast_sta_nabla=pipeline.fast_sta_nabla)
    return pipeline.get_sparse_params(as_pipeline, hidden, hidden.device)


def denoise(
    transformer: torch.nn.Module, hidden: torch.Tensor, sigma: torch.Tensor, text: Mapping[str, torch.Tensor],
    scale_factor: Sequence[float], sparse_params: dict[str, Any] | None = None,
) -> torch.Tensor:
    """One Kandinsky 5 DiT call, as every K5 pipeline's loop makes it, on channels-last `hidden` (B, T, h, w, C_in)
    -> velocity (B, 16, T, h, w) float32. `scale_factor`: the RoPE scale (video: by size; image: 1);
    `sparse_params`: the video pipelines' NABLA parameters (`nabla_params`), None for the image pipelines."""
    _, frames, height, width, _ = hidden.shape
    dtype = compute_dtype(transformer)
    out = transformer(
        hidden_states=hidden.to(dtype),
        encoder_hidden_states=text["text_embeds"].to(dtype),
        pooled_projections=text["pooled_embeds"].to(dtype),
        timestep=(sigma * 1000).to(dtype),
        visual_rope_pos=[
            torch.arange(frames, device=hidden.device),
            torch.arange(height // 2, device=hidden.device),
            torch.arange(width // 2, device=hidden.device),
        ],
        text_rope_pos=torch.arange(text["text_embeds"].shape[1], device=hidden.device),
        scale_factor=list(scale_factor),
        sparse_params=sparse_params,
        return_dict=True,  # with False this model returns the bare tensor, unlike most diffusers models
    ).sample
    return out.permute(0, 4, 1, 2, 3).float()


@dataclass(frozen=True)
class Kandinsky5Shared:
    """The fields and methods of the family protocol that Kandinsky 5 Video and Image have alike; each family adds its
    `name` (read here too), sizes, negative prompt, latents, transformer call and render."""

    # "original" / "diffusers" -> the system prompt template; hidden states are cropped after its prefix
    prompt_templates: ClassVar[dict[str, str]]
    # Texts go through diffusers' `prompt_clean` first, as every Kandinsky 5 pipeline cleans them (Kandinsky 6's
    # pipeline and original encode the text as given)
    cleans_prompts: ClassVar[bool] = True
    text_twin: ClassVar[None] = None  # `ModelFamily.text_twin`: none
    flavour: Flavour
    template: str = "original"  # which of `prompt_templates` (config `kandinsky5_prompt_template`)
    text_components: tuple[str, ...] = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    # TREAD: visual blocks are called block(visual_embed (B, N, D), text, time, rope (B, N, 1, d/2, 2, 2), sparse)
    tread_layout: TokenLayout = TokenLayout("visual_transformer_blocks", rope_arg=3, rope_token_dim=1,
                                            depth="num_visual_blocks")
    comfyui_names: tuple[ComfyRule, ...] = KANDINSKY5_COMFYUI_NAMES  # one transformer class: one ComfyUI file
    musubi_names: tuple[ComfyRule, ...] = KANDINSKY5_MUSUBI_NAMES  # and one musubi-tuner file
    # Video i2v's image is latent frame 0 itself (`conditioning_frames`), and Image i2i's source latent needs the VAE
    # only: no component and nothing cached beside the latent (i2i names its `image_condition`: "source_image")
    image_condition_components: tuple[str, ...] = ()
    image_condition_name: str = ""

    @property
    def prompt_template(self) -> str:
        return self.prompt_templates[self.template]

    @property
    def max_text_tokens(self) -> int:
        """Caption tokens kept by encode_text after the template (the flavour's: 256 video, 512 image); longer
        captions are truncated."""
        return self.flavour.text_tokens

    @property
    def text_signature(self) -> str:
        """Part of every text key: another template or limit re-encodes."""
        return content_key(template=self.prompt_template, max_tokens=self.max_text_tokens, clip_tokens=CLIP_TOKENS)

    @torch.no_grad()
    def encode_text(
        self, components: Mapping[str, Any], texts: list[str], images: list[np.ndarray] | None = None
    ) -> list[TextRow]:
        """Qwen2.5-VL last hidden state after the template + CLIP-L pooled output, one text at a time.

        One at a time because the transformer has no text mask: each row keeps exactly its valid tokens.
        Text only: `images` is for Image i2i, whose prompts see the source image.
        """
        if images is not None:
            raise ValueError(f"{self.name} {self.flavour.name} encodes prompts alone; got source images")
        crop = template_crop(components["tokenizer"], self.prompt_template)
        rows = []
        for text in texts:
            row = self.prompt_tensors(components, text, crop)
            rows.append({k: v.float().cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in row.items()})
        return rows

    def prompt_tensors(self, components: Mapping[str, Any], text: str, crop: int) -> dict[str, Any]:
        """One text's row as tensors on the encoders' device (`encode_text` stores them as numpy; the real-size dry
        runs call this on fake encoders, which have no numbers to store)."""
        tokenizer, qwen = components["tokenizer"], components["text_encoder"]
        text, limit = prompt_clean(text) if self.cleans_prompts else text, crop + self.max_text_tokens
        templated = tokenizer(self.prompt_template.format(text))["input_ids"]
        ids = torch.tensor([templated[:limit]], device=qwen.device)  # the pipeline's truncation=True
        hidden = qwen(input_ids=ids, output_hidden_states=True, return_dict=True)["hidden_states"][-1]
        return {
            "text_embeds": hidden[0, crop:],  # (L, 3584)
            "pooled_embeds": pooled_output(components, text),  # (768,)
            # of the tokens encoded: the cleaned text, and the template's end (<|im_end|>) is cut first
            "truncated": len(templated) > limit,
        }

    def encodes_like_twin(self, tokenizer: Any, text: str) -> bool:
        return False  # no twin

    def templated_tokens(self, tokenizer: Any, text: str) -> int:
        """Tokens of `text` inside the template, cleaned as `prompt_tensors` cleans it, before any truncation."""
        text = prompt_clean(text) if self.cleans_prompts else text
        return len(tokenizer(self.prompt_template.format(text))["input_ids"])

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        lengths = {len(r["text_embeds"]) for r in rows}
        if len(lengths) != 1:
            # No text mask in this transformer: padding would be attended to (REFERENCE.md). Batches are
            # grouped by token length upstream; reaching here is a bug, not a user error.
            raise ValueError(f"Kandinsky 5 batches need equal text lengths; got {sorted(lengths)}")
        return {c: stacked(rows, c).to(device) for c in ("text_embeds", "pooled_embeds")}

    def example_text_row(self, transformer_config: Mapping[str, Any], n_tokens: int) -> TextRow:
        return {"text_embeds": np.zeros((n_tokens, transformer_config["in_text_dim"]), np.float32),
                "pooled_embeds": np.zeros(transformer_config["in_text_dim2"], np.float32)}

    def example_image_condition(self, transformer_config: Mapping[str, Any],
                                latent_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {}  # video i2v's image is latent frame 0 itself; Kandinsky 5 Image i2i overrides this

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        return ""  # any bucket size trains

    def setup_vae(self, vae: torch.nn.Module) -> None:
        """Nothing: Kandinsky's VAEs (HunyuanVideo's, Flux's) run as diffusers loads them."""

    def image_condition(self, vae: torch.nn.Module, parts: Sequence[Any], clip: Mapping[str, Any]) -> None:
        """Nothing cached beside the latent: video i2v's image is latent frame 0 itself (`conditioning_frames`);
        Image i2i overrides this with its source image's latent."""
        return None

    def prompt_embeds(self, prompt: TextRow, negative: TextRow, device: torch.device) -> dict[str, torch.Tensor]:
        """The pipelines' precomputed-embedding arguments for one prompt and its negative."""
        kwargs = {}
        for prefix, row in (("", prompt), ("negative_", negative)):
            text = self.collate_text([row], device)
            kwargs |= {f"{prefix}prompt_embeds_qwen": text["text_embeds"],
                       f"{prefix}prompt_embeds_clip": text["pooled_embeds"],
                       f"{prefix}prompt_cu_seqlens": cu_seqlens(text["text_embeds"]).to(device)}
        return kwargs

    def lora_targets(self, include_ffn: bool) -> list[str]:
        # Qualified suffixes: a bare `out_layer` would also hit modulation, time embedding and the final layer.
        targets = [f"{block}.{proj}" for block in ("self_attention", "cross_attention")
                   for proj in ("to_query", "to_key", "to_value", "out_layer")]
        if include_ffn:
            targets += ["feed_forward.in_layer", "feed_forward.out_layer"]
        return targets

    def save_lora(
        self, state_dict: dict[str, torch.Tensor], out_dir: str | Path, adapter_config: dict | None = None
    ) -> None:
        """diffusers format (`transformer.` prefix, LoraConfig in the header): every K5 pipeline's
        `load_lora_weights` (KandinskyLoraLoaderMixin) reads it."""
        KandinskyLoraLoaderMixin.save_lora_weights(
            out_dir, transformer_lora_layers=state_dict, safe_serialization=True,
            transformer_lora_adapter_metadata=adapter_config,
        )
