"""The family protocol and the machinery every family shares (component loading, fingerprints).

Tensor layouts used across the protocol:
    frames   uint8 (B, F, H, W, 3) RGB
    latents  float32 (B, C, T, h, w), already multiplied by the family's VAE scaling; with
             sampling "distribution" (B, 2C, T, h, w): the posterior's scaled mean, then its scaled
             log-variance, on the channel axis as diffusers lays out the posterior's parameters
    text     a dict of per-sample tensors from `encode_text`, batched by the caller
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from loraflow.kernels.tread import TokenLayout
from loraflow.media.types import Sound
from loraflow.pipelines.comfyui import ComfyRule
from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.sources import ModelRefused, ModelSource, as_source, model_index
from loraflow.safetensors_header import read_header

if TYPE_CHECKING:
    from loraflow.pipelines.render_memory import RenderPlan

TextRow = dict[str, np.ndarray]
LOADED_LIBRARIES = ("diffusers", "transformers")  # what model_index.json may name as a component's library


class ModelFamily(Protocol):
    """What a stage may ask of a model family. One implementation per module in `pipelines/`."""

    name: str
    flavour: Flavour
    spatial_multiple: int  # pixel sizes must be multiples of this (VAE factor x patch size)
    vae_temporal_factor: int
    text_components: tuple[str, ...]
    default_negative_prompt: str
    text_signature: str  # hash of template, token limits: part of every text key
    max_text_tokens: int  # the first text encoder keeps at most this many caption tokens (more: truncated)
    tread_layout: TokenLayout  # where the transformer keeps its visual tokens, for TREAD routing
    comfyui_names: tuple[ComfyRule, ...]  # diffusers module -> ComfyUI module (the ComfyUI file)
    # diffusers module -> the module of musubi-tuner's model (the musubi file); () where musubi has no loader
    musubi_names: tuple[ComfyRule, ...]
    # components the latents stage loads beside the VAE for `image_condition` (HV1.5 i2v's SigLIP); ()
    image_condition_components: tuple[str, ...]
    # what `image_condition` caches ("" nothing), for the latent key where it has no components, whose fingerprints
    # name it instead: "first_frame" (HunyuanVideo 1.5 and Kandinsky 6 i2v), "source_image" (Kandinsky 5 Image i2i)
    image_condition_name: str
    # The family whose text rows equal this one's for the texts `encodes_like_twin` accepts; those are keyed as the
    # twin keys them, so its text cache serves this family (Kandinsky 6: Kandinsky 5 Video's); None: no twin
    text_twin: ModelFamily | None

    def encodes_like_twin(self, tokenizer: Any, text: str) -> bool:
        """Whether `text` encodes exactly as `text_twin` encodes it (the first text encoder's `tokenizer` counts its
        tokens); False without a twin."""

    def encode_text(
        self, components: Mapping[str, Any], texts: list[str], images: list[np.ndarray] | None = None
    ) -> list[TextRow]:
        """One row per text: the valid tokens only (padding is rebuilt at batch time).

        `images`: for flavours whose prompt embedding sees an image (Kandinsky 5 Image i2i), one uint8 (H, W, 3)
        source image per text, required there; every other flavour raises ValueError when given images.
        A row may say `truncated` (bool) itself where the caption's budget is not `max_text_tokens` (i2i: what
        the image's vision tokens leave); the stage stores it instead of its own estimate.
        """

    def collate_text(self, rows: list[TextRow], device: torch.device) -> dict[str, torch.Tensor]:
        """Batch text rows for the transformer (padding, masks)."""

    def example_text_row(self, transformer_config: Mapping[str, Any], n_tokens: int) -> TextRow:
        """A row of zeros shaped as `encode_text` stores one with `n_tokens` caption tokens, for a transformer of this
        config: what `loraflow.estimates` feeds a fake training step (no text encoder loads)."""

    def example_image_condition(self, transformer_config: Mapping[str, Any],
                                latent_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        """What `image_condition` caches beside a latent of `latent_shape` (C, T, h, w), filled with ones ({} where
        the flavour caches nothing), for a transformer of this config: what `loraflow.estimates` adds to its fake
        batch. Ones, not zeros: HunyuanVideo 1.5 drops an all-zero image stream, which a real i2v run never does."""

    def size_problem(self, model: ModelSource | str | Path, height: int, width: int) -> str:
        """Why a clip of this bucket size cannot be trained ("" when it can), known before decoding: Kandinsky 5
        Image i2i's source image at this size gives more vision tokens than its prompt holds; "" elsewhere."""

    def vae_encode(self, vae: torch.nn.Module, frames: torch.Tensor, sampling: str = "mode") -> torch.Tensor:
        """uint8 (B, F, H, W, 3) -> scaled latents (B, C, T, h, w), or (B, 2C, T, h, w) mean and logvar
        (`scaled_posterior`)."""

    def setup_vae(self, vae: torch.nn.Module) -> None:
        """Ready a VAE of this family just loaded (the latents stage's, a render's, the estimates' fake ones), before it
        encodes or decodes: HunyuanVideo 1.5's builds its mid-block mask a frame at a time (`frame_causal_mask`);
        nothing elsewhere. This VAE only: the class stays as diffusers made it."""

    def image_condition(
        self, vae: torch.nn.Module, parts: Sequence[Any], clip: Mapping[str, Any]
    ) -> dict[str, np.ndarray] | None:
        """What the latents stage caches beside a clip's latent (IMAGE_CONDITION_COLUMNS, which then reach `velocity`
        through `image_conditions`), or None for flavours without it (t2v, t2i, K5 i2v: its image is latent frame 0).

        `parts`: the loaded `image_condition_components`, in order; `clip`: the stored clip row (`frames` uint8
        (F, H, W, 3), and `condition_frames` (1, H, W, 3), the source image of an i2i clip at its size).
        HunyuanVideo 1.5 i2v: {"image_latent" (32, 1, h, w), "image_embeds" (729, D)} of the first frame; Kandinsky 5
        Image i2i: {"image_latent" (16, 1, h, w)} of the source image.
        """

    def velocity(
        self, transformer: torch.nn.Module, noisy: torch.Tensor, sigma: torch.Tensor, text: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The transformer's flow-matching prediction for noisy latents (B, C, T, h, w) at sigma (B,).

        The first `flavour.conditioning_frames` latent frames of `noisy` are clean (`noisy_sample`): an i2v
        family marks them as given in the transformer's input. `text` also holds the latent rows'
        `image_conditions` where the family caches any (`image_condition`): `image_latent` (B, C, 1, h, w)
        float32, and for HunyuanVideo 1.5 i2v `image_embeds`.

        A family whose transformer denoises sound with the picture (a flavour with an `audio_vae`: Kandinsky 6) also
        takes `audio=` noisy audio latents (B, C_a, L) at the same sigma (`train_audio`; no other family is handed
        them) and then returns (video prediction, audio prediction).
        """

    def lora_targets(self, include_ffn: bool) -> list[str] | str:
        """peft `target_modules`: module-name suffixes, or one regex (full match) where suffixes are ambiguous."""

    def save_lora(
        self, state_dict: dict[str, torch.Tensor], out_dir: str | Path, adapter_config: dict | None = None
    ) -> None:
        """Write the adapter in the format the family's diffusers loader reads.

        `adapter_config` (peft's `LoraConfig.to_dict()`) goes into the file's header, as diffusers'
        `transformer_lora_adapter_metadata` does: without it a loader assumes lora_alpha = rank.
        """

    def load_renderer(
        self, model: ModelSource | str | Path, lora_path: str | None, device: torch.device,
        transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None,
    ) -> Any:
        """The family's diffusers pipeline without text encoders, loaded once per validation run.

        `lora_path` (the diffusers-format .safetensors the lora stage wrote) is loaded into `.transformer` as
        adapter LORA_ADAPTER (`load_lora_file`); eval loss runs that same `.transformer`. A given `transformer`
        (training's, with its adapter) is used as it is, where it is, instead of loading another copy. `plan`: the
        transformer's precision, offload and the VAE's tiling (`render_memory.RenderPlan`; default: fp32, all on
        `device`), applied by `load_pipeline`.
        """

    def render(
        self, pipe: Any, prompt: TextRow, negative: TextRow, settings: RenderSettings, lora_scale: float | None = 1.0,
        image: np.ndarray | None = None, sound: bool = False,
    ) -> np.ndarray | Rendered:
        """A video (or image: F = 1) from cached embeddings: uint8 (F, H, W, 3).

        `lora_scale` weights the adapter (`set_lora_scale`): 0 renders exactly what the base model renders.
        `image` (uint8 (H, W, 3) at the render size): the first frame (i2v) or the source image (Kandinsky 5 Image
        i2i, whose `prompt` and `negative` rows were encoded with that same image); required by those flavours,
        refused (ValueError) by the others.
        `sound` (only a family whose flavours have an audio VAE takes the keyword: Kandinsky 6; the config allows
        `train_audio` nowhere else): the video rendered with its sound, a `Rendered`.
        """


@dataclass(frozen=True)
class RenderSettings:
    """How validation renders: built by `loraflow.contracts.renders.render_settings`, read by each family's renderer."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance: float
    seed: int
    flow_shift: float


@dataclass(frozen=True)
class Rendered:
    """One render: its frames, uint8 (F, H, W, 3), and with `ModelFamily.render(..., sound=True)` the sound rendered
    with them, over the frames' span (F / fps seconds); None without."""

    frames: np.ndarray
    sound: Sound | None = None


LORA_ADAPTER = "lora"  # the adapter name validation loads and scales
LATENT_SAMPLINGS = ("mode", "distribution")
# Latent-row columns a family caches beside the latent (`image_condition`; HunyuanVideo 1.5 i2v: the first frame's VAE
# latent for the cond channels and its SigLIP tokens; Kandinsky 5 Image i2i: the source image's latent); training and
# eval loss hand them to `velocity` in its `text` mapping.
IMAGE_CONDITION_COLUMNS = ("image_latent", "image_embeds")
# The key a micro-batch of an i2v run holds instead of those columns when it trains as t2v (`i2v_prob`): `velocity`
# then makes the family's t2v call.
AS_T2V = "as_t2v"


def first_frame(flavour: Flavour, image: np.ndarray | None, settings: RenderSettings) -> Any:
    """The image an i2v render starts from as the video pipelines take it (a PIL image), checked: an i2v flavour
    needs one, uint8 (H, W, 3) at the render size (a pipeline would resize (stretch) another silently; the caller
    crops it); None for t2v, which refuses one."""
    from PIL import Image

    if not flavour.image_is_first_frame:
        if image is not None:
            raise ValueError(f"flavour '{flavour.name}' is text-to-video: it takes no conditioning image")
        return None
    if image is None:
        raise ValueError(f"flavour '{flavour.name}' renders from a first frame: pass `image`")
    if image.shape != (settings.height, settings.width, 3) or image.dtype != np.uint8:
        raise ValueError(f"the conditioning image must be uint8 {(settings.height, settings.width, 3)}; "
                         f"got {image.dtype} {image.shape}")
    return Image.fromarray(image)


def stacked(rows: Sequence[Mapping[str, Any]], column: str) -> torch.Tensor:
    """One column of equally shaped stored rows as a batch, (B, ...) float32 on the CPU: the batching that latent rows
    (`image_conditions`) and text rows (`collate_text`) share."""
    return torch.from_numpy(np.stack([np.asarray(r[column], np.float32) for r in rows]))


def padded(arrays: list[np.ndarray], masks: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_i, D) arrays -> zero-padded (B, L, D) float32 and a (B, L) float mask: the batching of text rows for a
    transformer that takes a text mask (HunyuanVideo 1.5, Kandinsky 6)."""
    length = max(len(a) for a in arrays)
    embeds = torch.zeros(len(arrays), length, arrays[0].shape[-1])
    mask = torch.zeros(len(arrays), length)
    for i, (a, m) in enumerate(zip(arrays, masks)):
        embeds[i, : len(a)] = torch.from_numpy(np.array(a, np.float32))  # a copy: stored rows are read-only
        mask[i, : len(m)] = torch.from_numpy(np.asarray(m, np.float32))
    return embeds, mask


def image_conditions(rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The rows' image-condition columns stacked (B, ...) float32 on the CPU; {} for rows without them (t2v)."""
    return {c: stacked(rows, c) for c in IMAGE_CONDITION_COLUMNS if rows and c in rows[0]}


def non_finite(tensors: Mapping[str, Any]) -> dict[str, int]:
    """Of these tensors or arrays (name -> values), those holding NaN or inf, and how many such values each holds."""
    counts = {name: int((~torch.isfinite(torch.as_tensor(v))).sum()) for name, v in tensors.items()}
    return {name: n for name, n in counts.items() if n}


def non_finite_detail(what: str, model: str, dtype: torch.dtype, bad: Mapping[str, int]) -> str:
    """Why a cached row was refused: `what` (the clip, its file and frames) gave `bad` non-finite values in `model`
    run in `dtype`, and the precision to try."""
    precision = str(dtype).removeprefix("torch.")
    values = ", ".join(f"{n} in {name}" for name, n in bad.items())
    fix = (f"run the {model} in float32" if dtype != torch.float32 else
           f"float32 is the widest precision the {model} runs in: check the clip's frames and the checkpoint's "
           f"{model} weights (a fine-tuned or converted {model} that overflows)")
    return f"{what}: the {model}, in {precision}, gave non-finite values ({values}); not stored; {fix}"


def scaled_posterior(posterior: Any, sampling: str, scale: float, shift: float = 0.0) -> torch.Tensor:
    """The VAE posterior as the family's pipeline scales latents, (x - shift) * scale, in float32.

    mode: the mode (= the mean of a diagonal Gaussian). distribution: mean and log-variance concatenated on
    dim 1; a sample x = mean + exp(logvar / 2) * eps scales to (x - shift) * scale, which has mean
    (mean - shift) * scale and log-variance logvar + 2 log(scale). The logvar is diffusers' (clamped to
    [-30, 20]), so `latent_dist.sample(g)` * scale equals `draw_latents` with the same generator.
    """
    if sampling not in LATENT_SAMPLINGS:
        raise ValueError(f"latent sampling must be one of {', '.join(LATENT_SAMPLINGS)}; got {sampling!r}")
    mean = (posterior.mode().float() - shift) * scale
    if sampling == "mode":
        return mean
    return torch.cat([mean, posterior.logvar.float() + 2.0 * math.log(scale)], dim=1)


def lora_file_header(prefix: str, adapter_config: dict | None) -> dict[str, str]:
    """The safetensors header diffusers writes for a LoRA: the LoraConfig as JSON, keys `<prefix>.<field>`."""
    header = {"format": "pt"}
    if adapter_config:
        fields = {f"{prefix}.{k}": v for k, v in adapter_config.items()}
        header["lora_adapter_metadata"] = json.dumps(fields, indent=2, sort_keys=True)
    return header


def save_transformer_lora(state_dict: dict[str, torch.Tensor], out_dir: str | Path,
                          adapter_config: dict | None = None) -> None:
    """What diffusers' `save_lora_weights` writes for a pipeline without a LoRA mixin (HunyuanVideo 1.5, Kandinsky 6):
    `transformer.`-prefixed keys in pytorch_lora_weights.safetensors and the LoraConfig in its header, which
    `transformer.load_lora_adapter(out_dir, weight_name=...)` reads (`load_lora_file`)."""
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"transformer.{k}": v.detach().contiguous() for k, v in state_dict.items()}
    save_file(tensors, out / LORA_WEIGHT_NAME_SAFE, metadata=lora_file_header("transformer", adapter_config))


def compute_dtype(transformer: torch.nn.Module) -> torch.dtype:
    """diffusers' `transformer.dtype` (the layerwise-casting compute dtype, else the first float parameter's),
    looked up once per model: the property walks every module on each call, a per-step cost in training.
    Precision is fixed when a model is loaded (load_transformer casts before the first step), so it cannot go stale.
    """
    if "_loraflow_dtype" not in transformer.__dict__:
        transformer.__dict__["_loraflow_dtype"] = transformer.dtype
    return transformer.__dict__["_loraflow_dtype"]


def load_pipeline(pipeline: type, model: ModelSource | str | Path, lora_path: str | Path | None,
                  device: torch.device, transformer: torch.nn.Module | None = None, plan: RenderPlan | None = None,
                  blocks: str = "") -> Any:
    """A family's diffusers pipeline without text encoders (renders read cached embeddings), the LoRA file in its
    transformer, placed on `device` as `plan` says (`render_memory.place`: precision, offload, tiling; default: fp32,
    everything on the device), `blocks` naming the transformer's block list. A given (training) transformer is used
    as it is and stays where training keeps it. Components from other folders (`vae_path`, ...) are loaded from
    there."""
    from loraflow.kernels.quantize import frozen_dtype, store_frozen
    from loraflow.pipelines.render_memory import RenderPlan, place

    plan = plan or RenderPlan()
    source = as_source(model)
    unused = dict(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    components = {c: load_component(source, c) for c, _ in source.folders if c not in unused}
    # the VAE computes in the transformer's dtype, as the pipelines expect (Kandinsky5I2VPipeline encodes its image in
    # `transformer.dtype`) and as diffusers' own examples load them (`torch_dtype=torch.bfloat16`)
    components["vae"] = load_component(source, "vae", frozen_dtype(plan.precision))
    if transformer is None:
        transformer = load_component(source, "transformer", frozen_dtype(plan.precision))
        store_frozen(transformer, plan.precision, plan.kept)  # before the adapter, as training stores it
        own = True
    else:
        own = False
    pipe = pipeline.from_pretrained(source.root, use_safetensors=True, **unused, **components,
                                    transformer=transformer)
    if lora_path is not None:
        load_lora_file(pipe.transformer, lora_path)
    place(pipe, plan, blocks, device, own_transformer=own)
    if own:  # a training transformer keeps the backend training set
        from loraflow.kernels.attention_backend import apply_attention_backend

        apply_attention_backend(pipe.transformer, plan.attention_backend, device, needs_flex_attention(transformer))
    return pipe


def needs_flex_attention(transformer: torch.nn.Module) -> bool:
    """The checkpoint attends with NABLA (Kandinsky 5's 10 s checkpoints), whose block mask only flex takes."""
    return transformer.config.get("attention_type") == "nabla"


def load_lora_file(transformer: torch.nn.Module, lora_path: str | Path, adapter_name: str = LORA_ADAPTER) -> None:
    """Load an adapter file (keys with or without the diffusers `transformer.` prefix) as `adapter_name`.

    By path, not as a state dict: diffusers then reads the LoraConfig (lora_alpha) that `save_lora_weights`
    stores in the file's header when given `transformer_lora_adapter_metadata`; without it alpha = rank.
    """
    from safetensors import safe_open

    from loraflow.pipelines.lycoris import adapter_in_fp32, is_lycoris, load_lycoris_file

    path = Path(lora_path)
    read_header(path)  # a corrupt file fails naming itself, not inside safetensors or peft
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
    if is_lycoris(keys):  # LoKr/LoHa: diffusers builds LoRA configs only
        load_lycoris_file(transformer, path, adapter_name)
        return
    prefix = "transformer" if all(k.startswith("transformer.") for k in keys) else None
    load = partial(transformer.load_lora_adapter, str(path.parent), weight_name=path.name, prefix=prefix,
                   adapter_name=adapter_name)
    load()
    if adapter_in_fp32(transformer, adapter_name):  # peft made it in the base's bf16/fp8: its values again, exact
        load(hotswap=True)


def set_lora_scale(transformer: torch.nn.Module, scale: float | None) -> None:
    """Weight LORA_ADAPTER by `scale` (0: the base model, exactly: peft adds 0 * the LoRA branch).

    None leaves every adapter as it is: renders during training use the training adapter at its own weight."""
    if scale is None:
        return
    if LORA_ADAPTER not in (getattr(transformer, "peft_config", None) or {}):
        if scale != 0:
            raise ValueError(f"lora_scale {scale} asked of a pipeline loaded without a LoRA; pass `lora_path`")
        return
    transformer.set_adapters([LORA_ADAPTER], [scale])


def set_flavour_config(transformer: torch.nn.Module, flavour: Flavour) -> torch.nn.Module:
    """The transformer as the flavour runs it: its mode's config keys (`Flavour.transformer_config`: Kandinsky 5 Pro's
    SD or HD attention) set over the checkpoint's. Only config the forward's callers read (the pipeline's
    `get_sparse_params`, `nabla_params`), so setting it after loading equals loading with it."""
    if flavour.transformer_config:
        transformer.register_to_config(**dict(flavour.transformer_config))
    return transformer


def load_component(model: ModelSource | str | Path, name: str, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> Any:
    """Load one component with its real class's from_pretrained, as model_index.json names it, from safetensors
    only (never a pickle), from the component's own folder where one is given (`vae_path`, ...).

    from_pretrained applies each model's `_keep_in_fp32_modules` (Kandinsky 5's modulation layers crash
    under a plain .to(bfloat16)), so dtype goes through it rather than through .to().
    """
    source = as_source(model)
    library, class_name = model_index(source)[name]
    if library not in LOADED_LIBRARIES:  # model_source checked the classes; a bare folder gets this much
        raise ModelRefused([f"{source} {name}: model_index.json names library {library!r}; loraflow loads "
                            f"components from {' and '.join(LOADED_LIBRARIES)} only"])
    folder = source.folder(name)
    for file in folder.glob("*.safetensors"):  # a corrupt header fails here, naming the file, not in a loader
        read_header(file)
    cls = getattr(importlib.import_module(library), class_name)
    if not hasattr(cls, "to"):  # tokenizers, schedulers, processors
        return cls.from_pretrained(str(folder))
    model = cls.from_pretrained(str(folder), torch_dtype=dtype, use_safetensors=True)
    return model.to(device).eval().requires_grad_(False)


def component_fingerprint(model: ModelSource | str | Path, name: str) -> str:
    return as_source(model).fingerprint(name)
