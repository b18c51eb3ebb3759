"""musubi-tuner LoRA files from a peft/diffusers adapter: the file its `--lora_weight` applies as it is.

How musubi-tuner reads a LoRA file (kohya-ss/musubi-tuner at 30c658c4f4b0, src/musubi_tuner/...):
- networks/lora.py `LoRANetwork.create_modules`: a module of the model is `lora_unet_` + its path in *musubi's own
  model* with every `.` as `_` (`lora_name = f"{pfx}.{original_name}".replace(".", "_")`, pfx `lora_unet`), its
  tensors `<lora_name>.lora_down.weight` (r, in), `.lora_up.weight` (out, r) and `.alpha`;
  `LoRAModule.__init__`: scale = alpha / r (alpha = r where it is 0 or absent). `create_network_from_weights`
  creates a module for each lora_name with a `lora_down` in the file and reads `modules_alpha[lora_name]` for it:
  a name musubi's model does not have is created nowhere, silently ("create LoRA for U-Net/DiT: 0 modules").
- Kandinsky 5 (kandinsky5_generate_video.py `--lora_weight`: networks/lora_kandinsky.py
  `create_arch_network_from_weights`, then `merge_to`): the Linear layers inside `TransformerEncoderBlock` /
  `TransformerDecoderBlock` of kandinsky5/models/dit.py `DiffusionTransformer3D`, whose paths are the original
  checkpoint's and diffusers': `text_transformer_blocks.N.self_attention.to_query`, `visual_transformer_blocks.N.
  cross_attention.out_layer`, `.feed_forward.in_layer` (kandinsky5/models/nn.py). musubi has task configs for
  Kandinsky 5 Image (kandinsky5/configs.py `k5-lite-t2i-hd`, `k5-lite-i2i-hd`, the same DiT class) though its
  docs/kandinsky5.md calls Image Lite unsupported.
- HunyuanVideo 1.5 (hv_1_5_generate_video.py `load_dit_model` -> hunyuan_video_1_5/hunyuan_video_1_5_models.py
  `load_hunyuan_video_1_5_model` -> utils/lora_utils.py `load_safetensors_with_lora_and_fp8`): each model weight
  `<path>.weight` takes `lora_unet_<path with _>` (alpha from `.alpha`, else r). musubi's model has Tencent's split
  projections (hunyuan_video_1_5_modules.py `MMDoubleStreamBlock`, `MLP`): `double_blocks.N.img_attn_q` / `_k` /
  `_v` / `_proj`, `txt_attn_*`, `img_mlp.fc1` / `.fc2`, `txt_mlp.*`, which diffusers renames (its
  scripts/convert_hunyuan_video1_5_to_diffusers.py: img_attn_q -> attn.to_q, txt_attn_q -> attn.add_q_proj,
  img_attn_proj -> attn.to_out.0, txt_attn_proj -> attn.to_add_out, img_mlp.fc1 -> ff.net.0.proj, txt_mlp.fc2 ->
  ff_context.net.2; networks/convert_hunyuan_video_1_5_lora_to_comfy.py uses the same musubi names).
- Kandinsky 6: musubi-tuner has no Kandinsky 6 model, so no file (the family's `musubi_names` is empty).

So neither the diffusers file (`transformer.<diffusers path>.lora_A.weight`) nor the ComfyUI one
(`diffusion_model.<ComfyUI path>`) names a musubi module. This file is sd-scripts' layout with musubi's names
(`comfyui.down_up_tensors`, as ComfyUI's), alpha = peft's scale * rank: musubi's alpha / r is peft's scale and the
file applies the trained adapter at `--lora_multiplier 1`. Plain LoRA only: musubi's LoRA network has no DoRA
magnitude, and loraflow writes no musubi LoKr/LoHa layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from loraflow.pipelines.comfyui import ComfyRule, down_up_tensors, save_lora_tensors

MUSUBI_LORA_FILE = "pytorch_lora_weights_musubi.safetensors"
MUSUBI_PREFIX = "lora_unet_"  # networks/lora.py: the DiT's LoRA names' prefix ("lora_unet", then "_")


def musubi_key(module: str) -> str:
    """musubi's LoRA name of a module of its model: `lora_unet_` + the path, `.` as `_`."""
    return MUSUBI_PREFIX + module.replace(".", "_")


def musubi_refusal(rules: Sequence[ComfyRule], use_dora: bool, lycoris: bool) -> str | None:
    """Why no musubi-tuner file can hold this adapter; None where one can."""
    if not rules:
        return "musubi-tuner has no loader for this family"
    if use_dora:
        return "DoRA: musubi-tuner's LoRA network (networks/lora.py) has no magnitude vector"
    if lycoris:
        return "LoKr/LoHa: loraflow writes musubi-tuner's LoRA layout only"
    return None


def to_musubi(state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None,
              rules: Sequence[ComfyRule]) -> dict[str, torch.Tensor]:
    """The musubi tensors: `lora_unet_<musubi path, _>.lora_down.weight` / `.lora_up.weight` / `.alpha`, fp32."""
    if any(rule.parts > 1 for rule in rules):
        raise ValueError("musubi-tuner's models keep every linear loraflow adapts apart: a musubi rule fuses nothing")
    return down_up_tensors(state_dict, adapter_config, rules, musubi_key, "musubi-tuner")


def save_musubi_lora(state_dict: Mapping[str, torch.Tensor], adapter_config: Mapping | None,
                     rules: Sequence[ComfyRule], path: str | Path) -> Path:
    """Write `to_musubi(...)` to `path` (tmp + rename), the LoraConfig in the header for the record."""
    return save_lora_tensors(to_musubi(state_dict, adapter_config, rules), adapter_config, path)
