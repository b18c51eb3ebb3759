"""The `attention_backend` setting: which kernel a model's attention runs, through diffusers' attention dispatcher
(`ModelMixin.set_attention_backend`, `attention_dispatch.dispatch_attention_fn`), for training and renders alike.

Names are torch's SDPA kernels, as diffusers' native backends run them: `sdpa` (torch chooses per call), `sdpa_flash`
(FlashAttention-2 inside torch; on the CPU torch's own flash kernel), `sdpa_cudnn` (cuDNN's fused attention, CUDA),
`sdpa_efficient` (memory-efficient attention, CUDA), `sdpa_math` (the reference composition of matmuls and softmax),
and `flex` (flex attention: NABLA's block-sparse mask needs it). `auto`: `flex` where the checkpoint attends with
NABLA; on CUDA the first kernel of `CUDA_ORDER` that runs a probe call of the model's head size and dtype on this
card (cuDNN attention and flash first: on Hopper they are the fastest SDPA kernels torch has, FlashAttention-2's
paper and cuDNN 9's release notes; the efficient kernel then; math last); on the CPU `sdpa`.

A kernel that cannot take a call's boolean mask (flash) hands that call to `sdpa` (HunyuanVideo 1.5's key mask
in a batch whose texts differ in length: pipelines/hunyuanvideo15/attention.py). A backend this machine lacks is
refused before the first step, naming those it has. The kernels differ only in the order of their sums, so the
setting is not in the run key (as the GPU a run is on is not).
"""

from __future__ import annotations

from typing import Any

# loraflow's name -> diffusers' AttentionBackendName value
BACKENDS = {"sdpa": "native", "sdpa_flash": "_native_flash", "sdpa_cudnn": "_native_cudnn",
            "sdpa_efficient": "_native_efficient", "sdpa_math": "_native_math", "flex": "flex"}
CUDA_ORDER = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
MASKLESS = frozenset({"_native_flash"})  # diffusers refuses an attn_mask for these


def runs_here(name: str, device: Any, dtype: Any, head_dim: int) -> bool:
    """Whether backend `name` runs one small attention call (B 1, 2 heads, 128 tokens) on `device` in `dtype`: the
    card, the dtype and the head size decide (flash needs fp16/bf16 on CUDA, cuDNN a recent card)."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if name == "flex":
        return True  # flex attention compiles for any device torch supports; NABLA's own checks say more
    if device.type != "cuda" and name in ("sdpa_cudnn", "sdpa_efficient"):
        return False
    q = torch.randn(1, 128, 2, head_dim, device=device, dtype=dtype)  # (B, N, heads, head_dim): diffusers' layout
    try:
        dispatch_attention_fn(q, q, q, backend=BACKENDS[name])
    except (RuntimeError, ValueError):  # "No available kernel", a dtype the kernel lacks
        return False
    return True


def available_backends(device: Any, dtype: Any, head_dim: int) -> list[str]:
    """The backends of BACKENDS that run here."""
    return [name for name in BACKENDS if runs_here(name, device, dtype, head_dim)]


def choose_backend(setting: str, device: Any, dtype: Any, head_dim: int, needs_flex: bool) -> str:
    """`setting` resolved on `device`: `auto` as the module says; another name checked to run here (ValueError
    naming the key and the backends that do)."""
    if needs_flex:
        if setting not in ("auto", "flex"):
            raise ValueError(f"attention_backend: {setting} cannot run this checkpoint's NABLA attention (a "
                             "flex-attention block mask); set attention_backend: auto or flex")
        return "flex"
    if setting == "auto":
        if device.type != "cuda":
            return "sdpa"
        return next(name for name in CUDA_ORDER if name == "sdpa_math" or runs_here(name, device, dtype, head_dim))
    if not runs_here(setting, device, dtype, head_dim):
        have = ", ".join(available_backends(device, dtype, head_dim))
        raise ValueError(f"attention_backend: {setting} does not run on this {device.type} device in {dtype} "
                         f"(head size {head_dim}); available here: {have}, or auto")
    return setting


def set_attention_backend(transformer: Any, name: str) -> None:
    """Every attention processor of `transformer` runs backend `name`, for this model only: diffusers'
    `set_attention_backend` also makes its backend the process-wide default of every other model, which is put
    back. Marks the model with the name (`attention_backend_of`)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if transformer.__dict__.get("_loraflow_attention_backend") == name:
        return
    default = _AttentionBackendRegistry._active_backend
    transformer.set_attention_backend(BACKENDS[name])
    _AttentionBackendRegistry.set_active_backend(default)
    transformer.__dict__["_loraflow_attention_backend"] = name


def attention_backend_of(transformer: Any) -> str:
    """The backend `set_attention_backend` gave the model (`sdpa`: diffusers' default, never set)."""
    return transformer.__dict__.get("_loraflow_attention_backend", "sdpa")


def head_dim_of(transformer: Any) -> int:
    """The head size of the model's first attention module (its query projection's width over its heads)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    for module in transformer.modules():
        if isinstance(module, (Attention, AttentionModuleMixin)) and hasattr(module, "heads"):
            width = getattr(module, "inner_dim", None) or module.to_q.out_features
            return width // module.heads
    return 64


def apply_attention_backend(transformer: Any, setting: str, device: Any, needs_flex: bool) -> str:
    """Resolve `setting` for this model on `device` (a torch.device or its name) and set it; the backend's name."""
    import torch

    device = torch.device(device)
    dtype = next(transformer.parameters()).dtype

    if device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.bfloat16  # the forward runs under bf16 autocast on CUDA (training/step.py `uses_autocast`)
    name = choose_backend(setting, device, dtype, head_dim_of(transformer), needs_flex)
    set_attention_backend(transformer, name)
    return name


def describe_choice(setting: str, needs_flex: bool) -> str:
    """`loraflow check`'s line on the kernel `setting` takes on the card (check runs anywhere: nothing is probed)."""
    if needs_flex:
        return "flex (NABLA's block mask needs it)"
    if setting != "auto":
        return f"{setting} (attention_backend), refused at the first step if the card lacks it"
    return ("auto: on CUDA the first of sdpa_cudnn, sdpa_flash, sdpa_efficient, sdpa_math that runs on the card "
            "(on an H100/H200: sdpa_cudnn, which PyTorch 2.5's release notes measure up to 75% faster than "
            "FlashAttention-2 there); sdpa on the CPU")
