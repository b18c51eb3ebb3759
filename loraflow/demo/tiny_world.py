"""The tiny world: a tiny Kandinsky 5 Video that renders the demo's shapes, so a LoRA's effect can be seen and tested.

A random tiny checkpoint renders coloured noise with or without a LoRA. Here its two learned parts are made to work:

- **The VAE is built, not trained** (`mosaic_vae`): the real `AutoencoderKLHunyuanVideo` class with weights set so that
  a latent cell is the mean colour of its 8x8 pixels (and of its 4 frames, frame 0 alone) and decoding repeats it.
  Every resnet and the attention add zero to their residual; the down- and upsamplers average and copy. The two
  GroupNorms in front of `conv_out` would take away a colour's level, so each colour travels as a +c/-c channel pair
  beside a +K/-K pair: the group's mean is then exactly 0, its std K/2 to 1e-4, and silu(n) - silu(-n) = n undoes the
  activation exactly. Trained from random weights instead (tried: L1 on world frames, 300-800 steps, about a minute),
  it reached ~10 dB PSNR and lost where the shape was across frames; this one reconstructs the world at ~22 dB.
- **The transformer is pre-trained briefly** (`pretrain`: 89-292 s on one 2-core host, `demo_cpu.json`) with flow
  matching on world clips encoded by that VAE and captioned by the checkpoint's own tiny text encoders. It sees shapes
  move right to left, down and up, never left to right: the demo's LoRA teaches that direction (`demo/dataset.py`). It
  is trained as i2v (latent frame 0 given clean): Kandinsky 5's DiT has RoPE and no absolute position, so from noise
  alone it cannot put one shape in one place, and t2v renders of this size scatter the shape's colour over the frame
  (tried: 1-motion, 2-colour worlds, 1.5k-4k steps, widths 64-128, 2-4 blocks). Given a first frame, it has to learn
  only where the shape goes. Shapes start anywhere (`world_clips`), for the same reason.

`build_tiny(..., world=True)` (what `loraflow demo` builds) uses it; the test suite's other tests keep the random
tiny checkpoint. The pre-trained weights are keyed by the family and flavour trained as, the recipe, the transformer's
config and initial weights and the text encoders' weights. The weights of the current recipe ship with loraflow
(`tiny_world_weights/<key>.safetensors`, 2.7 MB: this pre-training on a 2-core CPU was 292 s of a 655 s fresh
clone's `make demo`, and it ran in every CI run); another recipe's are trained once and cached under
`.loraflow/tiny_world/<key>/`. tests/demo/test_tiny_world.py fails when the shipped file is not the current key's, and
its soak test pre-trains the recipe again and holds the result against the shipped weights.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers import AutoencoderKLHunyuanVideo

from loraflow.atomic import write_atomic
from loraflow.keys import content_key

if TYPE_CHECKING:
    from loraflow.pipelines.base import ModelFamily
    from loraflow.pipelines.flavours import Flavour
    from loraflow.pipelines.tiny_parts import TinyPipeline

FAMILY = "kandinsky5-video"  # the family the tiny world is a checkpoint of
CACHE_ROOT = Path(__file__).resolve().parents[2] / ".loraflow" / "tiny_world"
SHIPPED = Path(__file__).resolve().parent / "tiny_world_weights"  # <key>.safetensors: the current recipe's, pre-trained
_VERSION = 1  # bump when the training code changes in a way the recipe's fields do not show
_PAIR = 100.0  # K: the constant channel pair that sets each GroupNorm's std (colours are at most 1 in size)
# Latents as the pipeline sees them (x scaling_factor): a colour cell's std over the world is then about 1, as the
# noise's is; with the real VAE's 0.477 the shapes would sit 3x under the noise.
SCALING_FACTOR = 2.5


@dataclass(frozen=True)
class WorldRecipe:
    """What the tiny transformer is pre-trained on, and how long: the demo's validation size and length."""

    motions: tuple[str, ...] = ("right_to_left", "top_to_bottom", "bottom_to_top")
    sizes: tuple[tuple[int, int], ...] = ((96, 64),)  # (width, height)
    frames: int = 17
    clips: int = 320  # encoded once per pre-training: ~45 s of one core
    # ~160 ms of one core a step. Fewer tried (issue 41), measured by tests/demo/test_demo_learns.py's criterion on a
    # world pre-trained on one thread: 250 steps at lr 6e-3 and 500 at 4e-3 leave the base carrying the circle right
    # (+1.6, +0.4 px); 1000 and 1250 at 3e-3 carry it left (-2.4, -2.9 px), but the LoRA's eval loss on the held-out
    # clip then rises (+11%, +16%) where 2000 steps' drops 19% (demo_cpu.json). The LoRA moved it +12 to +20 px in
    # all four: the world, not the LoRA, needs the steps.
    steps: int = 2000
    batch: int = 8
    learning_rate: float = 2e-3
    # Each sample's sigma shift: the flavour's 10 alone leaves sigma < 0.3 almost untrained (0.1% of draws), and a
    # render's last steps are there; 1 covers them.
    sigma_shifts: tuple[float, ...] = (1.0, 10.0)
    seed: int = 0


