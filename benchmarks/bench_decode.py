"""CPU benchmark: decode only the kept frames at the kept size vs decode everything, on a 720p clip.

Makes a 1280x720 H.264 clip (132 frames, textured moving content, B-frames) with PyAV, then times
and measures, each run in a fresh Python process (medians of --runs):

  full_decode_1thread  ffmpeg -threads 1 -f null (or, without an ffmpeg binary, PyAV decoding every
                       frame on one thread with no RGB conversion): the floor for touching every frame
  kept_first49         loraflow decode_frames: frames 0..48 resized to 512x288 (worker pool, decord)
  kept_spread49        decode_frames: 49 frames spread over the whole clip
  kept_pyav_first49    the PyAV fallback path for frames 0..48 (in-process)
  all_then_select_*    decode every frame to full-size RGB (PyAV / decord), then keep 49 and resize:
                       what trainers that "decode everything, keep the first N" do

"wall" is the whole process (interpreter start, imports, worker start); "call" is the decode call
alone, i.e. the per-clip cost inside a running pipeline. Peak memory is VmHWM of the process; for
decode_frames the worker process is reported too and "peak_total" is their sum.

    .venv/bin/python benchmarks/bench_decode.py          # writes benchmarks/results/decode_cpu.json
    .venv/bin/python benchmarks/bench_decode.py --runs 3
    .venv/bin/python benchmarks/bench_decode.py --ts   # decode_ts_cpu.json: the same packets in .mp4 and .ts

--ts: an MPEG transport stream (what OBS writes) has no frame index and decord seeks it to wrong frames, so its
frames come from PyAV, which decodes from the start up to the last kept frame; the cost grows with how far into
the file the clip lies (kept_spread49 reaches the last frame), while the MP4 goes to decord.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: loraflow comes from this checkout
from benchmarks import record  # noqa: E402

RESULTS = record.results_path("decode_cpu.json")
TS_RESULTS = record.results_path("decode_ts_cpu.json")
CLIP = ROOT / "benchmarks" / "out" / "bench_720p.mp4"  # benchmarks/out/ is git-ignored
WIDTH, HEIGHT, FRAMES, FPS = 1280, 720, 132, 24
KEEP_SIZE = (288, 512)  # (H, W)
FIRST49 = list(range(49))
SPREAD49 = [round(i * (FRAMES - 1) / 48) for i in range(49)]


# ------------------------------------------------------------------------- the test clip


def make_clip(path: Path) -> Path:
    """Textured, moving 720p content so the decoder does real work (flat colour decodes for free)."""
    import av
    import numpy as np

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    texture = rng.integers(0, 256, (HEIGHT * 2, WIDTH * 2, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    partial = path.with_suffix(".partial.mp4")
    with av.open(str(partial), "w") as out:
        options = {"crf": "23", "preset": "veryfast", "x264-params": "log-level=error"}
        stream = out.add_stream("libx264", rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(FRAMES):
            # A panning noise texture blended with a moving gradient: motion vectors and residuals.
            frame = texture[i * 3 : i * 3 + HEIGHT, i * 5 : i * 5 + WIDTH].astype(np.int16) // 2
            frame += (((xx + 4 * i) % WIDTH) * 127 // WIDTH)[..., None].astype(np.int16)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame.clip(0, 255).astype(np.uint8), format="rgb24")))
        out.mux(stream.encode(None))
    partial.replace(path)
    return path


def remux_ts(clip: Path) -> Path:
    """The clip's H.264 packets in an MPEG transport stream: no re-encode, the same frames."""
    import av

    path = clip.with_suffix(".ts")
    if path.exists():
        return path
    with av.open(str(clip)) as source, av.open(str(path), "w") as out:
        stream = out.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:  # not the flush packet
                packet.stream = stream
                out.mux(packet)
    return path


# ------------------------------------------------------------- measurements (child side)


