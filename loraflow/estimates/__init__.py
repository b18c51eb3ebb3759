"""Peak memory and FLOPs of each stage, before any model loads: what `loraflow check` prints.

Nothing here reads weights. A model is built from its config.json on the meta device (`fake_model`; the fake-tensor
machinery and its counter are in `fake_tensors.py`), then every tensor it holds is replaced by a FakeTensor of the
same shape, dtype and device: ops on fake tensors compute shapes only, so the real code (the family's `velocity`, the
flow-matching loss, autograd, diffusers' gradient checkpointing) runs at released size in seconds and allocates
nothing. Each number is then computed so:

- weights, LoRA: the bytes of the fake model's own tensors, in the configured precision (`_keep_in_fp32_modules`
  as `fp32_modules_storage` stores them: fp32 as from_pretrained keeps them, bf16 or fp8; fp8-layerwise stores the
  layers diffusers casts in 1 byte); group offloading keeps only the non-block modules and the groups on the
  accelerator (one group, two with streams: the next is prefetched); `blocks_to_swap` N takes the last N blocks off
  but the one computing (`offloaded`).
- LoRA: every parameter the configured adapter trains, built by training's own `add_adapter` (LoRA, DoRA's
  magnitude vectors, LoKr, LoHa: what peft leaves requiring grad, not a name prefix).
- optimizer: AdamW's two moments per LoRA parameter, fp32 (8 bytes per parameter) or bf16 with adamw_bf16 (4).
- activations: the peak of the bytes alive during one fake forward + backward of `training.step.flow_terms` (LoRA
  gradients and the batch's device copies included), counted by `StepCounter` from the storages every op
  returns. With gradient checkpointing diffusers' own checkpointing runs, so the saved block inputs and one
  block's recompute are what is counted. Activation offload (`gradient_checkpointing_cpu_offload`) runs too,
  holding its copies of the block inputs on the meta device: the counter counts those as host memory
  (`StageEstimate.host`, the stage's "(host)" row), not in the accelerator's peak; the copies back for each
  recompute are counted on the accelerator. The step without offload is the same trace counted in place (each
  copy the tensor it copies, `StepCounter`): a check's offload row and its configured step share one trace. (For a
  CPU device nothing moves: a CPU tensor's copy to the CPU is itself, in a run as in the fake step.) Attention
  keeps no N x N matrix (flash kernels: output and log-sum-exp); what kernels allocate inside themselves is added
  by formula where it is large: `attention_workspace` (the backward's fp32 dQ accumulator, and the CPU kernel's
  tiles) and `conv3d_columns` (the CPU 3D convolution's column buffer; none on CUDA).
- TFLOP: torch's flop-counter formulas over the same fake step (matmuls and convolutions; backward = 2x forward;
  a checkpointed block's forward is counted again when it is recomputed). The CPU flash-attention kernel that SDPA
  takes on fake CPU tensors has no formula in the counter: `training.flops.attention_flops` gives it the SDPA one,
  4 * B * heads * N_q * N_kv * d forward (QK^T and PV, 2 flops per multiply-add) and twice that backward.
  NABLA checkpoints (flex attention at their sparsity) run dense attention plus NABLA's measured block masks
  (`attention_stand_in`); their rows say so.
- TREAD: the fake step is routed as `train_lora` routes it (`training.step.routing`), so the tokens a route takes out
  skip its blocks in the fake step itself: the activations those blocks keep and their FLOPs (attention included)
  shrink with the selection ratio, and the routing's gathers and scatters are counted.
- i2v and i2i: the fake batch carries what the latents stage caches (`example_image_condition`: the conditioning
  latent, HunyuanVideo 1.5's SigLIP tokens), and the family's `velocity` builds the condition channels (latent,
  mask) and the image stream from it, so they are counted as any other tensor. The latents stage's image encoder
  (SigLIP) is left out of its row.
- validation: one render as the validation stage runs it (`render_phases`, `render_plan`): the transformer in the
  training precision, one no-grad denoise call and the VAE decode (in the transformer's dtype) of its latent,
  whole and tiled with diffusers' tiling (each tile's decoder run once per tile shape: `fake_tensors.measured_once`);
  then the plan for the card (`gpu_memory_gb`, else the GPU present): the transformer and the VAE take turns on the
  card (parked), plus the least of tiling, blocks swapped, every block streamed that fits it. Without a card, what the
  config asks. The pipeline's own small tensors (latents, the two guidance predictions) are left out.

The fake step runs on the CPU: with bf16 autocast where a CUDA run uses it (`training.step.uses_autocast`), so the
activation dtypes are those of a GPU run. What is left out is said where it is: allocator rounding and
fragmentation (CUDA rounds to 512 bytes), CUDA/cuDNN workspaces and the CUDA context (about 0.5 GiB per process):
a stage fits a card when its peak and CUDA_CONTEXT are under FIT_SHARE (90%) of it, which keeps room for them.

The modules: `fit.py` (`StageEstimate`, the card and its margin), `inputs.py` (the components' configs, the bucket),
`transformer.py` (the fake transformer both the step and a render run, its stored weights, NABLA's stand-in),
`stages.py` (the training step, the VAE encode, the text encoders), `render.py` (a render's phases and its plan),
`table.py` (check's table and the switches), `remembered.py` (a check of an unchanged config reads its last
estimate) and `fake_tensors.py` (fake models and the counter, which knows no family). The names callers use are
imported here: `from loraflow import estimates; estimates.training_step(...)`.
"""

from loraflow.estimates.fit import (
    CARDS_GB,
    CUDA_CONTEXT,
    FIT_MARKS,
    FIT_SHARE,
    GIB,
    StageEstimate,
    card_gb,
    usable_bytes,
)
from loraflow.estimates.inputs import component_configs, configured_buckets, largest_bucket, released_configs
from loraflow.estimates.remembered import code_version, estimates_cache, remembered
from loraflow.estimates.render import RenderPhases, render_phases, render_plan, validation, validation_plan
from loraflow.estimates.stages import text_encoders, training_step, vae_encode
from loraflow.estimates.table import STAGES, SWITCHES, estimate, estimate_rows, stage_estimate, swap_to_fit, switches
from loraflow.estimates.transformer import nabla_masks, offloaded, stored_model, weights_bytes

__all__ = [
    "CARDS_GB", "CUDA_CONTEXT", "FIT_MARKS", "FIT_SHARE", "GIB", "STAGES", "SWITCHES", "RenderPhases", "StageEstimate",
    "card_gb", "code_version", "component_configs", "configured_buckets", "estimate", "estimate_rows",
    "estimates_cache", "largest_bucket", "nabla_masks", "offloaded", "released_configs", "remembered",
    "render_phases", "render_plan", "stage_estimate", "stored_model", "swap_to_fit", "switches", "text_encoders",
    "training_step", "usable_bytes", "vae_encode", "validation", "validation_plan", "weights_bytes",
]
