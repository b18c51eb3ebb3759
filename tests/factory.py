"""What the tests build and share, in one place: configs, dataset rows and folders, the tiny Kandinsky 5 Video's
two-clip caches and the runs on them, rank launches, the released models on fake tensors, and the seed guides as a
reader combines them.

Test modules import from here (and from media_factory, numerics, servers, dagster_dev), never from one another;
tests/conftest.py makes the expensive builds fixtures. Heavy imports (torch, diffusers, the stages) stay inside the
functions, so a config test does not pay for them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest
import yaml

from loraflow.config import LoraflowConfig, load_config, parse_config
from loraflow.contracts.clip_rows import ClipRow
from loraflow.pipelines import family_flavour

if TYPE_CHECKING:
    import numpy as np
    import torch

    from loraflow.pipelines.base import ModelFamily
    from loraflow.store import Store
    from loraflow.training.batches import MicroBatch, StepDraws

REPO = Path(__file__).resolve().parents[1]


def missing_input(what: str) -> NoReturn:
    """An input from outside the repository that a test needs is not here (Chromium, a server's package, the seed
    guides of ../shared, the real Qwen vocabulary): the test skips, saying so; under CI (`CI` set) it fails, since CI
    has each one (.ci/run installs the first two, `make setup-test` builds the vocabulary, shared/ lies beside CI's
    clone) and a skip there would hide a test that never ran."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI is set: what a test needs must be there)", pytrace=False)
    pytest.skip(what)


# -- configs ----------------------------------------------------------------------------------------------------------


def demo() -> dict:
    """configs/demo.yaml, the README's demo config, as written."""
    return yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())


def demo_dict(model: Path, data: Path, root: Path, base: str = "tests/demo_t2v.yaml",
              **overrides: Any) -> dict[str, Any]:
    """The suite's t2v config (or `base`: "configs/demo.yaml" is the README's demo) with absolute paths under
    `root`, plus overrides (top-level keys)."""
    config = yaml.safe_load((REPO / base).read_text())
    config.update(pretrained_model_name_or_path=str(model), output_dir=str(root / "output"),
                  cache_dir=str(root / "cache"))
    config["datasets"][0]["instance_data_dir"] = str(data)
    config["datasets"][1]["cache_dir"] = str(root / "cache" / "text")
    config.update(overrides)
    return config


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def config_for(model: Path, data: Path, root: Path, name: str = "config.yaml", **overrides: Any) -> LoraflowConfig:
    """The suite's config (`demo_dict`: `model`, the dataset `data`, under `root`) with `overrides`, written as
    root/<name> and loaded."""
    return load_config(write_config(root / name, demo_dict(model, data, root, **overrides)))


def make_config(caches: dict[str, Path], output: Path, **overrides: Any) -> LoraflowConfig:
    """The suite's config on `caches` ("model", "data" and "root": the cache under root/cache), 2 steps, writing into
    `output`; written beside it as <output>.yaml (what a launched process or an asset reads)."""
    data = demo_dict(caches["model"], caches["data"], caches["root"], max_train_steps=2, checkpointing_steps=100)
    data.update(output_dir=str(output), **overrides)
    path = output.parent / f"{output.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    return load_config(write_config(path, data))


def clips_config(model: Path, root: Path, datasets: list[dict[str, Any]], **overrides: Any) -> LoraflowConfig:
    """A Kandinsky 5 Video config of `datasets` (64 px, 5 frames unless they say otherwise) under `root`; no file."""
    entries = [{"id": f"d{i}", "dataset_type": "video", "resolution": 64, "video": {"num_frames": 5}, **d}
               for i, d in enumerate(datasets)]
    data = {"model_family": "kandinsky5-video", "model_flavour": "t2v-lite-sft-5s",
            "pretrained_model_name_or_path": str(model), "output_dir": str(root / "out"),
            "cache_dir": str(root / "cache"), "datasets": entries, **overrides}
    return parse_config(data)