def _full_decode_pyav(path: Path) -> None:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type, stream.thread_count = "SLICE", 1  # one thread, like ffmpeg -threads 1
        for _ in container.decode(stream):
            pass


def _kept(path: Path, indices: list[int]) -> Any:
    from loraflow.media.frames import decode_frames

    return decode_frames(path, indices, KEEP_SIZE)


def _kept_pyav(path: Path, indices: list[int]) -> Any:
    from loraflow.media.decode_worker import _decode_pyav

    return _decode_pyav(path, indices, KEEP_SIZE, 0)


def _all_then_select_pyav(path: Path) -> Any:
    import av

    with av.open(str(path)) as container:
        everything = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return _select_and_resize(everything)


def _all_then_select_decord(path: Path) -> Any:
    import decord

    reader = decord.VideoReader(str(path))
    everything = reader.get_batch(list(range(len(reader)))).asnumpy()
    return _select_and_resize(list(everything))


def _select_and_resize(everything: list[Any]) -> Any:
    import numpy as np
    from PIL import Image

    height, width = KEEP_SIZE
    kept = [Image.fromarray(everything[i]).resize((width, height), Image.Resampling.BICUBIC) for i in FIRST49]
    return np.stack([np.asarray(k) for k in kept])


def measure_one(name: str, path: Path) -> dict[str, Any]:
    """Run one measurement in this (fresh) process; report seconds and peak RSS."""
    from loraflow.media import frames as media

    calls = {
        "full_decode_1thread": lambda: _full_decode_pyav(path),
        "kept_first49": lambda: _kept(path, FIRST49),
        "kept_spread49": lambda: _kept(path, SPREAD49),
        "kept_pyav_first49": lambda: _kept_pyav(path, FIRST49),
        "all_then_select_pyav": lambda: _all_then_select_pyav(path),
        "all_then_select_decord": lambda: _all_then_select_decord(path),
    }
    if name.startswith("kept_") and name != "kept_pyav_first49":
        media.probe(path)  # start the worker and cache the probe: "call" is then decode only
    start = time.perf_counter()
    result = calls[name]()
    call_s = time.perf_counter() - start
    workers = [w.proc.pid for w in media._IDLE]
    return {
        "call_s": call_s,
        "shape": list(getattr(result, "shape", ())),
        "self_peak_mb": peak_mb("self"),
        "worker_peak_mb": max((peak_mb(str(pid)) for pid in workers), default=0.0),
    }


def peak_mb(pid: str) -> float:
    """VmHWM: this process's own high-water mark. (ru_maxrss would include the parent's RSS at
    fork time, which Linux carries across exec.)"""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 1024


# ------------------------------------------------------------------- driver (parent side)


def run_child(name: str, path: Path) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--measure", name, "--file", str(path)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.perf_counter() - start
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def run_ffmpeg(path: Path) -> dict[str, Any]:
    start = time.perf_counter()
    subprocess.run(
        ["ffmpeg", "-v", "error", "-threads", "1", "-i", str(path), "-f", "null", "-"], check=True, capture_output=True
    )
    wall = time.perf_counter() - start
    return {"call_s": wall, "wall_s": wall, "self_peak_mb": None, "worker_peak_mb": 0.0, "shape": []}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    out = {k: median(k) for k in ("wall_s", "call_s", "self_peak_mb", "worker_peak_mb")}
    # Other work on a shared machine only ever adds time: the minimum is the cleaner estimate.
    out.update({f"{k}_min": round(min(r[k] for r in runs), 3) for k in ("wall_s", "call_s")})
    out["peak_total_mb"] = round((out["self_peak_mb"] or 0) + (out["worker_peak_mb"] or 0), 1)
    out["shape"] = runs[0]["shape"]
    return out


