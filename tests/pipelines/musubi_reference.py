"""musubi-tuner's LoRA module names, written down from its code (kohya-ss/musubi-tuner at commit
30c658c4f4b0bf05038b3346eff9670259b10fc7, paths under src/musubi_tuner/), independently of loraflow's tables.

The naming rule (networks/lora.py `LoRANetwork.create_modules`): `lora_unet_` + the module's path in musubi's model,
every `.` as `_`; its tensors `.lora_down.weight` (r, in), `.lora_up.weight` (out, r), `.alpha`. The Kandinsky 5
loader (kandinsky5_generate_video.py -> networks/lora_kandinsky.py) takes the Linear layers inside
`TransformerEncoderBlock` / `TransformerDecoderBlock`; the HunyuanVideo 1.5 loader (utils/lora_utils.py
`load_safetensors_with_lora_and_fp8`) any model weight `<path>.weight`.

The models' Linear layers (out, in), from the same code; the modulation layers (K5 `text_modulation.out_layer` /
`visual_modulation.out_layer`, HV1.5 `img_mod.linear` / `txt_mod.linear`) are left out: loraflow adapts none of them
(musubi's own Kandinsky 5 training excludes `.*modulation.*`, networks/lora_kandinsky.py).
- Kandinsky 5, kandinsky5/models/dit.py `DiffusionTransformer3D`: `text_transformer_blocks` (num_text_blocks x
  `TransformerEncoderBlock`: self_attention, feed_forward) and `visual_transformer_blocks` (num_visual_blocks x
  `TransformerDecoderBlock`: self_attention, cross_attention, feed_forward); kandinsky5/models/nn.py: each
  attention's to_query / to_key / to_value / out_layer (model_dim, model_dim), `FeedForward.in_layer`
  (ff_dim, model_dim) and `.out_layer` (model_dim, ff_dim). The config keys are the original checkpoint's, which
  diffusers' config keeps.
- HunyuanVideo 1.5, hunyuan_video_1_5/hunyuan_video_1_5_models.py `HunyuanVideo_1_5_DiffusionTransformer`:
  `double_blocks` (mm_double_blocks_depth = 54 = diffusers' num_layers x `MMDoubleStreamBlock`), hidden_size 2048
  (= heads x head_dim), mlp_width_ratio 4; hunyuan_video_1_5_modules.py `MMDoubleStreamBlock`: img_attn_q / _k / _v /
  _proj and txt_attn_* (hidden, hidden), `img_mlp` / `txt_mlp` = `MLP`: fc1 (mlp, hidden), fc2 (hidden, mlp).
And to put a diffusers checkpoint's weights under musubi's names (the tiny models' base weights, to merge as musubi
merges): diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py renames Tencent's img_attn_q -> attn.to_q,
img_attn_k -> attn.to_k, img_attn_v -> attn.to_v, txt_attn_q -> attn.add_q_proj (k, v alike), img_attn_proj ->
attn.to_out.0, txt_attn_proj -> attn.to_add_out, img_mlp.fc1 -> ff.net.0.proj, img_mlp.fc2 -> ff.net.2, txt_mlp.fc1 ->
ff_context.net.0.proj, txt_mlp.fc2 -> ff_context.net.2, double_blocks.N -> transformer_blocks.N; Kandinsky 5's names
are kept (diffusers models/transformers/transformer_kandinsky.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

COMMIT = "30c658c4f4b0bf05038b3346eff9670259b10fc7"


class MusubiModule(NamedTuple):
    diffusers: str  # the same linear's path in the diffusers model
    shape: tuple[int, int]  # its weight's (out, in)
    ffn: bool  # a feed-forward layer (loraflow adapts these with lora_include_ffn only)


def kandinsky5_modules(config: Mapping[str, Any]) -> dict[str, MusubiModule]:
    """musubi path -> module, for a Kandinsky 5 transformer config."""
    dim, ff = config["model_dim"], config["ff_dim"]
    modules = {}
    for blocks, count, attentions in (("text_transformer_blocks", config["num_text_blocks"], ("self_attention",)),
                                      ("visual_transformer_blocks", config["num_visual_blocks"],
                                       ("self_attention", "cross_attention"))):
        for i in range(count):
            block = f"{blocks}.{i}."
            for attention in attentions:
                for proj in ("to_query", "to_key", "to_value", "out_layer"):
                    path = f"{block}{attention}.{proj}"
                    modules[path] = MusubiModule(path, (dim, dim), False)
            modules[block + "feed_forward.in_layer"] = MusubiModule(block + "feed_forward.in_layer", (ff, dim), True)
            modules[block + "feed_forward.out_layer"] = MusubiModule(block + "feed_forward.out_layer", (dim, ff), True)
    return modules


HV15_DIFFUSERS = {"img_attn_q": "attn.to_q", "img_attn_k": "attn.to_k", "img_attn_v": "attn.to_v",
                  "txt_attn_q": "attn.add_q_proj", "txt_attn_k": "attn.add_k_proj", "txt_attn_v": "attn.add_v_proj",
                  "img_attn_proj": "attn.to_out.0", "txt_attn_proj": "attn.to_add_out",
                  "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2",
                  "txt_mlp.fc1": "ff_context.net.0.proj", "txt_mlp.fc2": "ff_context.net.2"}


def hunyuanvideo15_modules(config: Mapping[str, Any]) -> dict[str, MusubiModule]:
    """musubi path -> module, for a HunyuanVideo 1.5 transformer config."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(hidden * config["mlp_ratio"])
    shapes = {"fc1": (mlp, hidden), "fc2": (hidden, mlp)}
    modules = {}
    for i in range(config["num_layers"]):
        for musubi, diffusers in HV15_DIFFUSERS.items():
            shape = shapes.get(musubi.rsplit(".", 1)[-1], (hidden, hidden))
            modules[f"double_blocks.{i}.{musubi}"] = MusubiModule(f"transformer_blocks.{i}.{diffusers}", shape,
                                                                  "mlp" in musubi)
    return modules


MODULES = {"kandinsky5-video": kandinsky5_modules, "kandinsky5-image": kandinsky5_modules,
           "hunyuanvideo-1.5": hunyuanvideo15_modules}


def lora_name(path: str) -> str:
    """networks/lora.py: `f"{pfx}.{original_name}".replace(".", "_")`, pfx "lora_unet"."""
    return f"lora_unet.{path}".replace(".", "_")
