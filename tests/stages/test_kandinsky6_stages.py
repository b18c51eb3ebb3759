"""Kandinsky 6 through the stages on its tiny checkpoint: a Kandinsky 5 dataset's caches serve it (the same clips, the
same text and video encoders: computed 0), then it trains and renders, and a rerun computes nothing.

The Kandinsky 6 checkpoint here holds Kandinsky 5's tiny text encoders and VAE as links to that checkpoint's folders:
a local folder's fingerprint is its files' names, sizes and modification times (loraflow/keys.py), so two copies of
the same files are two fingerprints, while one folder reached from both checkpoints is one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import av
import pytest

from loraflow.config import LoraflowConfig, load_config
from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import get_family
from loraflow.pipelines.base import load_component
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.clips import build_clips
from loraflow.stages.latents.latents import encode_latents
from loraflow.stages.text.text_embeds import encode_texts, keying_families
from loraflow.store import Store
from loraflow.training import loop as T
from loraflow.training.run import current_lora_path
from loraflow.validation.validate import validate
from tests.factory import demo_dict, fixed_batch, loss_and_grads, write_config

SHARED = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
CACHES = (build_clips, encode_latents, encode_texts)


@pytest.fixture(scope="module")
def root(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two demo clips, and the tiny Kandinsky 6 with Kandinsky 5's shared components linked in."""
    root = tmp_path_factory.mktemp("k6-stages")
    model = build_tiny("kandinsky6", root / "k6")
    for component in SHARED:
        shutil.rmtree(model / component)
        (model / component).symlink_to(tiny_k5 / component, target_is_directory=True)
    (root / "data").mkdir()
    for stem in ("clip_00", "clip_02"):
        for ext in (".mp4", ".txt"):
            shutil.copy(demo_data / f"{stem}{ext}", root / "data" / f"{stem}{ext}")
    return root


def make_config(root: Path, family: str, model: Path, home: Path | None = None) -> LoraflowConfig:
    """The family's config over root's demo clips; its cache and outputs under `home` (default: root's, which the
    module's tests share)."""
    home = home or root
    data = demo_dict(model, root / "data", home, model_family=family, max_train_steps=2, checkpointing_steps=100)
    data.pop("model_flavour")  # each family's default: Kandinsky 5's t2v-lite-sft-5s, Kandinsky 6's lite-t2v
    return load_config(write_config(home / f"{family}.yaml", data))


def run(config: LoraflowConfig, ops: tuple) -> list[int]:
    family, store = get_family(config), Store(config.cache_dir, config.manifest_names)
    return [op(config, family, model_source(config), store).computed for op in ops]


def test_kandinsky5_caches_serve_kandinsky6(root: Path, tiny_k5: Path, tmp_path: Path) -> None:
    """In a cache of its own: Kandinsky 5 computes every cache (with the module's shared cache, a test run before it
    had computed them, and the first assertion depended on the order), then Kandinsky 6 reuses every one."""
    assert all(run(make_config(root, "kandinsky5-video", tiny_k5, home=tmp_path), CACHES))
    assert run(make_config(root, "kandinsky6", root / "k6", home=tmp_path), CACHES) == [0, 0, 0]


def test_a_text_encoded_otherwise_is_keyed_as_kandinsky6s(root: Path) -> None:
    """Only texts Kandinsky 5 encodes alike take its keys: not one its `prompt_clean` changes (Kandinsky 6 encodes the
    spaces and the entity as given), nor one past Kandinsky 5's 256 tokens (Kandinsky 6 keeps 1024)."""
    config = make_config(root, "kandinsky6", root / "k6")
    family = get_family(config)
    texts = ["a red circle", "a  red circle", "a red &amp; blue circle", ("a red circle " * 20).strip()]
    items = [(text, "") for text in texts]
    keyed = keying_families(family, model_source(config), items)
    assert [keyed[item].name for item in items] == ["kandinsky5-video", "kandinsky6", "kandinsky6", "kandinsky6"]
    tokenizer = load_component(root / "k6", "tokenizer")
    assert len(tokenizer(items[-1][0])["input_ids"]) > 256  # the byte-level tiny tokenizer: one token a byte


