"""What the checkpointing switches do (kernels/checkpointing.py); that they change no number is
tests/training/test_train.py::test_memory_features_change_no_number.

Interval: the tiny Kandinsky 5 Video transformer (real from_pretrained, prepared by
`training.model_setup.load_transformer`) counts each block's forward calls over one forward + backward: a checkpointed
block runs twice (the recompute).
Activation offload cannot be seen on the CPU allocator (its copies go from the CPU to the CPU, which is no copy):
the estimate's host memory is checked against the bytes the real blocks are called with, and its accelerator peak
against plain checkpointing's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loraflow import estimates
from loraflow.config import ConfigError, LoraflowConfig
from loraflow.pipelines import get_family
from loraflow.pipelines.sources import model_source
from loraflow.stages.clips.buckets import latent_geometry
from loraflow.training.model_setup import load_transformer
from tests.factory import config_for

CPU = torch.device("cpu")


LATENT, TEXT_TOKENS = (16, 2, 16, 16), 5  # the tiny model's forward in these tests, batch 1


def block_calls(config: LoraflowConfig) -> dict[str, list[list[tuple]]]:
    """The positional arguments of each call of each block, by block list, over one training forward + backward
    (pre-hooks: the recompute stops early, once it has what backward needs, so a forward hook would miss it)."""
    family = get_family(config)
    transformer, _ = load_transformer(config, family, model_source(config), CPU)
    transformer.train()
    calls = {name: [[] for _ in getattr(transformer, name)]
             for name in ("text_transformer_blocks", "visual_transformer_blocks")}
    for name, blocks in calls.items():
        for block, args in zip(getattr(transformer, name), blocks):
            block.register_forward_pre_hook(lambda _, a, args=args: args.append(a))
    transformer_config = json.loads((Path(config.pretrained_model_name_or_path) / "transformer" /
                                     "config.json").read_text())
    text = family.collate_text([family.example_text_row(transformer_config, TEXT_TOKENS)], CPU)
    noisy = torch.randn(1, *LATENT, generator=torch.Generator().manual_seed(0))
    family.velocity(transformer, noisy, torch.tensor([0.5]), text).square().mean().backward()
    return calls


def forward_calls(config: LoraflowConfig) -> list[int]:
    """Forward calls of each visual block over one training forward + backward."""
    return [len(args) for args in block_calls(config)["visual_transformer_blocks"]]


def test_interval_recomputes_every_nth_block_only(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    plain = forward_calls(config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=True))
    assert len(plain) >= 2 and plain == [2] * len(plain)  # every block recomputed
    every_second = forward_calls(config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=True,
                                            gradient_checkpointing_interval=2))
    assert every_second == [2 if i % 2 == 0 else 1 for i in range(len(plain))]


def test_the_estimate_counts_the_interval(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """`loraflow check`'s fake step of the tiny config with 4 visual blocks (fake tensors need no weights; with the
    tiny model's 2, every-2nd-block checkpointing peaks exactly as plain checkpointing does, at one block's
    activations): every-2nd-block keeps blocks 1 and 3's activations, so it holds more than plain checkpointing,
    and recomputes fewer forwards."""
    family = get_family(config_for(tiny_k5, demo_data, tmp_path))
    latent = latent_geometry(tiny_k5, family).shape(17, 64, 96)
    transformer_config = {**json.loads((tiny_k5 / "transformer" / "config.json").read_text()), "num_visual_blocks": 4}

    def step(**switches: object) -> estimates.StageEstimate:
        config = config_for(tiny_k5, demo_data, tmp_path, **switches)
        return estimates.training_step(config, family, transformer_config, latent, device_type="cuda")

    plain = step(gradient_checkpointing=True)
    interval = step(gradient_checkpointing=True, gradient_checkpointing_interval=2)
    assert interval.parts["activations"] > 1.2 * plain.parts["activations"]
    assert interval.tflop < plain.tflop  # the recomputed forwards are counted


def test_the_estimate_holds_offloaded_inputs_in_host_memory(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """Activation offload keeps a host copy of every tensor a checkpointed block is called with (text, time and
    rope too: each block its own), all alive when the forward ends: the estimate's host memory is exactly their
    bytes, summed over the real model's checkpointed blocks (here every 2nd of each list: text block 0, visual block
    0); none of it is in the accelerator's peak. (fp32 without autocast, as the real forward here runs.)"""
    config = config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=True, gradient_checkpointing_interval=2,
                        gradient_checkpointing_cpu_offload=True, mixed_precision="no")
    held = sum(a.numel() * a.element_size() for blocks in block_calls(config).values()
               for i, calls in enumerate(blocks) if i % 2 == 0 for a in calls[0] if torch.is_tensor(a))
    transformer_config = json.loads((tiny_k5 / "transformer" / "config.json").read_text())
    offload = estimates.training_step(config, get_family(config), transformer_config, LATENT, device_type="cuda",
                                      text_tokens=TEXT_TOKENS)
    assert offload.host == held > 0


def test_offload_lowers_the_estimated_peak(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    """At 4 visual blocks and 480 visual tokens, where the blocks' saved inputs weigh (fake tensors need no
    weights): with the inputs on the host the accelerator holds less than with plain checkpointing (activations
    1.97 -> 1.82 MB here, the recompute's copies back counted), and the same TFLOP (a copy is no flop)."""
    family = get_family(config_for(tiny_k5, demo_data, tmp_path))
    latent = latent_geometry(tiny_k5, family).shape(17, 128, 192)
    transformer_config = {**json.loads((tiny_k5 / "transformer" / "config.json").read_text()), "num_visual_blocks": 4}
    plain, offload = (estimates.training_step(
        config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing=True, gradient_checkpointing_cpu_offload=o),
        family, transformer_config, latent, device_type="cuda") for o in (False, True))
    assert plain.host == 0 and offload.host > 0
    assert offload.parts["activations"] < 0.95 * plain.parts["activations"] and offload.tflop == plain.tflop


def test_switches_need_checkpointing_on(tiny_k5: Path, demo_data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="`gradient_checkpointing_cpu_offload` changes how gradient checkpointing "
                                          "runs, which is off: set gradient_checkpointing: true"):
        config_for(tiny_k5, demo_data, tmp_path, gradient_checkpointing_cpu_offload=True)