def k5_settings(tmp_path: Path, **model: str) -> dict:
    """A Kandinsky 5 Video config (its default flavour) of one empty dataset under tmp_path, plus `model` (the model
    keys: pretrained_model_name_or_path, revision, vae_path...)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return {"model_family": "kandinsky5-video", "output_dir": str(tmp_path / "out"),
            "cache_dir": str(tmp_path / "cache"), "datasets": [{"id": "v", "instance_data_dir": str(data)}], **model}


# The repository `k5_settings` names without a model key: kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers
K5_DEFAULT_REPO = family_flavour("kandinsky5-video", "t2v-lite-sft-5s").repo

# A SimpleTuner multidatabackend.json of one Kandinsky 5 Image dataset, as that family's users write it
K5_IMAGE_BACKEND = [
    {"id": "my-image-dataset", "type": "local", "dataset_type": "image", "instance_data_dir": "datasets/my_images",
     "caption_strategy": "textfile", "resolution": 1024, "crop": True, "crop_aspect": "square", "repeats": 10},
    {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": True,
     "cache_dir": "cache/text/kandinsky5", "disabled": False},
]


def hf_cache_snapshot(cache: Path, repo: str, checkpoint: Path, commit: str, branch: str = "main") -> Path:
    """Put a checkpoint folder into a Hugging Face cache as huggingface_hub stores a download: each file once as a
    blob named by its content hash, the snapshot a tree of relative links to them, refs/<branch> the commit."""
    from loraflow.keys import file_sha256

    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        blob = storage / "blobs" / file_sha256(file)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / branch).write_text(commit)
    return snapshot


# -- rows and dataset folders -----------------------------------------------------------------------------------------


def clip_row(key: str, dataset: str, source: str = "s.mp4", num_frames: int = 1, **fields: Any) -> ClipRow:
    """A clip of `source` whose other fields are those of a 64x64 clip of its first `num_frames` frames (a fake
    store, the hold-out split, CREPA's rows)."""
    return ClipRow(**{"key": key, "dataset": dataset, "source": source, "path": f"/data/{source}",
                      "bucket": f"64x64@{num_frames}", "height": 64, "width": 64, "num_frames": num_frames,
                      "indices": tuple(range(num_frames)), "resize": (64, 64), "box": (0, 0, 64, 64),
                      "captions": ("a cat",), "repeats": 1, **fields})


def text_rows() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two text_embeds rows of the tiny Kandinsky 5 (7 and 3 tokens): random, the same every call."""
    import numpy as np

    from loraflow.pipelines.tiny_parts import TEXT_DIM

    generator = np.random.default_rng(0)
    row = lambda length: {"text_embeds": generator.standard_normal((length, TEXT_DIM), dtype=np.float32),  # noqa: E731
                          "pooled_embeds": generator.standard_normal(TEXT_DIM, dtype=np.float32)}
    return row(7), row(3)


def videos(folder: Path, count: int, captions: bool = True, **kw: Any) -> list[Path]:
    """`count` index-coded H.264 videos (12 frames of 96x64 unless `kw` says otherwise), each with a caption file."""
    from tests.media_factory import write_h264

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = write_h264(folder / f"clip_{i}.mp4", num_frames=kw.get("num_frames", 12), width=kw.get("width", 96),
                          height=kw.get("height", 64))
        if captions:
            path.with_suffix(".txt").write_text(f"caption {i}\n", encoding="utf-8")
        paths.append(path)
    return paths


def two_clips(demo_data: Path, data: Path) -> Path:
    """Two clips of the demo set (clip_00, clip_02) with their captions, copied into a new folder `data`."""
    data.mkdir()
    for stem in ("clip_00", "clip_02"):
        for ext in (".mp4", ".txt"):
            shutil.copy(demo_data / f"{stem}{ext}", data / f"{stem}{ext}")
    return data


def many_clips(demo: Path, folder: Path, copies: int) -> Path:
    """`copies` renamed copies of the demo dataset, with one fixed mtime: the clip keys, and so each worker's share,
    are the same in every run of the test."""
    folder.mkdir()
    for copy in range(copies):
        for source in demo.iterdir():
            if not source.name.startswith("."):
                target = folder / f"{source.stem}_{copy:02d}{source.suffix}"
                shutil.copyfile(source, target)
                os.utime(target, ns=(1_700_000_000_000_000_000,) * 2)
    return folder


# -- the stages on a config -------------------------------------------------------------------------------------------


def run_clips(config: LoraflowConfig) -> tuple[Any, Any]:
    """The clips stage on the config's datasets: (its report, the store)."""
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.stages.clips.clips import build_clips
    from loraflow.store import Store

    family = get_family(config)
    store = Store(config.cache_dir, config.manifest_names)
    return build_clips(config, family, model_source(config), store), store


def demo_clips(model: Path, data: Path, root: Path) -> tuple[LoraflowConfig, Any, Any]:
    """The suite's config on `model` and `data`, written to root/config.yaml, its clips cached: (config, family,
    store)."""
    from loraflow.pipelines import get_family

    config = config_for(model, data, root)
    return config, get_family(config), run_clips(config)[1]


def uninterrupted_latents(model: Path, data: Path, root: Path, keys: list[str]) -> dict[str, np.ndarray]:
    """{key: latent} as a run never killed and never short of memory writes them, into a cache of its own under `root`
    (the VAE's mode, clip by clip: the same bits in any process)."""
    from loraflow.pipelines.sources import model_source
    from loraflow.stages.latents.latents import encode_latents

    root.mkdir()
    config, family, store = demo_clips(model, data, root)
    encode_latents(config, family, model_source(config), store)
    return {key: row["latent"] for key, row in store.get("latents", keys).items()}


def forget_latents(config: Path) -> None:
    """Remove every cached latent, so that the next latents step encodes for seconds (time to kill it mid-way)."""
    shutil.rmtree(Path(load_config(config).cache_dir) / "latents", ignore_errors=True)


# -- the tiny Kandinsky 5 Video: the two-clip caches and the runs on them ---------------------------------------------

SHORT_CAPTION = "a dot"


def cache_for(config: LoraflowConfig) -> Store:
    """clips, captions, latents, sound and text_embeds for `config` in its cache_dir, as the `cache_dataset` and
    `train_and_validate` jobs make them: what is there already is reused (content keys), and each list is written
    under the config's names, beside those of other configs or settings. The config's store."""
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.stages.audio.audio_latents import encode_audio
    from loraflow.stages.captions.captions import auto_datasets, build_captions
    from loraflow.stages.clips.clips import build_clips
    from loraflow.stages.latents.latents import encode_latents
    from loraflow.stages.text.text_embeds import encode_texts
    from loraflow.store import Store

    family, model, store = get_family(config), model_source(config), Store(config.cache_dir, config.manifest_names)
    build_clips(config, family, model, store)
    if auto_datasets(config):
        build_captions(config, model, store)
    encode_latents(config, family, model, store)
    if config.train_audio:
        encode_audio(config, model, store)
    encode_texts(config, family, model, store)
    return store


def build_caches(tiny_k5: Path, demo_data: Path, root: Path) -> dict[str, Path]:
    """clips, latents and text_embeds of the two-clip dataset under root/cache; clip_00 is also there as clip_00b
    with a short caption, so one bucket holds two text lengths (what K5 batching must never mix)."""
    data = two_clips(demo_data, root / "data")
    shutil.copy(demo_data / "clip_00.mp4", data / "clip_00b.mp4")  # same bucket as clip_00, another text length
    (data / "clip_00b.txt").write_text(SHORT_CAPTION)
    cache_for(make_config({"model": tiny_k5, "data": data, "root": root}, root / "output"))
    return {"model": tiny_k5, "data": data, "root": root}


def train(config: LoraflowConfig):
    """`train_lora` on the config, in this process."""
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.store import Store
    from loraflow.training import loop

    store = Store(config.cache_dir, config.manifest_names)  # the config's own parts, as the lora asset opens it
    return loop.train_lora(config, get_family(config), model_source(config), store)


def capture_renders(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[np.ndarray]]:
    """The frames the renders during training ("progress") and the validation stage ("validation") hand write_media,
    in order, each still written (frames, not mp4s: the encoded bytes vary with libx264's threads)."""
    from loraflow.training.options import progress_renders
    from loraflow.validation import validate

    written: dict[str, list[np.ndarray]] = {"progress": [], "validation": []}
    for module, key in ((progress_renders, "progress"), (validate, "validation")):
        keep = module.write_media
        monkeypatch.setattr(module, "write_media",
                            lambda frames, stem, fps, sound=None, keep=keep, key=key: written[key].append(frames)
                            or keep(frames, stem, fps, sound))
    return written


def fixed_batch(config: LoraflowConfig, micro_step: int = 0) -> MicroBatch:
    """The micro-batch training draws at `micro_step`."""
    from loraflow.pipelines import get_family
    from loraflow.store import Store
    from loraflow.training import batches

    store = Store(config.cache_dir, config.manifest_names)
    plan = batches.BatchPlan(batches.build_samples(config, store), config.train_batch_size, config.seed)
    return batches.load_micro_batch(config, get_family(config), store, plan(micro_step), micro_step)


def loss_and_grads(config: LoraflowConfig, batch: MicroBatch) -> tuple[float, torch.Tensor]:
    """The flow loss of `batch` and the LoRA's gradients (B drawn non-zero), as training's step computes them."""
    import torch

    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.training.model_setup import Trainable, enable_offload, load_transformer
    from loraflow.training.step import flow_terms

    cpu, family = torch.device("cpu"), get_family(config)
    transformer, params = load_transformer(config, family, model_source(config), cpu)
    enable_offload(transformer, config, family, cpu)
    trainable = Trainable(transformer, params, cpu)
    for p in params:  # non-zero B, so every LoRA matrix gets a gradient
        if p.shape[1] == config.lora_rank:
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    loss = flow_terms(transformer, family, batch, cpu, autocast=False).flow
    loss.backward()
    trainable.collect()
    assert trainable.offloaded == (config.enable_group_offload or config.blocks_to_swap > 0)
    return loss.item(), torch.cat([g.flatten() for g in trainable.gradients()])


def reference_lora(model: Path, config: LoraflowConfig) -> tuple[torch.nn.Module, list, torch.optim.Optimizer]:
    """The demo's LoRA (rank 4 on K5 attention, lora_A seeded like training's) and AdamW, written out by hand."""
    import torch
    from diffusers import Kandinsky5Transformer3DModel
    from peft import LoraConfig

    transformer = Kandinsky5Transformer3DModel.from_pretrained(model / "transformer").requires_grad_(False)
    torch.manual_seed(config.seed)
    targets = [f"{a}.{p}" for a in ("self_attention", "cross_attention")
               for p in ("to_query", "to_key", "to_value", "out_layer")]
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=True))
    params = [p.requires_grad_(True) for n, p in transformer.named_parameters() if "lora_" in n]
    return transformer, params, torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)