def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    """The tiny world's checkpoint (`build_tiny(FAMILY, ..., world=True)`), whatever the flavour: Kandinsky 5 Video's
    t2v layout (its `tiny.py`), with a VAE that shows the demo's shapes and a transformer pre-trained on them (cached
    after the first build), so renders show what a LoRA did."""
    from diffusers import Kandinsky5T2VPipeline

    from loraflow.pipelines.kandinsky5.video.spec import SPEC
    from loraflow.pipelines.tiny_parts import recipe_name

    return Kandinsky5T2VPipeline, recipe_name(SPEC.name, "world", 1), world_pipeline


def world_pipeline() -> TinyPipeline:
    """The tiny world's pipeline: Kandinsky 5's tiny text components, `mosaic_vae`, a 128-wide DiT `pretrain`ed."""
    from diffusers import Kandinsky5T2VPipeline

    from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_scheduler

    family, transformer, vae, text = world_inputs()
    pretrain(family, transformer, vae, text)
    pipe = Kandinsky5T2VPipeline(transformer=transformer, vae=vae, scheduler=kandinsky5_scheduler(shift=10.0), **text)
    return pipe, {}


def world_inputs() -> tuple[ModelFamily, torch.nn.Module, AutoencoderKLHunyuanVideo, dict[str, Any]]:
    """(family trained as, untrained transformer, `mosaic_vae`, text components), drawn from the global RNG in the
    order `build_tiny` (seed 0) draws them: what `pretrain` keys and trains."""
    from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_text_components, kandinsky5_transformer
    from loraflow.pipelines.kandinsky5.video.family import make_family

    text = kandinsky5_text_components()
    vae = mosaic_vae()
    # 128 wide: a 2x2 patch of 16 channels is 64 numbers, all noise a velocity must carry; at 32 the pre-training loss
    # stayed at 0.6, at 64 it reached 0.1 but renders stayed noisy. Pre-trained as i2v: see this module's docstring.
    return make_family("i2v-lite-5s"), kandinsky5_transformer(visual_cond=True, model_dim=128), vae, text


def mosaic_vae() -> AutoencoderKLHunyuanVideo:
    """The world's VAE: latent channels 0-2 are the mean RGB of each 8x8 pixel cell (x4 frames after frame 0), in
    [-1, 1]; channels 3-15 are zero and ignored by the decoder. No randomness: the same weights on every machine."""
    vae = AutoencoderKLHunyuanVideo(latent_channels=16, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                    norm_num_groups=1, spatial_compression_ratio=8, temporal_compression_ratio=4,
                                    scaling_factor=SCALING_FACTOR)
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.zero_()  # resnets' conv2 and attention's to_out stay zero: each block adds 0 to its input
        for name, module in vae.named_modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, torch.nn.Conv3d) and ("samplers" in name):
                _average_or_copy(module)
        for half in (vae.encoder, vae.decoder):
            _colour_pairs_in(half.conv_in.conv)
            _colour_pairs_out(half.conv_out.conv)
        for conv in (vae.quant_conv, vae.post_quant_conv):
            conv.weight[:, :, 0, 0, 0] = torch.eye(conv.out_channels)
        vae.encoder.conv_out.conv.bias[16:] = -30.0  # log-variance: the posterior is its mode
    return vae.eval()


