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
from collections.abc import Iterator
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


# -- bounds on a checkpoint's own config.json, from the released ones ------------------------------------------------
# A component's config.json says how much is built from it (`num_visual_blocks: 1000000000` is a billion blocks,
# built on the meta device by every estimate and by from_pretrained): a size past HEADROOM x the largest of its
# family's released configs, or a list longer than HEADROOM x the longest, is refused before anything is built. 4x:
# room for a checkpoint a size above the released ones (Kandinsky 5 Pro is 2.3x Lite's width), none for a typo or a
# hostile file. Only integers and list lengths are bounded (they count modules and channels; the tiny test models are
# far below); floats (eps, ratios) and keys no released config has are left to the model's class.
HEADROOM = 4
MAX_MODEL_CONFIG_BYTES = 1 << 20  # 1 MiB: the released configs are 0.5-5 KB
FAMILIES = {f.name: spec.name for spec in (K5_VIDEO, K5_IMAGE, HV15, K6) for f in spec.flavours}


def _sizes(value: Any, path: str = "") -> Iterator[tuple[str, int]]:
    """(dotted key, integer) for every integer in a config and the length of every list (`key (length)`)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _sizes(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        yield f"{path} (length)", len(value)
        for item in value:
            yield from _sizes(item, f"{path}[]")


@cache
def released_sizes(flavour: str, component: str) -> dict[str, tuple[int, int]]:
    """{dotted key: (smallest, largest)} over the released configs of `component` in the flavour's family."""
    family = FAMILIES[flavour]
    stems = {FLAVOURS[f][component] for f, named in FAMILIES.items() if named == family and component in FLAVOURS[f]}
    ranges: dict[str, tuple[int, int]] = {}
    for stem in stems:
        for key, size in _sizes(_read(f"{stem}.{component}.json")["config"]):
            low, high = ranges.get(key, (size, size))
            ranges[key] = (min(low, size), max(high, size))
    return ranges


def read_model_config(path: Path) -> dict[str, Any]:
    """A component's config.json as a dict, read at most MAX_MODEL_CONFIG_BYTES; ValueError naming the file and what
    is wrong otherwise (a truncated download, a file without read permission, another format)."""
    def unreadable(why: str) -> ValueError:
        return ValueError(f"{path} is not a readable model config ({why}): download or copy that component again")

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MODEL_CONFIG_BYTES + 1)
    except OSError as exc:
        raise unreadable(exc.strerror or type(exc).__name__) from None
    if len(data) > MAX_MODEL_CONFIG_BYTES:
        raise unreadable(f"over {MAX_MODEL_CONFIG_BYTES >> 20} MiB; a model's config.json is a few KB")
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise unreadable(f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise unreadable(f"a JSON {type(config).__name__}, not an object")
    return config


def size_problems(config: dict[str, Any], path: Path, flavour: str, component: str) -> list[str]:
    """Each integer (or list length) of a component's config past HEADROOM x its family's largest released one."""
    if flavour not in FAMILIES or component not in FLAVOURS[flavour]:
        return []
    ranges, problems = released_sizes(flavour, component), []
    for key, size in _sizes(config):
        if key in ranges and size > HEADROOM * max(ranges[key][1], 1):
            low, high = ranges[key]
            released = f"{low}" if low == high else f"{low} to {high}"
            problems.append(f"{path}: `{key}` is {size}; {FAMILIES[flavour]}'s released {component} configs have "
                            f"{released}, and loraflow builds at most {HEADROOM * max(high, 1)} ({HEADROOM}x): a "
                            "config past that is refused before anything is built from it. Fix the file, or point "
                            "`pretrained_model_name_or_path` at a checkpoint of this family")
    return problems