def same_lora_file(a: Path, b: Path) -> bool:
    """Bit-equal tensors and an equal header (whose key order safetensors randomises per save: not the bytes)."""
    import torch
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        return (fa.metadata() == fb.metadata() and sorted(fa.keys()) == sorted(fb.keys())
                and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys()))


# -- a validation store: clips, seeded latents, real text embeddings, a LoRA of random B -----------------------------

VALIDATION_LIBRARY = {"blue": "a blue square spins slowly", "two words/odd": "a green triangle"}
VALIDATION_CAPTIONS = [f"clip {i}: a {c} ball bounces"
                       for i, c in enumerate(["red", "blue", "green", "white", "black"])]
VALIDATION_HEIGHT, VALIDATION_WIDTH = 48, 64


def validation_dict(model: Path, root: Path, **overrides: Any) -> dict[str, Any]:
    """Validation's config on `model`: two 48 px datasets under `root`, 5-frame 64x48 renders of 3 prompts, 2 steps,
    a fifth of the clips held out."""
    data = {
        "model_family": "kandinsky5-video", "model_flavour": "t2v-lite-sft-5s",
        "pretrained_model_name_or_path": str(model), "output_dir": str(root / "output"),
        "cache_dir": str(root / "cache"),
        "datasets": [{"id": "videos", "instance_data_dir": str(root / "videos"), "resolution": 48},
                     {"id": "more", "instance_data_dir": str(root / "more"), "resolution": 48}],
        "seed": 7, "validation_prompt": "a red circle moves right", "user_prompt_library": VALIDATION_LIBRARY,
        "validation_resolution": f"{VALIDATION_WIDTH}x{VALIDATION_HEIGHT}", "validation_num_video_frames": 5,
        "validation_num_inference_steps": 2, "validation_guidance": 3.0, "eval_holdout_fraction": 0.2,
    }
    return {**data, **overrides}


