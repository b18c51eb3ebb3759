"""HunyuanVideo 1.5's plain data: flavours and names. The family itself is `hunyuanvideo15` (torch, diffusers),
imported only when a stage needs it.

Repository ids: the hunyuanvideo-community collection (also SimpleTuner's table)."""

from __future__ import annotations

from loraflow.pipelines.flavours import TWO_ENCODER_PARTS, FamilySpec, Flavour

_SIGLIP_PARTS = ("image_encoder", "feature_extractor")
# The guide's environment variables; read as diffusers component folders, not the original release's
# text_encoder/llm or vision_encoder/siglip tree SimpleTuner points them at.
_GUIDE_FOLDERS = (("text_encoder", "HUNYUANVIDEO_TEXT_ENCODER_PATH"), ("image_encoder", "HUNYUANVIDEO_VISION_ENCODER_PATH"))


def _flavour(name: str, shift: float) -> Flavour:
    task, resolution = name.split("-")
    size = {"480p": (480, 848), "720p": (720, 1280)}[resolution]
    parts = (*TWO_ENCODER_PARTS, "guider") + (_SIGLIP_PARTS if task == "i2v" else ())
    # conditioning_frames 0 for i2v too: HunyuanVideo15ImageToVideoPipeline steps every latent frame (HVI:931)
    return Flavour(name, task, 24.0, 121, size, shift, 6.0, parts,
                   repo=f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{resolution}_{task}",
                   folder_variables=_GUIDE_FOLDERS)


SPEC = FamilySpec(
    name="hunyuanvideo-1.5",
    description="HunyuanVideo 1.5 at 480p and 720p, text-to-video and image-to-video",
    flavours=(_flavour("t2v-480p", 5.0), _flavour("t2v-720p", 9.0), _flavour("i2v-480p", 5.0),
              _flavour("i2v-720p", 7.0)),
    default_flavour="t2v-480p",
    spatial_multiple=16,  # VAE 16x, patch 1
    vae_temporal_factor=4,
    module="loraflow.pipelines.hunyuanvideo15",
    simpletuner_names=("hunyuanvideo", "hunyuanvideo-1.5"),
)
