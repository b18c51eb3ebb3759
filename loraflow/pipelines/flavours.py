"""The flavour table: each family's flavours and their defaults (plain data, no torch).

fps, frames and size are what validation renders and clips are resampled to unless the config says
otherwise; flow_shift is the inference/training sigma shift of the original repos; components are the
sub-folders a local checkpoint must hold for this flavour.
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


_K5_PARTS = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")


def _k5_video(name: str, seconds: int, shift: float) -> Flavour:
    task = name.split("-")[0]
    return Flavour(name, task, 24.0, 24 * seconds + 1, (512, 768), shift, 5.0, _K5_PARTS)


FLAVOURS: dict[str, dict[str, Flavour]] = {
    "kandinsky5-video": {
        f.name: f
        for f in [
            _k5_video("t2v-lite-sft-5s", 5, 10.0),
            _k5_video("t2v-lite-sft-10s", 10, 10.0),
            _k5_video("t2v-lite-pretrain-5s", 5, 10.0),
            _k5_video("t2v-lite-pretrain-10s", 10, 10.0),
            _k5_video("t2v-pro-sft-5s-hd", 5, 5.0),
            _k5_video("t2v-pro-sft-10s-hd", 10, 5.0),
            _k5_video("t2v-pro-pretrain-5s-hd", 5, 5.0),
            _k5_video("t2v-pro-pretrain-10s-hd", 10, 5.0),
            _k5_video("i2v-lite-5s", 5, 5.0),
            _k5_video("i2v-pro-sft-5s", 5, 5.0),
            _k5_video("i2v-pro-pretrain-5s", 5, 5.0),
        ]
    },
}

DEFAULT_FLAVOUR = {"kandinsky5-video": "t2v-lite-sft-5s"}