def fill_validation_store(config: LoraflowConfig, store: Store) -> None:
    """Clips manifest (5 videos, one clip each), seeded latents, and real text embeddings."""
    import torch

    from loraflow.contracts.latent_rows import LatentRow
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.stages.text.text_embeds import encode_texts

    bucket = f"{VALIDATION_WIDTH}x{VALIDATION_HEIGHT}@5"
    clips = [clip_row(f"clip{i}", "videos", f"v{i}.mp4", num_frames=5, captions=(caption,), bucket=bucket).to_row()
             for i, caption in enumerate(VALIDATION_CAPTIONS)]
    store.write_manifest("clips", clips)
    generator = torch.Generator().manual_seed(0)
    shape = (16, 2, VALIDATION_HEIGHT // 8, VALIDATION_WIDTH // 8)
    latents = [{"key": f"latent{i}", "latent": torch.randn(shape, generator=generator).numpy()}
               for i in range(len(clips))]
    store.put("latents", latents)
    store.write_manifest("latents", [LatentRow(f"latent{i}", c["key"], c["bucket"], c["dataset"]).to_row()
                                     for i, c in enumerate(clips)])
    encode_texts(config, get_family(config), model_source(config), store)


def random_lora(config: LoraflowConfig, out: Path) -> Path:
    """A rank-4 adapter with random B (a fresh adapter has B = 0 and changes nothing), in diffusers format with its
    LoraConfig in the header, as training exports it."""
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from loraflow.pipelines import get_family
    from loraflow.pipelines.base import load_component
    from loraflow.training.checkpoints import adapter_config

    family = get_family(config)
    transformer = load_component(config.pretrained_model_name_or_path, "transformer")
    with torch.random.fork_rng():  # peft draws lora_A from the global RNG: without a seed, what ran before chose it
        torch.manual_seed(0)
        transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=family.lora_targets(True)))
    generator = torch.Generator().manual_seed(1)
    for name, param in transformer.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    family.save_lora(get_peft_model_state_dict(transformer), out, adapter_config(transformer))
    return out / "pytorch_lora_weights.safetensors"


