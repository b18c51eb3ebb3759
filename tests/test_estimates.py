"""Estimates are claims: each is compared with the peak the CPU allocator reports for the same work.

The measured side runs the real thing: the transformer loaded by `training.model_setup.load_transformer` (real
from_pretrained), a first optimizer step (so AdamW's moments exist, as at every later step), then one more
`flow_terms` + backward under torch's profiler with `profile_memory`; the VAE loaded by `load_component` encoding
uint8 frames through `family.vae_encode`. Measured peak = the bytes the model (and optimizer) hold before (their
tensors' storages) + the highest running sum of the allocator's allocations and frees during the step: the
allocator's own account, not Python's. The estimate never sees a weight: it builds the model from config.json on
fake tensors, and adds by formula what CPU kernels allocate inside themselves (the flash-attention backward's
dQ accumulator and tiles, 3D convolutions' column buffers: `fake_tensors.attention_workspace`, `conv3d_columns`).

Tolerance 10% (the issue's), relative to the measured peak. Sizes are chosen so that activations, not weights,
make most of the peak (the tiny model's weights are 0.3 MB; the tiny step's activations 2 MB): a wrong
activation formula cannot hide behind the weights.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from diffusers.hooks import HookRegistry
from diffusers.hooks.layerwise_casting import LayerwiseCastingHook
from torch.profiler import ProfilerActivity, profile

from loraflow import estimates
from loraflow.config import LoraflowConfig, load_config
from loraflow.estimates import fake_tensors
from loraflow.pipelines import get_family
from loraflow.pipelines.base import image_conditions, load_component
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.buckets import latent_geometry
from loraflow.stages.latents.latents import prepare_vae
from loraflow.training.batches import MicroBatch, StepDraws
from loraflow.training.model_setup import _offload_hooks, enable_offload, load_transformer
from loraflow.training.options.optimizers import make_optimizer
from loraflow.training.step import flow_terms, routing, uses_autocast
from tests.factory import demo_dict, write_config

CPU = torch.device("cpu")
TOLERANCE = 0.10
GIB = estimates.GIB
BUCKET = (17, 64, 96)  # frames, height, width: a demo bucket


def allocator_peak(fn: Callable[[], None]) -> int:
    """The highest running sum of the CPU allocator's allocations minus frees while `fn` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


def config_for(model: Path, data: Path, root: Path, **overrides: object) -> LoraflowConfig:
    return load_config(write_config(root / "config.yaml", demo_dict(model, data, root, **overrides)))


