"""The released checkpoints' component configs as data (nothing downloaded): one JSON per distinct config in this
folder, `{"source": {"repo_id", "file", "same_in", "values"}, "config": {...}}`, where `config` is the
component's config.json as its library writes it (diffusers: `_class_name`; transformers: `architectures`) and
`values` cites every key: `[{"keys": [...], "from": "<source>: <where>"}]` (loraflow/pipelines/citations.py; a dotted
key covers one entry of a nested config; tests/pipelines/test_citations.py fails on a key without one, and
tests/pipelines/test_released.py checks the parameter counts).

`released_config(flavour or repo id, component)` reads one; `loraflow.estimates.fake_tensors.released_model(...)`
builds its real class from it (on the meta device, or under a FakeTensorMode: no memory), which the real-size dry runs
train, encode and render through loraflow's own code (tests/pipelines/test_released_dry_runs.py).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from loraflow.pipelines.hunyuanvideo15.spec import SPEC as HV15
from loraflow.pipelines.kandinsky5.image.spec import SPEC as K5_IMAGE
from loraflow.pipelines.kandinsky5.video.spec import SPEC as K5_VIDEO
from loraflow.pipelines.kandinsky6.spec import SPEC as K6

FOLDER = Path(__file__).parent
CREPA_ENCODER = "crepa_encoder"  # CREPA's teacher, the same for every flavour


def _k5_video(flavour: str) -> dict[str, str]:
    # every Pro flavour has the Pro file (the distilled ones too: their own config.json is not read here) and sets
    # its SD or HD attention over it (`Flavour.transformer_config`)
    size = "pro" if "-pro-" in flavour else "lite"
    seconds = "10s" if "-10s" in flavour else "5s"
    return {"transformer": f"k5-video-{size}-{seconds}", "vae": "hunyuanvideo", "text_encoder": "qwen2.5-vl-7b",
            "text_encoder_2": "clip-l"}


def _k5_image(flavour: str) -> dict[str, str]:
    return {"transformer": f"k5-image-{flavour.split('-')[0]}", "vae": "flux", "text_encoder": "qwen2.5-vl-7b",
            "text_encoder_2": "clip-l"}


def _hv15(flavour: str) -> dict[str, str]:
    # the CFG-distilled transformers have their base's config; step-distilled adds mean flow (its own file)
    task, resolution = flavour.split("-")[:2]
    meanflow = "-step-distilled" if flavour.endswith("step-distilled") else ""
    files = {"transformer": f"hv15-{resolution}-{task}{meanflow}", "vae": "hv15", "text_encoder": "qwen2.5-vl-7b-text",
             "text_encoder_2": "glyph-byt5"}
    return files | ({"image_encoder": "siglip-so400m"} if task == "i2v" else {})


def _k6(flavour: str) -> dict[str, str]:
    # pretrain has its sft's files (same architecture); the π-Flow distilled transformers output n_grid velocities
    # per channel and their audio VAE scales its latents by its own factor. Video VAE and text encoders: Kandinsky 5's
    # (the pipeline's classes; diffusers' Kandinsky6TI2VAPipeline docs: AutoencoderKLHunyuanVideo, Qwen2.5-VL, CLIP)
    size, distill = flavour.split("-")[0], "-distill" if "-distill-" in flavour else ""
    return {"transformer": f"k6-{size}{distill}", "vae": "hunyuanvideo", "text_encoder": "qwen2.5-vl-7b",
            "text_encoder_2": "clip-l", "audio_vae": f"k6{distill}", "vocoder": "k6"}


# flavour name -> {component: file stem}; the file is `<stem>.<component>.json`
FLAVOURS: dict[str, dict[str, str]] = {
    **{f.name: _k5_video(f.name) for f in K5_VIDEO.flavours},
    **{f.name: _k5_image(f.name) for f in K5_IMAGE.flavours},
    **{f.name: _hv15(f.name) for f in HV15.flavours},
    **{f.name: _k6(f.name) for f in K6.flavours},
}
if len(FLAVOURS) != sum(len(spec.flavours) for spec in (K5_VIDEO, K5_IMAGE, HV15, K6)):
    raise ValueError("two families name a flavour alike: flavour names key these files, so each must be unique")
# a flavour's diffusers repository -> its first flavour (i2v-pro-pretrain-5s has none: its config is I2V-Pro-sft-5s's;
# Pro's SD and HD flavours share their repository and its files)
REPOS = {repo: name for repo, name in reversed([(f.repo, f.name) for spec in (K5_VIDEO, K5_IMAGE, HV15, K6)
                                                for f in spec.flavours if f.repo])}


@cache
def _read(name: str) -> dict[str, Any]:
    return json.loads((FOLDER / name).read_text())


def file_name(flavour_or_repo: str, component: str) -> str:
    """The name of the file in this folder holding a flavour's (or its diffusers repository's) component."""
    flavour = REPOS.get(flavour_or_repo, flavour_or_repo)
    if flavour not in FLAVOURS:
        raise KeyError(f"no released configs for {flavour_or_repo!r}; known flavours: {', '.join(sorted(FLAVOURS))}")
    parts = {**FLAVOURS[flavour], CREPA_ENCODER: "dinov2-giant"}
    if component not in parts:
        raise KeyError(f"flavour {flavour!r} has no component {component!r}; it has {', '.join(sorted(parts))}")
    return f"{parts[component]}.{component}.json"


def released_file(flavour_or_repo: str, component: str) -> dict[str, Any]:
    """The whole JSON (`source` and `config`) of a flavour's (or its diffusers repository's) component."""
    return _read(file_name(flavour_or_repo, component))


def released_config(flavour_or_repo: str, component: str) -> dict:
    """The config.json of a released checkpoint's component (a copy: callers may edit it)."""
    return json.loads(json.dumps(released_file(flavour_or_repo, component)["config"]))


def components(flavour_or_repo: str) -> list[str]:
    """The components of a flavour with a released config (CREPA's teacher included)."""
    return sorted({*FLAVOURS[REPOS.get(flavour_or_repo, flavour_or_repo)], CREPA_ENCODER})