# -- rank launches ----------------------------------------------------------------------------------------------------

# Two ranks against one process (tests/training/test_distributed.py, test_fsdp.py): steps 1-3, a checkpoint at 2;
# LoRA dropout and caption dropout make the per-micro-step draws matter.
TWO_RANK_SETTINGS = {"max_train_steps": 3, "checkpointing_steps": 2, "checkpoints_total_limit": 2,
                     "lora_dropout": 0.1, "caption_dropout_probability": 0.3}


def run_ranks(command: list[str], **env: str) -> subprocess.CompletedProcess:
    """The launcher's command on CPUs (gloo), also on a machine with a GPU; it must succeed."""
    cpu_only = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    done = subprocess.run(command, cwd=REPO, env=cpu_only, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


# -- the released models on fake tensors (tests/pipelines/test_released_dry_runs.py, test_released_render.py) --------

DEPTH = 3  # visual blocks kept: TREAD routes the middle one, CREPA reads it
TREAD = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]}
TEXT_TOKENS = {"kandinsky5-video": 256, "kandinsky5-image": 512, "hunyuanvideo-1.5": 1000,  # the longest prompt
               "kandinsky6": 1024}
LATENT = {"kandinsky5-video": (16, 8), "kandinsky5-image": (16, 8), "hunyuanvideo-1.5": (32, 16),  # channels, VAE
          "kandinsky6": (16, 8)}