def measured_training_peak(config: LoraflowConfig, latent_shape: tuple[int, ...]) -> int:
    """Weights + LoRA + AdamW moments held before a step, plus the allocator's peak during flow_terms + backward
    (routed by the config's TREAD, as `train_lora` routes it) on a batch made inside the step (as a GPU run makes
    its device copies), with the flavour's image condition (i2v, i2i). With `blocks_to_swap` the weights held are
    those the real offload (`enable_offload`) leaves outside diffusers' groups, and the largest group: the one on the
    accelerator while its block computes (on the CPU every group stays where it is, so the allocator cannot tell)."""
    family = get_family(config)
    transformer_config = json.loads((Path(config.pretrained_model_name_or_path) / "transformer" /
                                     "config.json").read_text())
    transformer, params = load_transformer(config, family, model_source(config), CPU)
    enable_offload(transformer, config, family, CPU)
    by_group = {id(hook.group): hook.group for hook in _offload_hooks(transformer)}
    groups = [[t for m in g.modules for t in (*m.parameters(), *m.buffers())] + [*g.parameters, *g.buffers]
              for g in by_group.values()]
    grouped = {id(t) for group in groups for t in group}
    transformer.train()
    optimizer = make_optimizer(config, params)
    autocast = uses_autocast(config, CPU)

    def step() -> None:
        shape = (config.train_batch_size, *latent_shape)
        text = family.collate_text([family.example_text_row(transformer_config, family.max_text_tokens)] *
                                   config.train_batch_size, CPU)
        text.update(image_conditions([family.example_image_condition(transformer_config, latent_shape)] *
                                     config.train_batch_size))
        seeded = torch.Generator().manual_seed(0)
        draws = StepDraws(drop_caption=False, noise=torch.randn(shape, generator=seeded),
                          sigma=torch.full(shape[:1], 0.5), seed=0)
        with routing(transformer, family, config, draws.seed):
            batch = MicroBatch([], torch.randn(shape, generator=seeded), text, draws)
            flow_terms(transformer, family, batch, CPU, autocast).flow.backward()

    step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    moments = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    lora = {id(p) for p in params}
    # A layer under a storage hook (fp32-kept modules stored in bf16 or fp8: `store_kept`) gets its weight anew in
    # each forward (cast to fp32, then back to storage). The profiler sees the new storage allocated but not the old
    # one freed (allocated before it started: torch warns "Memory block of unknown size"), so its running sum holds
    # that storage from the layer's first forward on: counted there, not here as well (counted in both, the 2-block
    # Lite step with bf16-stored kept modules read 12% over the estimate; a lone hooked Linear's step ends the
    # running sum at +its storage, never back at zero)
    recast = {id(p) for m in transformer.modules() if isinstance(getattr(m, "_diffusers_hook", None), HookRegistry)
              and any(isinstance(h, LayerwiseCastingHook) for h in m._diffusers_hook.hooks.values())
              for p in m.parameters(recurse=False)}
    resident = [t for t in (*transformer.parameters(), *transformer.buffers())
                if (id(t) not in grouped or id(t) in lora) and id(t) not in recast]
    frozen = [[t for t in group if not t.requires_grad] for group in groups]  # the LoRA is counted as resident
    largest = max((fake_tensors.tensor_bytes(group) for group in frozen), default=0)
    return fake_tensors.tensor_bytes([*resident, *moments]) + largest + allocator_peak(step)


def assert_close(estimated: int, measured: int) -> None:
    error = (estimated - measured) / measured
    print(f"estimated {estimated} B, measured {measured} B: {error:+.2%}")  # pytest -s shows each comparison
    assert abs(error) <= TOLERANCE, f"estimated {estimated} B, measured {measured} B: {error:+.1%}"


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_step_peak_tiny(tiny_k5: Path, demo_data: Path, tmp_path: Path, checkpointing: bool) -> None:
    config = config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=checkpointing)
    family = get_family(config)
    latent = latent_geometry(tiny_k5, family).shape(*BUCKET)
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    # the claim under test is activations (2.3x the weights with checkpointing at Kandinsky 5 Video's 256 text tokens)
    assert estimate.parts["activations"] > 2 * estimate.parts["weights"]
    assert_close(estimate.peak_bytes, measured_training_peak(config, latent))


@pytest.mark.parametrize("adapter", [{"lora_type": "lycoris", "lycoris_config": {"algo": "lokr", "linear_dim": 4}},
                                     {"use_dora": True}], ids=["lokr", "dora"])
def test_the_estimate_counts_the_adapter_peft_creates(tiny_k5: Path, demo_data: Path, tmp_path: Path,
                                                      adapter: dict) -> None:
    """LoKr's Kronecker factors, DoRA's magnitude vectors: the estimate's adapter and AdamW moments are exactly
    those of the parameters peft leaves trainable on the real tiny model, as training loads it."""
    config = config_for(tiny_k5, demo_data, tmp_path, **adapter)
    family = get_family(config)
    transformer, params = load_transformer(config, family, model_source(config), CPU)
    trainable = {n: p for n, p in transformer.named_parameters() if p.requires_grad}
    assert list(trainable.values()) == params  # what the optimizer trains
    assert any(("lokr_" if "lycoris_config" in adapter else "lora_magnitude_vector") in n for n in trainable)
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config,
                                       latent_geometry(tiny_k5, family).shape(*BUCKET), device_type="cpu")
    assert estimate.parts["lora"] == fake_tensors.tensor_bytes(params)
    assert estimate.parts["optimizer"] == 8 * sum(p.numel() for p in params)  # fp32 AdamW: two moments


