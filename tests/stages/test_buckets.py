import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loraflow.stages.clips import buckets

frames_4k1 = st.integers(0, 40).map(lambda k: 4 * k + 1)


@given(st.integers(1, 2000))
def test_round_down_4k1_is_the_largest_legal_count(n: int) -> None:
    r = buckets.round_down_4k1(n)
    assert (r - 1) % 4 == 0 and r <= n < r + 4


def test_49_frames_stay_49() -> None:
    assert buckets.select_clips(list(range(49)), 49, "head", None) == [list(range(49))]
    assert len(buckets.select_clips(list(range(49)), 17, "full", None)[0]) == 49


@given(st.integers(1, 600), frames_4k1, st.sampled_from(["head", "chunk", "slide", "uniform"]),
       st.integers(1, 20), st.integers(1, 6))
def test_every_clip_has_num_frames_inside_the_video(available, clip, mode, stride, samples) -> None:
    timeline = list(range(available))
    try:
        clips = buckets.select_clips(timeline, clip, mode, None, stride, samples)
    except buckets.TooShort:
        assert available < clip
        return
    assert clips and all(len(c) == clip and c[-1] < available for c in clips)
    if mode == "chunk":  # non-overlapping
        assert all(a[-1] < b[0] for a, b in zip(clips, clips[1:]))


@given(st.integers(1, 3000), st.floats(1, 120), st.floats(8, 60))
def test_resampling_never_invents_frames(n, source_fps, target_fps) -> None:
    indices = buckets.resampled_indices(n, source_fps, target_fps)
    assert indices[0] == 0 and all(0 <= i < n for i in indices)
    assert indices == sorted(set(indices))
    assert len(indices) <= n


@given(st.lists(st.floats(0.001, 0.2), min_size=1, max_size=400), st.floats(8, 60))
def test_vfr_resampling_never_invents_frames_either(gaps, target_fps) -> None:
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    indices = buckets.resampled_indices(len(times), (len(times) - 1) / times[-1], target_fps, tuple(times))
    assert indices[0] == 0 and indices == sorted(set(indices)) and all(0 <= i < len(times) for i in indices)


def test_vfr_resampling_picks_frames_by_time_not_by_number() -> None:
    # a phone clip: 1 s at 30 fps, then 1 s at 15 fps (low light); 22.5 fps on average; resampled to 15 fps
    times = tuple([i / 30 for i in range(30)] + [1 + i / 15 for i in range(15)])
    by_time = buckets.resampled_indices(45, 22.5, 15, times)
    assert by_time == list(range(0, 30, 2)) + list(range(30, 45))  # every step 1/15 s: the real speed throughout
    by_number = buckets.resampled_indices(45, 22.5, 15)
    assert np.diff(np.take(times, by_number)).max() > 1.4 / 15  # what frame numbers alone did to the slow half


@given(st.integers(16, 4000), st.integers(16, 4000), st.sampled_from([16, 32, 64, 256, 512]), st.sampled_from([16, 32]))
def test_bucket_sizes_are_aligned_and_keep_aspect(h, w, resolution, multiple) -> None:
    bh, bw = buckets.bucket_size(h, w, resolution, multiple)
    assert bh % multiple == 0 and bw % multiple == 0
    assert abs(min(bh, bw) - resolution) <= multiple / 2 + 1e-9 or min(bh, bw) == multiple


@given(st.integers(16, 2000), st.integers(16, 2000), st.integers(1, 64), st.integers(1, 64),
       st.sampled_from(["center", "random", "none"]))
def test_crop_box_lies_inside_the_resized_frame(sh, sw, th16, tw16, style) -> None:
    target = (th16 * 16, tw16 * 16)
    plan = buckets.crop_plan((sh, sw), target, style, seed="k")
    top, left, height, width = plan.box
    assert (height, width) == target
    assert 0 <= top and top + height <= plan.resize[0] and 0 <= left and left + width <= plan.resize[1]
    assert plan == buckets.crop_plan((sh, sw), target, style, seed="k")  # random crops are reproducible


sides = st.integers(16, 4000)
aspects = st.lists(st.floats(0.2, 5.0), min_size=1, max_size=6)


@given(sides, sides, st.integers(16, 1024), st.sampled_from([16, 32]), st.sampled_from(["preserve", "square"]))
def test_area_buckets_keep_the_area_and_aspect(h, w, resolution, multiple, crop_aspect) -> None:
    bh, bw = buckets.bucket_size(h, w, resolution, multiple, "area", crop_aspect)
    assert bh % multiple == 0 and bw % multiple == 0
    aspect = w / h if crop_aspect == "preserve" else 1.0
    ideal_h = resolution / aspect**0.5
    ideal_w = ideal_h * aspect
    # each side is the ideal one snapped to the multiple (or the multiple itself when the ideal is smaller)
    for got, ideal in ((bh, ideal_h), (bw, ideal_w)):
        assert abs(got - ideal) <= multiple / 2 + 1e-6 or (got == multiple and ideal < multiple)
    if min(ideal_h, ideal_w) >= multiple:
        assert abs(bh * bw - resolution**2) <= multiple / 2 * (ideal_h + ideal_w) + multiple**2 / 4 + 1e-6


@given(sides, sides, st.integers(16, 1024), st.sampled_from(["pixel", "area"]))
def test_square_buckets_are_square(h, w, resolution, resolution_type) -> None:
    bh, bw = buckets.bucket_size(h, w, resolution, 16, resolution_type, "square")
    assert bh == bw == max(16, round(resolution / 16) * 16)


@given(sides, sides, aspects, st.sampled_from(["pixel", "area"]))
def test_closest_picks_the_nearest_listed_aspect(h, w, listed, resolution_type) -> None:
    chosen = buckets.target_aspect(w / h, "closest", listed)
    assert chosen in listed
    distance = abs(math.log(chosen * h / w))
    assert all(distance <= abs(math.log(a * h / w)) + 1e-12 for a in listed)
    bh, bw = buckets.bucket_size(h, w, 256, 16, resolution_type, "closest", listed)
    if resolution_type == "pixel":  # the shorter side is the resolution, the other follows the chosen aspect
        assert min(bh, bw) == 256
        ideal = 256 * max(chosen, 1 / chosen)
        assert abs(max(bh, bw) - ideal) <= 8 + 1e-6
    assert bh % 16 == 0 and bw % 16 == 0


@given(sides, sides, st.integers(16, 1024), st.sampled_from([16, 32]))
def test_default_rule_is_unchanged_by_the_new_options(h, w, resolution, multiple) -> None:
    # pixel + preserve is the rule clip keys were made with; the generic path gives the same size
    default = buckets.bucket_size(h, w, resolution, multiple)
    aspect = w / h
    ideal = (resolution, resolution * aspect) if aspect >= 1 else (resolution / aspect, resolution)
    assert all(abs(got - want) <= multiple / 2 + 1e-6 or got == multiple for got, want in zip(default, ideal))


def test_bucket_label_is_width_x_height_at_frames() -> None:
    assert buckets.bucket_label(64, 96, 17) == "96x64@17"
