"""loraflow: a resumable Dagster DAG that fine-tunes LoRA adapters for Kandinsky 5 and HunyuanVideo 1.5."""

import logging

# diffusers imports torchao (text_encoder_1_precision int8-torchao) whenever it is installed. On a machine without
# CUDA, torchao then logs that its CUDA kernels did not load, diffusers that some torchao tensor types it could
# unpickle are missing, and torch's pytree that torchao registers enums the old way: none of it touches the int8
# weight-only path loraflow uses, and it would open every run's log. Errors from those loggers still show.
for _name in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
