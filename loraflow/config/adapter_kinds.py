"""SimpleTuner's `lycoris_config` (the LyCORIS JSON it hands `create_lycoris`), as far as peft's LoKr and LoHa
express it.

Read from SimpleTuner's documentation (LYCORIS.md, the Kandinsky 5 quickstarts) and LyCORIS's modules: `algo`
lokr or loha, `linear_dim` (peft `r`), `linear_alpha` (peft `alpha`), `factor` (LoKr's Kronecker factor, peft
`decompose_factor`), `decompose_both`, `rank_dropout`, `module_dropout`, `multiplier` (1 only: it scales the
adapter at load). Every other LyCORIS field is refused, naming it and why. No torch here: config validation runs
without it; training/options/adapters.py builds the peft config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import model_validator

from loraflow.config.config_files import read_json_file
from loraflow.config.run_key import StrictModel, setting

# LyCORIS fields peft cannot express, and why (what to do instead).
REFUSED = {
    "apply_preset": "loraflow adapts the family's attention linears (plus the feed-forward with lora_include_ffn): "
                    "remove apply_preset, set lora_include_ffn for FeedForward, and move a module_algo_map factor "
                    "to the top-level `factor`",
    "preset": "loraflow adapts the family's attention linears (plus the feed-forward with lora_include_ffn)",
    "full_matrix": "peft keeps LoKr's w2 whole when linear_dim >= half its size: use a large linear_dim "
                   "(e.g. 10000) instead",
    "use_scalar": "peft's LoKr/LoHa have no trainable scalar",
    "use_tucker": "the adapted layers are linear: Tucker decomposition applies to convolutions only",
    "use_cp": "the adapted layers are linear: CP decomposition applies to convolutions only",
    "conv_dim": "no convolution is adapted",
    "conv_alpha": "no convolution is adapted",
    "weight_decompose": "peft's LoKr/LoHa have no weight decomposition (DoRA): use lora_type standard with use_dora",
    "dora_wd": "peft's LoKr/LoHa have no weight decomposition (DoRA): use lora_type standard with use_dora",
    "wd_on_out": "peft's LoKr/LoHa have no weight decomposition (DoRA)",
    "bypass_mode": "peft computes the adapter beside the frozen layer already; no other mode",
    "rs_lora": "peft's LoKr/LoHa scale by alpha / rank only",
    "dropout": "peft's LoKr/LoHa drop ranks or whole modules (rank_dropout, module_dropout), not activations",
    "train_norm": "loraflow trains adapters only, never the base model's norm layers",
    "unbalanced_factorization": "peft's LoKr factorizes as LyCORIS does by default only",
}


class LycorisConfig(StrictModel):
    """LyCORIS LoKr or LoHa through peft (`LoKrConfig`, `LoHaConfig`)."""

    algo: Literal["lokr", "loha"] = setting(run_key="always", description="lokr (Kronecker) or loha (Hadamard)")
    linear_dim: int = setting(run_key="always", gt=0, description="rank; LoKr keeps a factor whole (scale 1, as "
                              "LyCORIS) where linear_dim >= half its size")
    linear_alpha: float = setting(1.0, run_key="always", gt=0, description="scale alpha / linear_dim")
    factor: int = setting(-1, run_key="always", description="LoKr's Kronecker factor; -1: as square as possible")
    decompose_both: bool = setting(False, run_key="always", description="LoKr: decompose w1 too")
    rank_dropout: float = setting(0.0, run_key="always", ge=0, lt=1)
    module_dropout: float = setting(0.0, run_key="always", ge=0, lt=1)
    multiplier: float = setting(1.0, run_key="always", description="only 1.0: the weight at which the adapter "
                                "trains (ComfyUI's strength applies it later)")

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in REFUSED:
                    raise ValueError(f"lycoris_config `{key}` is not supported: {REFUSED[key]}")
            if data.get("multiplier", 1.0) != 1.0:
                raise ValueError(f"lycoris_config `multiplier` {data['multiplier']}: only 1.0 trains as LyCORIS "
                                 "does; set the strength where the adapter is loaded (ComfyUI's strength)")
        return data


def adapter_summary(config: Any) -> dict[str, Any]:
    """What trained the adapter, for the `lora` asset's metadata: kind, size, start, EMA (`config`: LoraflowConfig)."""
    lycoris = config.lycoris_config
    kind = {"lokr": "LoKr", "loha": "LoHa"}[lycoris.algo] if lycoris else "DoRA" if config.use_dora else "LoRA"
    size = ({"linear_dim": lycoris.linear_dim, "linear_alpha": lycoris.linear_alpha, "factor": lycoris.factor}
            if lycoris else {"rank": config.lora_rank, "alpha": config.lora_alpha or config.lora_rank})
    ema = {"decay": config.ema_decay, "update_interval": config.ema_update_interval} if config.use_ema else None
    return {"kind": kind, **size, "init_lora": config.init_lora, "ema": ema}


def read_lycoris_config(value: Any) -> Any:
    """A path to SimpleTuner's lycoris_config JSON file, or the mapping itself."""
    if not isinstance(value, (str, Path)):
        return value
    return read_json_file(Path(value), "lycoris_config", "give the LyCORIS JSON file (algo, linear_dim, "
                          "linear_alpha, factor) or an inline mapping")