def _colour_pairs_in(conv: torch.nn.Conv3d) -> None:
    """Channels (2c, 2c+1) = (+c, -c) for the 3 colours of the input (pixels or latents), 6 and 7 = (+K, -K).
    Taps: the causal conv's last frame tap (the frame itself) and the spatial centre."""
    for c in range(3):
        conv.weight[2 * c, c, -1, 1, 1], conv.weight[2 * c + 1, c, -1, 1, 1] = 1.0, -1.0
    conv.bias[6], conv.bias[7] = _PAIR, -_PAIR


def _colour_pairs_out(conv: torch.nn.Conv3d) -> None:
    """After GroupNorm (n = x / (K/2)) and silu: colour c = K/2 (silu(n_+c) - silu(n_-c)), which is K/2 n exactly."""
    for c in range(3):
        conv.weight[c, 2 * c, -1, 1, 1], conv.weight[c, 2 * c + 1, -1, 1, 1] = _PAIR / 2, -_PAIR / 2


def _average_or_copy(conv: torch.nn.Conv3d) -> None:
    """Downsampler (stride 2): output i's taps 1 and 2 are inputs 2i and 2i+1 (the causal pad puts 1 before), so
    averaging them pools 2x2 (and 2 frames; frame 0 meets its own replica). Upsampler (stride 1, after a nearest
    interpolation): the centre tap copies."""
    frames = (1, 2) if conv.stride[0] == 2 else (2,)
    cells = (1, 2) if conv.stride[1] == 2 else (1,)
    for channel in range(conv.out_channels):
        for t in frames:
            for y in cells:
                for x in cells:
                    conv.weight[channel, channel, t, y, x] = 1.0 / (len(frames) * len(cells) ** 2)


def pretrain(family: ModelFamily, transformer: torch.nn.Module, vae: AutoencoderKLHunyuanVideo,
             components: dict[str, Any], recipe: WorldRecipe = WorldRecipe(), cache_root: str | Path = CACHE_ROOT,
             shipped: str | Path | None = SHIPPED) -> torch.nn.Module:
    """Load the pre-trained weights for these inputs (the cache's, else the shipped ones), or train and cache them.
    `shipped=None` ignores the shipped weights. Returns `transformer`."""
    from safetensors.torch import load_file

    key = _key(family, transformer, components, recipe)
    path = Path(cache_root) / key / "transformer.safetensors"
    found = [p for p in (path, shipped and Path(shipped) / f"{key}.safetensors") if p and p.is_file()]
    if found:
        transformer.load_state_dict(load_file(found[0]))
    else:
        _train(family, transformer, vae, components, recipe)
        _save_atomic(transformer, path)
    return transformer.eval()


def _key(family: ModelFamily, transformer: torch.nn.Module, components: dict[str, Any], recipe: WorldRecipe) -> str:
    """The inputs that decide the trained weights: how it is trained (family, flavour, recipe), architecture, initial
    weights, text encoders."""
    from loraflow.keys import tensors_fingerprint

    def weights(module: torch.nn.Module) -> str:
        return tensors_fingerprint([tensor for _, tensor in sorted(module.state_dict().items())])

    return content_key(version=_VERSION, family=f"{family.name}/{family.flavour.name}", recipe=asdict(recipe),
                       # without diffusers' private entries: `_use_default_values` is a set's order, new per process
                       config={k: v for k, v in transformer.config.items() if not k.startswith("_")},
                       transformer=weights(transformer), text=weights(components["text_encoder"]),
                       text_2=weights(components["text_encoder_2"]))


