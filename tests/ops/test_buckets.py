from hypothesis import given
from hypothesis import strategies as st

from loraflow.ops import buckets

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