@dataclass(frozen=True)
class Case:
    family: str
    flavour: str
    feature: str  # "tread", "crepa" or "" (NABLA takes neither)
    same_as: tuple[str, ...] = ()  # flavours with the same transformer file and task (the same dry run)


def dry_config(case: Case) -> LoraflowConfig:
    extra = {"tread": {"tread_config": TREAD},
             "crepa": {"crepa_enabled": True, "crepa_encoder_path": "unused", "crepa_block_index": 1}}
    dataset = {"id": "dry", "instance_data_dir": "unused"}
    if case.family == "kandinsky5-image":
        dataset["video"] = {"num_frames": 1}
    sources = []
    if case.flavour.startswith("i2i"):
        sources = [{**dataset, "id": "sources", "dataset_type": "conditioning", "instance_data_dir": "unused-sources"}]
        dataset["conditioning_data"] = "sources"
    return parse_config({
        "model_family": case.family, "model_flavour": case.flavour, "pretrained_model_name_or_path": "unused",
        "datasets": [dataset, *sources], "lora_rank": 16,
        "lora_include_ffn": True, "base_model_precision": "bf16", "gradient_checkpointing": True,
        **extra.get(case.feature, {})})


def depth(config: dict) -> dict:
    """The config overrides that keep DEPTH visual blocks."""
    return {"num_visual_blocks": DEPTH} if "num_visual_blocks" in config else {"num_layers": DEPTH}


def as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """What `from_pretrained(torch_dtype=dtype)` leaves (`load_component`): every parameter in `dtype` but those of
    the class's `_keep_in_fp32_modules` (diffusers' rule: a module name among the parameter name's parts)."""
    keep = set(type(model)._keep_in_fp32_modules or ())
    for name, p in model.named_parameters():
        if not keep & set(name.split(".")):
            p.data = p.data.to(dtype)
    return model.eval().requires_grad_(False)


def latent_shape(family: ModelFamily) -> tuple[int, ...]:
    channels, factor = LATENT[family.name]
    height, width = family.flavour.size
    frames = (family.flavour.num_frames - 1) // family.vae_temporal_factor + 1
    return 1, channels, frames, height // factor, width // factor


def encoder_width(flavour: str, component: str) -> int:
    """The width of what a released text encoder hands the transformer (Qwen's hidden states, CLIP's pooled
    output, ByT5's states): its config's, not the transformer's, so a mismatch between the two fails."""
    from loraflow.pipelines.released import released_config

    config = released_config(flavour, component)
    config = config.get("text_config", config)  # Qwen2.5-VL nests its language model's
    return config.get("hidden_size") or config["d_model"]