def _train(family: ModelFamily, transformer: torch.nn.Module, vae: AutoencoderKLHunyuanVideo,
           components: dict[str, Any], recipe: WorldRecipe) -> None:
    """Flow matching on the whole transformer: batches of one size and one caption length (the K5 DiT has no text
    mask, so a batch's captions must be equally long)."""
    from tqdm import tqdm

    from loraflow.kernels.flow_matching import flow_mse, noisy_sample, sample_sigmas, shift_sigmas

    pool, groups = _encoded_world(family, vae, components, recipe)
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(transformer.parameters(), recipe.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.learning_rate, total_steps=recipe.steps,
                                                   pct_start=0.1)
    transformer.train()
    progress = tqdm(range(recipe.steps), desc="tiny world: pre-training the transformer (once)", unit="step")
    running = None
    for step in progress:
        group = groups[pool[int(torch.randint(len(pool), (1,), generator=generator))][2]]
        members = [pool[group[int(i)]] for i in torch.randint(len(group), (recipe.batch,), generator=generator)]
        x0 = torch.cat([latent for latent, _, _ in members])
        text = family.collate_text([row for _, row, _ in members], torch.device("cpu"))
        noise = torch.randn(x0.shape, generator=generator)
        shifts = torch.tensor(recipe.sigma_shifts)[torch.randint(len(recipe.sigma_shifts), (len(x0),),
                                                                 generator=generator)]
        sigma = shift_sigmas(sample_sigmas(len(x0), generator, "sigmoid"), shifts)
        given = family.flavour.conditioning_frames
        noisy = noisy_sample(x0, noise, sigma, given)
        loss = flow_mse(family.velocity(transformer, noisy, sigma, text), x0, noise, given)
        loss.backward()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 50 == 0:
            progress.set_postfix(loss=f"{running:.3f}")
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()


def _encoded_world(family: ModelFamily, vae: AutoencoderKLHunyuanVideo, components: dict[str, Any], recipe: WorldRecipe,
                   ) -> tuple[list, dict]:
    """[(latent (1, 16, T, h, w), text row, group)], and each group's pool indices. Clips of one size are encoded
    16 at a time (4x faster than one by one on a CPU), each caption once."""
    from loraflow.demo.dataset import world_clips

    clips = world_clips(recipe.seed, recipe.clips, recipe.sizes, recipe.frames, recipe.motions)
    by_size = defaultdict(list)
    for frames, caption in clips:
        by_size[frames.shape].append((frames, caption))
    pool, groups, rows = [], defaultdict(list), {}
    with torch.no_grad():
        for same_size in by_size.values():
            for start in range(0, len(same_size), 16):
                chunk = same_size[start : start + 16]
                latents = family.vae_encode(vae, torch.from_numpy(np.stack([frames for frames, _ in chunk])))
                for latent, (_, caption) in zip(latents, chunk):
                    if caption not in rows:
                        rows[caption] = family.encode_text(components, [caption])[0]
                    group = (tuple(latent.shape), len(rows[caption]["text_embeds"]))
                    groups[group].append(len(pool))
                    pool.append((latent[None], rows[caption], group))
    return pool, groups


def _save_atomic(module: torch.nn.Module, path: Path) -> None:
    """Written atomically: an interrupted build leaves no file that looks done."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in module.state_dict().items()}, tmp))


def decode_frames(vae: AutoencoderKLHunyuanVideo, frames: np.ndarray) -> np.ndarray:
    """uint8 video (F, H, W, 3) through encode -> mode -> decode, back as uint8 (F, H, W, 3)."""
    pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        decoded = vae.decode(vae.encode(pixels).latent_dist.mode()).sample.clamp(-1, 1)
    return ((decoded[0].permute(1, 2, 3, 0) + 1) * 127.5).round().byte().numpy()


def shape_centroid(frame: np.ndarray) -> tuple[float, float]:
    """(x, y) in pixels of the shape in a uint8 (H, W, 3) frame: the pixels whose colour is furthest from the
    background's (the border's median colour), at least half as far as the furthest, averaged by that distance."""
    border = np.concatenate([frame[0], frame[-1], frame[:, 0], frame[:, -1]]).astype(np.float32)
    distance = np.linalg.norm(frame.astype(np.float32) - np.median(border, axis=0), axis=-1)
    weight = np.where(distance >= distance.max() / 2, distance, 0.0)
    ys, xs = np.mgrid[0 : frame.shape[0], 0 : frame.shape[1]]
    return float((weight * xs).sum() / weight.sum()), float((weight * ys).sum() / weight.sum())


def rightward_shift(video: np.ndarray) -> float:
    """How far the demo's shape went right: its mean x over the generated frames minus its x in the given first frame
    (pixels). What tests/demo/test_demo_learns.py and benchmarks/bench_demo.py measure a render by."""
    xs = [shape_centroid(frame)[0] for frame in video]
    return float(np.mean(xs[1:]) - xs[0])