def test_kandinsky6_trains_renders_and_a_rerun_computes_nothing(root: Path) -> None:
    config = make_config(root, "kandinsky6", root / "k6")
    family, store, model = get_family(config), Store(config.cache_dir, config.manifest_names), model_source(config)
    run(config, CACHES)  # computed, or reused from another test of the module
    assert T.train_lora(config, family, model, store).computed == config.max_train_steps
    lora = current_lora_path(config, family, store)
    report = validate(config, family, model, store, lora)
    assert report.computed == 1 and report.mean_abs_pixel_change > 0
    (video,) = Path(config.output_dir).rglob("lora.mp4")
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        assert (stream.height, stream.width) == config.validation_size
        assert sum(1 for _ in container.decode(stream)) == config.validation_num_video_frames
    assert run(config, (*CACHES, T.train_lora)) == [0, 0, 0, 0]
    assert validate(config, family, model, store, lora).computed == 0


def test_group_offload_changes_no_number(root: Path) -> None:
    """diffusers 0.42.1 lets Kandinsky 6's transformer group-offload (it does not set `_supports_group_offloading =
    False`): block-level hooks around the fused blocks, whose arguments are tuples, give the loss and gradients of a
    run without them, bit for bit (on the CPU the blocks move from the CPU to the CPU: the hooks run, the numbers are
    the same ops). tests/training/test_train.py shows the same for Kandinsky 5."""
    import torch

    plain = make_config(root, "kandinsky6", root / "k6")
    run(plain, CACHES)
    batch = fixed_batch(plain)
    offloaded = plain.model_copy(update={"enable_group_offload": True, "group_offload_type": "block_level"})
    loss, grads = loss_and_grads(plain, batch)
    other_loss, other_grads = loss_and_grads(offloaded, batch)
    assert (grads != 0).float().mean() > 0.5  # a comparison of zeros would prove nothing
    assert loss == other_loss and torch.equal(grads, other_grads)


def test_scheduled_sampling_refuses_a_piflow_head(tmp_path: Path) -> None:
    """π-Flow's n velocities per channel are no Euler step: the rollout says which key to change."""
    import torch

    from loraflow.kernels.scheduled_sampling import roll_out
    from loraflow.pipelines.kandinsky6 import family as kandinsky6

    model = build_tiny("kandinsky6", tmp_path / "piflow", flavour="lite-distill-t2v")
    family = kandinsky6.make_family("lite-distill-t2v")
    transformer = load_component(model, "transformer")
    text = {"text_embeds": torch.randn(1, 5, 32), "pooled_embeds": torch.randn(1, 32)}
    x0, noise = torch.randn(1, 16, 2, 4, 4), torch.randn(1, 16, 2, 4, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="scheduled_sampling_max_step_offset: 0"):
        roll_out(lambda x, s: family.velocity(transformer, x, s, text), x0, x0, noise, torch.tensor([0.5]),
                 torch.tensor([3]))


def test_a_train_audio_config_caches_the_sound_and_trains(root: Path) -> None:
    """`train_audio` on the tiny Kandinsky 6: the audio_latents stage encodes each clip's sound with the checkpoint's
    own audio VAE (a rerun computes nothing); the demo clips have no track, so their rows say so, and under
    `clips_without_audio: video_only` (the default) the lora stage trains their pictures alone: every step's audio
    term is 0. With `leave_out` no clip is left to train, and the error says where to look.
    tests/stages/test_kandinsky6_audio.py trains clips with sound."""
    from loraflow.contracts.audio_rows import read_audio_rows
    from loraflow.stages.audio.audio_latents import encode_audio

    data = demo_dict(root / "k6", root / "data", root, model_family="kandinsky6", train_audio=True,
                     max_train_steps=2, checkpointing_steps=100)
    data.pop("model_flavour")
    config = load_config(write_config(root / "k6-audio.yaml", data))
    store, model = Store(config.cache_dir, config.manifest_names), model_source(config)
    run(config, CACHES)
    report = encode_audio(config, model, store)
    rows = read_audio_rows(store)
    assert report.computed == 2 and len(rows) == 2 and {r.status for r in rows.values()} == {"no_audio"}
    assert encode_audio(config, model, store).computed == 0
    trained = T.train_lora(config, get_family(config), model, store)
    assert trained.computed == 2 and [step.audio_loss for step in trained.history] == [0.0, 0.0]
    assert trained.inputs["audio_latents"]  # a new audio row makes a new run
    left_out = config.model_copy(update={"clips_without_audio": "leave_out"})
    with pytest.raises(ValueError, match="no training samples.*audio_latents"):
        T.train_lora(left_out, get_family(left_out), model, store)
