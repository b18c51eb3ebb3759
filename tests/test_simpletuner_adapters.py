"""`loraflow import-simpletuner` carries issue 32's adapter options (LyCORIS, DoRA, init_lora, EMA) under SimpleTuner's
names, and names each LyCORIS field peft cannot take, with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraflow.config import ConfigError, LoraflowConfig, parse_config
from loraflow.simpletuner import import_simpletuner
from tests.factory import K5_IMAGE_BACKEND

# The Kandinsky 5 Image quickstart's LoKr file (SimpleTuner documentation/quickstart), FeedForward added
QUICKSTART_LOKR = {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000, "linear_alpha": 1, "factor": 16,
                   "apply_preset": {"target_module": ["Attention", "FeedForward"],
                                    "module_algo_map": {"Attention": {"factor": 16}}}}


def test_adapter_options_import_under_simpletuners_names(tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "lycoris_config.json").write_text(json.dumps({**QUICKSTART_LOKR, "use_scalar": True}))
    init = tmp_path / "start.safetensors"
    save_file({"x": torch.zeros(1)}, init)
    guide = {"model_family": "kandinsky5-image", "lora_type": "lycoris", "lycoris_config": "config/lycoris_config.json",
             "init_lora": str(init), "use_ema": True, "ema_decay": 0.999, "ema_device": "accelerator",
             "ema_update_interval": 4, "ema_validation": "ema_only", "ema_cpu_only": True}
    imported = import_simpletuner(guide, K5_IMAGE_BACKEND, base_dir=tmp_path / "config")
    carried = ("lora_type", "init_lora", "use_ema", "ema_decay", "ema_device", "ema_update_interval", "ema_validation")
    assert {k: imported.config[k] for k in carried} == {k: guide[k] for k in carried}
    assert imported.config["lycoris_config"] == {"algo": "lokr", "multiplier": 1.0, "linear_dim": 10000,
                                                 "linear_alpha": 1, "factor": 16}
    assert imported.config["lora_include_ffn"] is True  # apply_preset's FeedForward
    assert [(key, why.split(":")[0]) for key, _, why in imported.unmapped] == [
        ("lycoris_config.apply_preset", "loraflow adapts the family's attention linears (plus the feed-forward with "
                                        "lora_include_ffn)"),
        ("lycoris_config.use_scalar", "peft's LoKr/LoHa have no trainable scalar"),
        ("ema_cpu_only", "the EMA is updated where ema_device keeps it")]
    config = LoraflowConfig.model_validate({**imported.config, "pretrained_model_name_or_path": "m"})
    assert (config.lycoris_config.algo, config.lycoris_config.factor, config.ema_decay) == ("lokr", 16, 0.999)
    dora = import_simpletuner({"model_family": "kandinsky5-image", "use_dora": True}, K5_IMAGE_BACKEND)
    assert dora.config["use_dora"] is True and not dora.unmapped


@pytest.mark.parametrize(("settings", "message"), [
    ({"lora_type": "lycoris"}, "`lora_type: lycoris` and `lycoris_config` go together"),
    ({"lora_type": "lycoris", "lycoris_config": {"algo": "lokr", "linear_dim": 4, "full_matrix": True}},
     "lycoris_config `full_matrix` is not supported: peft keeps LoKr's w2 whole"),
    ({"use_dora": True, "lora_format": "comfyui"}, "ComfyUI's weight_decompose normalises"),
    ({"init_lora": "missing.safetensors"}, "`init_lora` 'missing.safetensors' is not a .safetensors file"),
])
def test_adapter_options_that_cannot_run_are_named(settings: dict, message: str) -> None:
    base = {"model_family": "kandinsky5-image", "pretrained_model_name_or_path": "m",
            "datasets": [{"id": "i", "dataset_type": "image", "instance_data_dir": "d"}]}
    with pytest.raises(ConfigError, match=message):
        parse_config({**base, **settings})
