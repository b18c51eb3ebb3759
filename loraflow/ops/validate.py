"""The validation stage: render the validation prompt with and without the LoRA, from cached embeddings.

Outputs per run: base.mp4, lora.mp4 (h264, yuv420p: plays in a browser) and a contact sheet PNG (base row
over LoRA row) that the asset embeds in its metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
from PIL import Image

from loraflow.config import LoraflowConfig
from loraflow.keys import content_key
from loraflow.ops.report import StageReport
from loraflow.pipelines.base import ModelFamily
from loraflow.store import Store

CODE_VERSION = "validation-1"


@dataclass(frozen=True)
class RenderSettings:
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance: float
    seed: int
    flow_shift: float


def render_settings(config: LoraflowConfig, family: ModelFamily) -> RenderSettings:
    height, width = config.validation_size
    flavour = family.flavour
    return RenderSettings(
        height=height, width=width,
        num_frames=config.validation_num_video_frames or flavour.num_frames,
        num_inference_steps=config.validation_num_inference_steps,
        guidance=config.validation_guidance if config.validation_guidance is not None else flavour.guidance,
        seed=config.seed, flow_shift=flavour.flow_shift,
    )


def validate(config: LoraflowConfig, family: ModelFamily, store: Store, lora_path: str) -> StageReport:
    if not config.validation_prompt:
        raise ValueError("validation needs `validation_prompt` in the config")
    settings = render_settings(config, family)
    texts = {row["text"]: row["key"] for row in store.read_manifest("text_embeds")}
    rows = store.get("text_embeds", [texts[config.validation_prompt], texts[family.default_negative_prompt]])
    prompt, negative = rows[texts[config.validation_prompt]], rows[texts[family.default_negative_prompt]]
    out = Path(config.output_dir) / "validation" / content_key(lora=lora_path, settings=settings.__dict__,
                                                                prompt=config.validation_prompt, code=CODE_VERSION)
    if (out / "contact_sheet.png").is_file():
        return _report(out, settings, computed=0)
    out.mkdir(parents=True, exist_ok=True)
    model = config.pretrained_model_name_or_path
    base = family.render(model, None, prompt, negative, settings)
    tuned = family.render(model, str(Path(lora_path).parent), prompt, negative, settings)
    write_mp4(base, out / "base.mp4", family.flavour.fps)
    write_mp4(tuned, out / "lora.mp4", family.flavour.fps)
    contact_sheet([base, tuned]).save(out / "contact_sheet.png")
    return _report(out, settings, computed=1, difference=float(np.abs(base.astype(int) - tuned).mean()))


def _report(out: Path, settings: RenderSettings, computed: int, difference: float | None = None) -> StageReport:
    facts = {"video": str(out / "lora.mp4"), "base_video": str(out / "base.mp4"),
             "contact_sheet": str(out / "contact_sheet.png"), **settings.__dict__}
    if difference is not None:
        facts["mean_abs_pixel_change"] = difference
    return StageReport(data_version=out.name, computed=computed, reused=1 - computed, facts=facts)


def write_mp4(frames: np.ndarray, path: Path, fps: float) -> None:
    """uint8 (F, H, W, 3) -> h264 yuv420p mp4 (even sizes padded by edge copy, as yuv420p requires)."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    tmp.rename(path)


def contact_sheet(videos: list[np.ndarray], columns: int = 8, scale: int = 2) -> Image.Image:
    """One row per video (base over LoRA), `columns` frames spread over its length, upscaled for the UI."""
    rows = []
    for video in videos:
        picks = np.linspace(0, len(video) - 1, min(columns, len(video))).round().astype(int)
        rows.append(np.concatenate(list(video[picks]), axis=1))
    sheet = Image.fromarray(np.concatenate(rows, axis=0))
    return sheet.resize((sheet.width * scale, sheet.height * scale), Image.NEAREST)