def test_checkpointing_lowers_the_estimate(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """The same claim the measurement makes (2.6 MB -> 1.9 MB here): the switch `check` names must lower it."""
    family = get_family(config_for(tiny_k5, demo_data, tmp_path))
    latent = latent_geometry(tiny_k5, family).shape(*BUCKET)
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    plain, checkpointed = (estimates.training_step(config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=c),
                                                   family, transformer_config, latent, device_type="cpu")
                           for c in (False, True))
    assert checkpointed.parts["activations"] < 0.8 * plain.parts["activations"]
    assert checkpointed.tflop > plain.tflop  # the recomputed forward is counted


def test_vae_encode_peak_tiny(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    config = config_for(tiny_k5, demo_data, tmp_path)
    family = get_family(config)
    vae_config = json.loads((tiny_k5 / "vae" / "config.json").read_text())
    estimate = estimates.vae_encode(config, family, vae_config, *BUCKET, device_type="cpu")
    vae = load_component(model_source(config), "vae", torch.float32, "cpu")
    prepare_vae(vae, config, family)
    frames = torch.zeros((1, *BUCKET, 3), dtype=torch.uint8)

    def encode() -> None:
        with torch.no_grad():
            family.vae_encode(vae, frames, config.latent_sampling)

    held = fake_tensors.tensor_bytes([*vae.parameters(), *vae.buffers()])
    assert_close(estimate.peak_bytes, held + allocator_peak(encode))


# Fake clips (no memory). At 33x288x544 Kandinsky 5's VAE encodes 3 framewise chunks of 17, 17 and 9 frames, each with
# tiling (256-pixel tiles, stride 192) in 6 tiles of 4 shapes: 18 encoder calls of 8 inputs; HunyuanVideo 1.5's VAE
# (no framewise chunks) 6 tiles of 4 shapes. At 33x1024x1024 patch conv streams the tiny HunyuanVideo 1.5 encoder's
# down blocks in chunks of 9, 8, 8 and 8 frames (its first level's 32 MiB per frame in the 256 MiB budget).
TILED, STREAMED = (33, 288, 544), (33, 1024, 1024)


@pytest.mark.parametrize(("family_name", "switches", "clip"), [
    ("kandinsky5-video", {"vae_enable_tiling": True}, TILED),
    ("hunyuanvideo-1.5", {"vae_enable_tiling": True, "vae_enable_patch_conv": True}, TILED),
    ("hunyuanvideo-1.5", {"vae_enable_patch_conv": True}, STREAMED),
])
def test_an_encode_traced_once_per_tile_shape_is_the_encode_traced_tile_by_tile(
        family_name: str, switches: dict, clip: tuple[int, int, int], request: pytest.FixtureRequest, demo_data: Path,
        tmp_path: Path) -> None:
    """The latents stage's estimate traces the VAE encoder (and its down blocks, which patch conv streams HunyuanVideo
    1.5's frames through in chunks) once per distinct input and repeats that call's peak and FLOPs for each later
    tile or chunk of the same shape (`fake_tensors.measured_once`): the same activation peak and TFLOP, to the byte
    and the FLOP, as the encode traced with every tile and chunk run."""
    if family_name == "kandinsky5-video":
        model, overrides = request.getfixturevalue("tiny_k5"), switches
    else:
        model = request.getfixturevalue("tiny_hv15")
        overrides = {"model_family": family_name, "model_flavour": "t2v-480p", **switches}
    config = config_for(model, demo_data, tmp_path, **overrides)
    family = get_family(config)
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    estimate = estimates.vae_encode(config, family, vae_config, *clip)

    mode = estimates.transformer.estimate_mode()
    vae = fake_tensors.fake_model(fake_tensors.meta_model(vae_config, torch.float32), mode)
    prepare_vae(vae, config, family)
    inputs = []  # each encoder's and down block's
    for module in (vae.encoder, *vae.encoder.down_blocks):
        module.register_forward_pre_hook(lambda m, args: inputs.append((id(m), tuple(args[0].shape))))

    def encode() -> None:
        with torch.no_grad():
            family.vae_encode(vae, torch.zeros((1, *clip, 3), dtype=torch.uint8), config.latent_sampling)

    activations, tflop, *_ = fake_tensors.measured_step(encode, mode, vae)
    assert len(inputs) > len(set(inputs))  # tiles or chunks of a shape repeat: what the estimate runs once
    assert (estimate.parts["activations"], estimate.tflop) == (activations, tflop)


def test_switch_rows_sharing_the_configured_steps_trace_are_the_rows_traced_alone(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check's lora switch rows reuse the configured step's trace where the fake model computes the same step
    (`stages.step_key`: the optimizer, group offload and fp8 storage change only what is added around it): each row so
    computed is the row traced on its own."""
    from itertools import count

    from loraflow.estimates import stages

    config = config_for(tiny_k5, demo_data, tmp_path, base_model_precision="bf16", gradient_checkpointing=True)
    family = get_family(config)
    configs = estimates.component_configs({c: tiny_k5 / c for c in ("transformer", "vae")})
    monkeypatch.setattr(stages, "_TRACED_STEPS", {})
    shared = estimates.switches(config, family, configs, BUCKET, "lora")
    assert len(stages._TRACED_STEPS) < len(shared)  # rows shared a trace
    keys = count()
    monkeypatch.setattr(stages, "step_key", lambda *_: next(keys))  # every row traced anew
    assert shared == estimates.switches(config, family, configs, BUCKET, "lora")


def test_text_encoder_rows_from_remembered_sizes_are_the_rows_built_anew(
        tiny_k5: Path, demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`text_encoders` remembers each encoder's bytes per config and precision (`stages._encoder_bytes`): a check's
    text_embeds switch rows (bf16, int8, offload during startup, all of them) are the rows with every meta model built
    anew. Seen failing with the sizes remembered per config alone (the int8 row 366 kB, the first size asked, for
    310 kB)."""
    from loraflow.estimates import stages

    config = config_for(tiny_k5, demo_data, tmp_path)
    family = get_family(config)
    configs = estimates.component_configs({c: tiny_k5 / c for c in ("transformer", "vae", *family.text_components)})
    remembered = estimates.switches(config, family, configs, BUCKET, "text_embeds")
    monkeypatch.setattr(stages, "_encoder_bytes", stages._encoder_bytes.__wrapped__)  # every size built anew
    assert remembered == estimates.switches(config, family, configs, BUCKET, "text_embeds")
    peaks = [row.peak_bytes for _, row in remembered]
    assert len(set(peaks)) == len(peaks) == 4  # each switch changes the sizes


@pytest.mark.parametrize("family_name, flavour, settings", [
    ("kandinsky5-video", "t2v-lite-sft-5s", {"gradient_checkpointing_interval": 2}),
    ("hunyuanvideo-1.5", "i2v-480p", {"base_model_precision": "fp8-layerwise", "fp32_modules_storage": "bf16"}),
])
def test_a_step_counted_in_place_is_the_step_traced_without_activation_offload(
        family_name: str, flavour: str, settings: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointed step is traced once, with activation offload (`stages.traced_step`), and the step without it is
    that trace counted in place (each copy between host and device the tensor it copies, held as long as any copy
    is): on two released transformers at 3 blocks (every 2nd checkpointed; the image stream's inputs), its device
    and host peaks and TFLOP are those of the step traced with plain checkpointing, to the byte. Seen failing with a
    host copy not holding the device tensor it copies (in-place peak 2.2 MB short on Kandinsky 5 Lite, 23 MB on
    HunyuanVideo 1.5, and host memory left in), and with a copy back to the device counted anew (1.1 and 8.3 MB
    over)."""
    from loraflow.config import parse_config
    from loraflow.estimates import stages
    from loraflow.pipelines.released import released_config
    from loraflow.stages.clips.buckets import vae_geometry

    config = parse_config({"model_family": family_name, "model_flavour": flavour, "pretrained_model_name_or_path": "m",
                           "datasets": [{"id": "d", "instance_data_dir": "x"}], "gradient_checkpointing": True,
                           **settings})
    family = get_family(config)
    transformer = {**family.flavour.configured(released_config(flavour, "transformer")), family.tread_layout.depth: 3}
    latent = vae_geometry(released_config(flavour, "vae"), family).shape(9, 64, 64)
    offloaded = stages.traced_step(config, family, transformer, latent, "cuda", None)
    enable = stages.enable_checkpointing
    monkeypatch.setattr(stages, "enable_checkpointing", lambda model, _, host: enable(model, config, host))
    plain = stages.traced_step(config, family, transformer, latent, "cuda", None)  # the config's: no offload
    assert plain.host == 0 and offloaded.host > 0 and offloaded.peak != plain.peak  # the trace offloads
    assert (offloaded.peak_in_place, offloaded.host_in_place, offloaded.tflop) == (plain.peak, 0, plain.tflop)


@pytest.fixture(scope="module")
def lite_two_blocks(tiny_k5: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Kandinsky 5 Video Lite's released transformer config (loraflow/pipelines/released/) with 2 visual blocks of its
    32, random weights written by save_pretrained, in a copy of the tiny checkpoint (its VAE and scheduler)."""
    from diffusers import Kandinsky5Transformer3DModel

    from loraflow.pipelines.released import released_config

    root = tmp_path_factory.mktemp("lite") / "k5-lite-2-blocks"
    shutil.copytree(tiny_k5, root)
    shutil.rmtree(root / "transformer")
    lite = released_config("t2v-lite-sft-5s", "transformer")
    model = Kandinsky5Transformer3DModel.from_config({**lite, "num_visual_blocks": 2}).to(torch.bfloat16)
    model.save_pretrained(root / "transformer")
    return root


def test_training_step_peak_released_dims(lite_two_blocks: Path, demo_data: Path, tmp_path: Path) -> None:
    """A model of a few hundred MB (bf16) at released width: 1792-wide blocks, 3584-wide text, 512 text tokens."""
    config = config_for(lite_two_blocks, demo_data, tmp_path, base_model_precision="bf16",
                        gradient_checkpointing=True)
    family = get_family(config)
    latent = latent_geometry(lite_two_blocks, family).shape(*BUCKET)
    transformer_config = json.loads((lite_two_blocks / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    assert estimate.parts["weights"] > 200 * 2**20
    assert_close(estimate.peak_bytes, measured_training_peak(config, latent))


def test_block_swap_estimate_counts_what_stays_resident(lite_two_blocks: Path, demo_data: Path, tmp_path: Path) -> None:
    """`blocks_to_swap` 2 of 2 released-width blocks (a few hundred MB of bf16 weights: most of the peak): the
    estimate's resident weights are what the real offload (`enable_offload`) leaves outside diffusers' groups, plus
    the group computing, and the whole within 10% of the measured peak. (Counting both swapped blocks as resident, or
    neither, is 15-30% of the peak.)"""
    swap = 2
    config = config_for(lite_two_blocks, demo_data, tmp_path, base_model_precision="bf16",
                        gradient_checkpointing=True, blocks_to_swap=swap)
    family = get_family(config)
    latent = latent_geometry(lite_two_blocks, family).shape(*BUCKET)
    transformer_config = json.loads((lite_two_blocks / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    assert_close(estimate.peak_bytes, measured_training_peak(config, latent))


def test_validation_of_an_image_family_decodes_with_its_2d_vae() -> None:
    """Kandinsky 5 Image renders through the Flux VAE, a 2D one: the estimate decodes the latent as its pipeline
    does, (B, C, h, w), at the released configs (a small render: the fake step costs seconds)."""
    from loraflow.config import parse_config
    from loraflow.pipelines.released import released_config

    config = parse_config({"model_family": "kandinsky5-image", "pretrained_model_name_or_path": "org/model",
                           "validation_resolution": "64x64",
                           "datasets": [{"id": "i", "dataset_type": "image", "instance_data_dir": "images"}]})
    configs = {c: released_config(config.flavour.name, c) for c in ("transformer", "vae")}
    (stage,) = estimates.estimate(config, get_family(config), configs, (1, 64, 64), stages=("validation",))
    vae_weights = estimates.weights_bytes(fake_tensors.meta_model(configs["vae"], torch.float32))
    assert stage.parts["weights"] > vae_weights > 0 and stage.parts["activations"] > 0


def test_group_offload_of_one_byte_weights_offloads_one_byte_blocks(tiny_k5: Path, demo_data: Path,
                                                                    tmp_path: Path) -> None:
    """fp8-layerwise stores each block's matrices in 1 byte: offloading those blocks takes their 1-byte bytes off
    the accelerator, never the bf16 bytes the fake step computes with (that went below zero for K5 Image's guide:
    int8 + group offload + checkpointing, -2.06 GiB)."""
    family = get_family(config_for(tiny_k5, demo_data, tmp_path))
    latent = latent_geometry(tiny_k5, family).shape(*BUCKET)
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    resident, offloaded = (estimates.training_step(
        config_for(tiny_k5, demo_data, tmp_path, base_model_precision="fp8-layerwise", enable_group_offload=o),
        family, transformer_config, latent, device_type="cpu").parts["weights"] for o in (False, True))
    # as training stores it: fp8 blocks, the fp32-kept modules (time embeddings, modulation) in bf16 (issue 43's
    # `fp32_modules_storage` default); without an adapter every tensor is a weight
    stored = estimates.stored_model(transformer_config, "fp8-layerwise", "bf16")
    assert estimates.weights_bytes(stored) == fake_tensors.tensor_bytes([*stored.parameters(), *stored.buffers()])
    blocks = [estimates.weights_bytes(b) for b in getattr(stored, family.tread_layout.blocks)]
    assert resident - offloaded == sum(blocks) - max(blocks) > 0  # one group of one block stays


@pytest.fixture(scope="module")
def tiny_hv15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.tiny import build_tiny

    return build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("models") / "hunyuanvideo-1.5")


# 3,264 video tokens (and 1,985 text and image ones): activations 48% of the peak beside the tiny HV1.5's 17 MB
# weights. At 33x128x192 (864 video tokens) they were 3x the weights before issue 43's key mask
# (pipelines/hunyuanvideo15/attention.py) took the (L, L) attention mask out of every block, and 0.8x after it
HV15_BUCKET = (65, 192, 256)


def test_training_step_peak_hv15(tiny_hv15: Path, demo_data: Path, tmp_path: Path) -> None:
    """HunyuanVideo 1.5's forward asks values (all-zero image tokens, which text tokens are valid), which
    `known_values` answers from the step's own batch: its estimate is a number, and the allocator's."""
    config = config_for(tiny_hv15, demo_data, tmp_path, model_family="hunyuanvideo-1.5", model_flavour="t2v-480p",
                        gradient_checkpointing=True)
    family = get_family(config)
    latent = latent_geometry(tiny_hv15, family).shape(*HV15_BUCKET)
    transformer_config = json.loads((tiny_hv15 / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    assert estimate.parts["activations"] > 0.4 * estimate.peak_bytes  # 10% of the peak: under 25% of activations
    assert_close(estimate.peak_bytes, measured_training_peak(config, latent))


TREAD = {"routes": [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": -1}]}


def test_training_step_peak_tread(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """TREAD routes half the tokens past the tiny model's blocks: its estimate is the routed step's (smaller than the
    plain one's, activations and FLOPs), and the allocator's. (With checkpointing too, -3.7% when measured, not kept
    for the suite's time; there the routing's gathers cost the tiny model more than its few saved inputs shrink.)"""
    config = config_for(tiny_k5, demo_data, tmp_path, tread_config=TREAD)
    family = get_family(config)
    latent = latent_geometry(tiny_k5, family).shape(*BUCKET)
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    routed = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    plain = estimates.training_step(config.model_copy(update={"tread_config": None}), family, transformer_config,
                                    latent, device_type="cpu")
    assert routed.tflop < 0.9 * plain.tflop and routed.parts["activations"] < 0.9 * plain.parts["activations"]
    assert_close(routed.peak_bytes, measured_training_peak(config, latent))


def test_training_step_peak_hv15_i2v(tiny_hv15: Path, demo_data: Path, tmp_path: Path) -> None:
    """HunyuanVideo 1.5 i2v: the first frame's latent in the condition channels and SigLIP's tokens in the image
    stream (ones: an all-zero stream is dropped) are in the fake batch, as the latents stage caches them."""
    config = config_for(tiny_hv15, demo_data, tmp_path, model_family="hunyuanvideo-1.5", model_flavour="i2v-480p",
                        gradient_checkpointing=True, validation_resolution="64x48")  # its size bucket
    family = get_family(config)
    latent = latent_geometry(tiny_hv15, family).shape(*HV15_BUCKET)
    transformer_config = json.loads((tiny_hv15 / "transformer" / "config.json").read_text())
    estimate = estimates.training_step(config, family, transformer_config, latent, device_type="cpu")
    assert estimate.parts and estimate.tflop > 0, estimate.note
    assert_close(estimate.peak_bytes, measured_training_peak(config, latent))


def test_the_render_plan_is_the_least_added_that_fits_the_card() -> None:
    """`render_plan` on phases of round sizes (GiB): transformer 10 (8 blocks of 1), VAE 1, one denoise call 4, the
    decode 30 whole and 6 tiled. With a card the transformer and the VAE always take turns on it (parked: never on it
    together); each swapped block but the one computing leaves it."""
    from loraflow.config import parse_config
    from loraflow.pipelines.render_memory import RenderPlan

    phases = estimates.RenderPhases(transformer=10 * GIB, blocks=[GIB] * 8, lora=0, vae=GIB, denoise=4 * GIB,
                                    decode=30 * GIB, decode_tiled=6 * GIB, tflop=0.0)
    config = parse_config({"model_family": "kandinsky5-video", "pretrained_model_name_or_path": "m",
                           "base_model_precision": "bf16", "datasets": [{"id": "d", "instance_data_dir": "x"}]})

    def card(usable_gib: float) -> float:  # the card whose usable share is this
        return (usable_gib * GIB + estimates.CUDA_CONTEXT) / estimates.FIT_SHARE / GIB

    asked = RenderPlan(precision="bf16", kept="bf16")
    assert estimates.render_plan(config, phases, None) == asked  # no card: what the config asks
    parked = RenderPlan(precision="bf16", kept="bf16", park=True)
    assert estimates.render_plan(config, phases, card(45)) == parked  # 10 + 4 and 1 + 30 fit
    assert estimates.render_plan(config, phases, card(31)) == parked  # the decode, 1 + 30, is the peak
    # denoise 10 + 4, decode 1 + 6: parked and tiled, nothing swapped
    assert estimates.render_plan(config, phases, card(16)) == RenderPlan("bf16", "bf16", vae_tiling=True, park=True)
    # denoise fits at 10 resident - (5 - 1) swapped + 4: five blocks swapped
    assert estimates.render_plan(config, phases, card(10)) == RenderPlan("bf16", "bf16", 5, vae_tiling=True,
                                                                       park=True)
    assert estimates.render_plan(config, phases, card(10)).describe() == (
        "transformer bf16, 5 blocks swapped, VAE tiled, transformer and VAE take turns on the GPU")
    tiled = config.model_copy(update={"vae_enable_tiling": True})
    assert estimates.render_plan(tiled, phases, card(45)) == RenderPlan("bf16", "bf16", vae_tiling=True, park=True)
    none_fits = estimates.render_plan(config, phases, card(1))
    assert none_fits.offload_all and none_fits.park and none_fits.vae_tiling  # the least memory there is
    # the denoise: the 2 outside the blocks, the block computing and the next one (prefetched on a CUDA stream), 4
    assert phases.estimate(none_fits).peak_bytes == 8 * GIB


def test_fit_marks_keep_a_margin() -> None:
    """✓ under 90% of the card with 0.5 GiB of CUDA context, tight up to all of it, ✗ over."""
    def stage(gib: float) -> estimates.StageEstimate:
        return estimates.StageEstimate("lora", {"weights": int(gib * GIB)})

    assert [stage(g).mark(24) for g in (20.5, 21.2, 23.4, 23.6)] == ["✓", "tight", "tight", "✗"]
    assert stage(20.5).fits(24) and not stage(21.2).fits(24)


@pytest.mark.parametrize("family_name, flavour, settings", [
    ("kandinsky5-video", "t2v-lite-sft-5s", {"gradient_checkpointing": True,
                                             "gradient_checkpointing_cpu_offload": True}),
    ("hunyuanvideo-1.5", "i2v-480p", {"base_model_precision": "fp8-layerwise", "fp32_modules_storage": "bf16"}),
    ("kandinsky6", "lite-distill-i2v", {"gradient_checkpointing": True}),  # the tail frame, the π-Flow head
])
def test_a_step_traced_shallow_and_extended_is_the_step_traced_at_its_depth(family_name: str, flavour: str,
                                                                            settings: dict) -> None:
    """`training_step` and a render's denoise call (`render_phases`) trace two shallow copies of the transformer
    (`estimates.transformer.SHALLOW`) and extend them to its depth: on each video family's released config at 6 blocks,
    the same activation and host bytes (to the byte), the same TFLOP (to float rounding) and the same weights as the
    step traced at 6 blocks. Seen failing with the extension off by one block (`depth - SHALLOW[1]`): one block's 1.8 MB
    short on Kandinsky 5 Lite."""
    from loraflow.config import parse_config
    from loraflow.estimates.transformer import SHALLOW
    from loraflow.pipelines.released import released_config
    from loraflow.stages.clips.buckets import vae_geometry

    config = parse_config({"model_family": family_name, "model_flavour": flavour, "pretrained_model_name_or_path": "m",
                           "datasets": [{"id": "d", "instance_data_dir": "x"}], **settings})
    family = get_family(config)
    key = family.tread_layout.depth
    transformer = {**family.flavour.configured(released_config(flavour, "transformer")), key: SHALLOW[-1] + 2}
    latent = vae_geometry(released_config(flavour, "vae"), family).shape(9, 64, 64)
    extended = estimates.training_step(config, family, transformer, latent, "cuda")
    traced = estimates.training_step(config, family, transformer, latent, "cuda", extend=False)
    assert extended.parts == traced.parts and extended.host == traced.host
    assert extended.tflop == pytest.approx(traced.tflop, rel=1e-12)
    assert (extended.host > 0) == bool(settings.get("gradient_checkpointing_cpu_offload"))
    configs = {"transformer": transformer, "vae": released_config(flavour, "vae")}
    render, render_traced = (estimates.render_phases(config, family, configs, latent, "cuda", extend=extend)
                             for extend in (True, False))
    assert render.denoise == render_traced.denoise and render.transformer == render_traced.transformer
    assert render.tflop == pytest.approx(render_traced.tflop, rel=1e-12) and render.lora == render_traced.lora