def baseline(runs: int) -> dict[str, Any]:
    """Interpreter + imports alone: subtract mentally from the whole-process numbers."""
    code = (
        "import re, numpy, av, decord, PIL.Image; "
        "print(int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024)"
    )
    walls, peaks = [], []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        peaks.append(float(done.stdout.strip()))
    return {"wall_s": round(statistics.median(walls), 3), "self_peak_mb": round(statistics.median(peaks), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--ts", action="store_true", help="kept frames of the clip as .mp4 and as .ts")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one run of each: that it runs")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    if args.measure:
        print(json.dumps(measure_one(args.measure, args.file)))
        return
    clip = make_clip(CLIP)
    if args.ts:
        return measure_ts(clip, args.runs, args.out if args.out != RESULTS else TS_RESULTS, args.quick)
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine inflates every number
    names = ["full_decode_1thread", "kept_first49", "kept_spread49", "kept_pyav_first49",
             "all_then_select_pyav", "all_then_select_decord"]  # fmt: skip
    ffmpeg = shutil.which("ffmpeg")
    results: dict[str, Any] = {}
    for name in names:
        with_ffmpeg = name == "full_decode_1thread" and ffmpeg
        measure = (lambda: run_ffmpeg(clip)) if with_ffmpeg else (lambda: run_child(name, clip))
        results[name] = summarize([measure() for _ in range(args.runs)])
    report = {
        "what": "decode 720p H.264: kept frames only (resized in the decoder) vs every frame; "
        "medians of fresh processes",
        "clip": {"width": WIDTH, "height": HEIGHT, "frames": FRAMES, "fps": FPS, "bytes": clip.stat().st_size},
        "keep": {"frames": 49, "size_hw": list(KEEP_SIZE)},
        "full_decode_tool": (
            "ffmpeg -threads 1 -f null" if ffmpeg else "PyAV, 1 thread, no RGB conversion (no ffmpeg binary)"
        ),
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "platform": platform.platform(),
        "python_av_decord_import_baseline": baseline(args.runs),
        "results": results,
    }
    record.write(args.out, report, quick=args.quick)
    print_table(report)


def measure_ts(clip: Path, runs: int, out: Path, quick: bool) -> None:
    load_before = round(os.getloadavg()[0], 2)
    results = {f"{name}_{path.suffix[1:]}": summarize([run_child(name, path) for _ in range(runs)])
               for path in (clip, remux_ts(clip)) for name in ("kept_first49", "kept_spread49")}
    report = {
        "what": "decode 49 kept frames of the same 720p H.264 packets in .mp4 (decord) and .ts (PyAV, from the start)",
        "clip": {"width": WIDTH, "height": HEIGHT, "frames": FRAMES, "fps": FPS},
        "keep": {"frames": 49, "size_hw": list(KEEP_SIZE), "spread_last_index": SPREAD49[-1]},
        "runs": runs, "cpus": os.cpu_count(),
        "load_average_1m_before_after": [load_before, round(os.getloadavg()[0], 2)],
        "platform": platform.platform(),
        "python_av_decord_import_baseline": baseline(runs),
        "results": results,
    }
    record.write(out, report, quick=quick)
    print_table(report)


def print_table(report: dict[str, Any]) -> None:
    print(f"{'measurement (median / min)':26} {'wall s':>13} {'call s':>13} {'peak MB (self+worker)':>24}")
    for name, r in report["results"].items():
        peak = f"{r['self_peak_mb'] or 0:.0f}+{r['worker_peak_mb'] or 0:.0f}={r['peak_total_mb']:.0f}"
        wall, call = f"{r['wall_s']:.3f}/{r['wall_s_min']:.3f}", f"{r['call_s']:.3f}/{r['call_s_min']:.3f}"
        print(f"{name:26} {wall:>13} {call:>13} {peak:>24}")
    base = report["python_av_decord_import_baseline"]
    print(f"{'(interpreter + imports)':26} {base['wall_s']:13.3f} {'':>13} {base['self_peak_mb']:>24.0f}")
    print(f"load average (1 min) before/after: {report['load_average_1m_before_after']} on {report['cpus']} CPUs")


if __name__ == "__main__":
    main()