def text_batch(family: ModelFamily, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """What `load_micro_batch` hands `velocity`: the family's text at its longest prompt, as wide as the released
    text encoders make it, and the latent rows' image conditions (i2i: the source latent)."""
    import torch

    from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15

    tokens, name = TEXT_TOKENS[family.name], family.flavour.name
    seeded = torch.Generator().manual_seed(0)  # the same batch in every process and test order
    qwen, second = encoder_width(name, "text_encoder"), encoder_width(name, "text_encoder_2")
    if family.name.startswith("kandinsky"):
        text = {"text_embeds": torch.randn(1, tokens, qwen, generator=seeded),
                "pooled_embeds": torch.randn(1, second, generator=seeded)}
    else:
        text = {"text_embeds": torch.randn(1, tokens, qwen, generator=seeded), "text_mask": torch.ones(1, tokens),
                "byt5_embeds": torch.randn(1, 256, second, generator=seeded), "byt5_mask": torch.ones(1, 256)}
    if family.flavour.edits_image or family.image_condition_name:  # HV1.5 i2v: the first frame's latent, SigLIP
        text["image_latent"] = torch.randn(*shape[:2], 1, *shape[3:], generator=seeded)
    if family.image_condition_name == "first_frame" and family.name == "hunyuanvideo-1.5":
        text["image_embeds"] = torch.randn(1, hunyuanvideo15.IMAGE_TOKENS, encoder_width(name, "image_encoder"),
                                           generator=seeded)
    return text


def released_batch(config: LoraflowConfig, family: ModelFamily) -> tuple[
        tuple[int, ...], dict[str, torch.Tensor], StepDraws, torch.Tensor]:
    """A real batch at the flavour's released size: the latent shape, the text, the step's draws, the clean latent."""
    import torch

    from loraflow.training.batches import step_draws

    shape = latent_shape(family)
    text, draws = text_batch(family, shape), step_draws(config, family, 0, shape)
    return shape, text, draws, torch.randn(shape, generator=torch.Generator().manual_seed(1))


def released_transformer(case: Case, config: LoraflowConfig, family: ModelFamily) -> tuple[torch.nn.Module, list]:
    """Under `fake_mode()`: the released transformer (DEPTH blocks) loaded in the run's precision and prepared as
    `train_lora` prepares it, with the parameters it trains."""
    from loraflow.estimates.fake_tensors import released_model
    from loraflow.pipelines.released import released_config
    from loraflow.training.model_setup import base_dtype, prepare_transformer

    released = family.flavour.configured(released_config(case.flavour, "transformer"))  # Pro's SD or HD mode
    model = as_loaded(released_model(case.flavour, "transformer", **depth(released),
                                     **dict(family.flavour.transformer_config)), base_dtype(config))
    return prepare_transformer(model, config, family)


# -- the seed guides (../shared/seeds/) as their readers combine them -------------------------------------------------

SEEDS = REPO.parent / "shared" / "seeds"
GUIDES = sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []
FILES = ("config.json", "multidatabackend.json", "user_prompt_library.json")


def blocks(text: str) -> list[tuple[str, str, Any]]:
    """(file the text last names before the block, heading above it, parsed JSON) per ```json block; a block of
    bare `"key": value` lines (guide 002's quantisation snippet) is read as the object it belongs in."""
    found = []
    for match in re.finditer(r"```json\n(.*?)```", text, re.S):
        before = text[:match.start()]
        named = max(FILES, key=lambda name: before.rfind(name))
        heading = re.findall(r"^#+ .*$", before, re.M)[-1]
        body = match.group(1).strip()
        found.append((named, heading, json.loads(body if body[0] in "[{" else "{" + body + "}")))
    return found


def combine(guide: Path, root: Path, with_i2v: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """config.json settings and the dataset list, as a reader of the guide writes them under `root`."""
    text = guide.read_text()
    settings: dict[str, Any] = dict(re.findall(r"`(model_family)`: `([^`]+)`", text)[:1])
    backends: list[dict[str, Any]] = []
    for named, heading, data in blocks(text):
        if "I2V" in heading and not with_i2v:  # a section for i2v flavours only
            continue
        if named == "multidatabackend.json":
            backends = data
        elif named == "user_prompt_library.json":
            (root / "config").mkdir(exist_ok=True)
            (root / "config" / named).write_text(json.dumps(data))
        else:
            settings.update(data)
    return settings, backends
