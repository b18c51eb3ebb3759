"""Hard cuts in a video: the worker side of `frames.ProbeCache.scenes` (`dataset.video.scene_cuts: detect`).

PySceneDetect's content detector (`ContentDetector`: the mean change of hue, saturation and brightness from one
frame to the next, against `threshold`; cuts closer than `min_scene_len` seconds merged) reads the video through
its PyAV backend, the decoder the probe and the PyAV decode path use too. A fade or dissolve changes each frame a
little and is no cut; only a change above the threshold between two frames is. Runs in a decode worker process
like every decode (frames.py), so a file that hangs or crashes FFmpeg costs that file only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from loraflow.media.types import MediaError

DETECTOR = "content"  # PySceneDetect's ContentDetector, the one for hard cuts (its `detect-content` command)


def detect_cuts_local(path: Path, threshold: float, min_scene_len_s: float) -> list[float]:
    """Where each new scene starts, in seconds after the first frame (sorted; [] for a file of one scene)."""
    from scenedetect import ContentDetector, SceneManager, VideoOpenFailure
    from scenedetect.backends.pyav import VideoStreamAv

    logging.getLogger("pyscenedetect").setLevel(logging.ERROR)  # its progress and fallback notes, not ours
    try:
        video = VideoStreamAv(str(path))
    except VideoOpenFailure as err:
        raise MediaError("unreadable", f"{path}: PySceneDetect cannot open it to find its scene cuts ({err}); "
                         "re-encode it, or set `video.scene_cuts: off`") from None
    manager = SceneManager()
    manager.add_detector(ContentDetector(threshold=float(threshold), min_scene_len=float(min_scene_len_s)))
    manager.detect_scenes(video=video)
    scenes = manager.get_scene_list(start_in_scene=True)
    return [float(start.seconds) for start, _ in scenes[1:]]
