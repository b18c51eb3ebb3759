"""The flavour table: each family's flavours and their defaults (plain data, no torch).

fps, frames and size are what validation renders and clips are resampled to unless the config says
otherwise; flow_shift is the inference/training sigma shift of the original repos; components are the
sub-folders a checkpoint must hold for this flavour; conditioning_frames are the latent frames the model
is given clean (Kandinsky 5 i2v: the first), which training and eval loss leave out of the loss; repo is the
flavour's diffusers-format Hugging Face repository, the default `pretrained_model_name_or_path` (None: none is
published, the config must name a folder).

Repository ids: Kandinsky 5 from SimpleTuner's `HUGGINGFACE_PATHS` (helpers/models/kandinsky5_video and
kandinsky5_image/model.py), of which the kandinskylab "Diffusers" collections list the Lite t2v, Pro sft 5s t2v/i2v
and the four Image repos; HunyuanVideo 1.5 from the hunyuanvideo-community collection (also SimpleTuner's table).
Kandinsky 5 i2v-pro-pretrain-5s has no published checkpoint in any layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flavour:
    name: str
    task: str  # t2v | i2v | t2i | i2i
    fps: float
    num_frames: int  # validation default, 4k+1 (1 for images)
    size: tuple[int, int]  # validation default (height, width)
    flow_shift: float
    guidance: float
    components: tuple[str, ...]
    # Latent frames given clean, not generated: their x_t is x0 and they carry no loss (`pipelines.base.flow_mse`).
    # 0 for t2v, for K5 i2i (its source image is extra input channels, not a frame) and for HV1.5 i2v, whose
    # pipeline noises and steps frame 0 like every frame and gives the image only through its condition channels
    # (`hunyuanvideo15.HunyuanVideo15._condition`).
    conditioning_frames: int = 0
    repo: str | None = None  # the diffusers-format Hugging Face repository (module docstring)


_K5_PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")


def _k5_video(name: str, seconds: int, shift: float, repo: str | None) -> Flavour:
    task = name.split("-")[0]
    # i2v: the image's latent replaces latent frame 0 (Kandinsky5I2VPipeline.prepare_latents), one clean frame
    return Flavour(name, task, 24.0, 24 * seconds + 1, (512, 768), shift, 5.0, _K5_PARTS, int(task == "i2v"),
                   repo and f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers")


def _k5_image(name: str, repo: str) -> Flavour:
    # One frame; fps only matters when frames are sampled from videos. Shift 1.0 is the seed doc's default.
    task = name.split("-")[0]
    return Flavour(name, task, 24.0, 1, (1024, 1024), 1.0, 5.0, _K5_PARTS,
                   repo=f"kandinskylab/Kandinsky-5.0-{repo}-Diffusers")


_HV15_PARTS = (*_K5_PARTS, "guider")
_SIGLIP_PARTS = ("image_encoder", "feature_extractor")


def _hv15(name: str, shift: float) -> Flavour:
    task, resolution = name.split("-")
    size = {"480p": (480, 848), "720p": (720, 1280)}[resolution]
    parts = _HV15_PARTS + (_SIGLIP_PARTS if task == "i2v" else ())
    # conditioning_frames 0 for i2v too: HunyuanVideo15ImageToVideoPipeline steps every latent frame (HVI:931)
    return Flavour(name, task, 24.0, 121, size, shift, 6.0, parts,
                   repo=f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{resolution}_{task}")


FLAVOURS: dict[str, dict[str, Flavour]] = {
    "kandinsky5-video": {
        f.name: f
        for f in [
            _k5_video("t2v-lite-sft-5s", 5, 10.0, "T2V-Lite-sft-5s"),
            _k5_video("t2v-lite-sft-10s", 10, 10.0, "T2V-Lite-sft-10s"),
            _k5_video("t2v-lite-pretrain-5s", 5, 10.0, "T2V-Lite-pretrain-5s"),
            _k5_video("t2v-lite-pretrain-10s", 10, 10.0, "T2V-Lite-pretrain-10s"),
            _k5_video("t2v-pro-sft-5s-hd", 5, 5.0, "T2V-Pro-sft-5s"),
            _k5_video("t2v-pro-sft-10s-hd", 10, 5.0, "T2V-Pro-sft-10s"),
            _k5_video("t2v-pro-pretrain-5s-hd", 5, 5.0, "T2V-Pro-pretrain-5s"),
            _k5_video("t2v-pro-pretrain-10s-hd", 10, 5.0, "T2V-Pro-pretrain-10s"),
            _k5_video("i2v-lite-5s", 5, 5.0, "I2V-Lite-5s"),
            _k5_video("i2v-pro-sft-5s", 5, 5.0, "I2V-Pro-sft-5s"),
            _k5_video("i2v-pro-pretrain-5s", 5, 5.0, None),
        ]
    },
    "kandinsky5-image": {
        f.name: f
        for f in [_k5_image("t2i-lite-sft", "T2I-Lite-sft"), _k5_image("t2i-lite-pretrain", "T2I-Lite-pretrain"),
                  _k5_image("i2i-lite-sft", "I2I-Lite-sft"), _k5_image("i2i-lite-pretrain", "I2I-Lite-pretrain")]
    },
    "hunyuanvideo-1.5": {
        f.name: f
        for f in [_hv15("t2v-480p", 5.0), _hv15("t2v-720p", 9.0), _hv15("i2v-480p", 5.0), _hv15("i2v-720p", 7.0)]
    },
}

DEFAULT_FLAVOUR = {"kandinsky5-video": "t2v-lite-sft-5s", "kandinsky5-image": "t2i-lite-sft",
                   "hunyuanvideo-1.5": "t2v-480p"}

# Hugging Face repositories that are not in the diffusers layout, refused before any work with the flavour's repo
# named instead. tencent/HunyuanVideo-1.5 (the HunyuanVideo 1.5 guide's id, 338 GB) holds transformer/<res>_<task>/
# folders, vae/ and scheduler/ but no model_index.json, tokenizers or text/vision encoders (separate downloads):
# loading it would mean diffusers' conversion script (not part of the wheel) plus three other repositories.
NOT_DIFFUSERS = {"tencent/HunyuanVideo-1.5": "HunyuanVideo 1.5's original release, not in the diffusers layout "
                                             "(no model_index.json; text and vision encoders are separate downloads)"}
# Component folders the family's guide names by environment variable: component -> variable. loraflow reads each as a
# diffusers component folder (config.json + safetensors, as the diffusers repository's text_encoder/, image_encoder/),
# not as the original release's text_encoder/llm or vision_encoder/siglip tree SimpleTuner points them at.
FOLDER_VARIABLES = {"hunyuanvideo-1.5": {"text_encoder": "HUNYUANVIDEO_TEXT_ENCODER_PATH",
                                         "image_encoder": "HUNYUANVIDEO_VISION_ENCODER_PATH"}}


def flavour_of(family: str, flavour: str | None) -> Flavour:
    """The flavour a config's two keys pick (the family's default when unset)."""
    return FLAVOURS[family][flavour or DEFAULT_FLAVOUR[family]]
