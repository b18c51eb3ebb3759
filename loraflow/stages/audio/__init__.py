"""The audio_latents stage: each clip's sound over its own time span, encoded by the checkpoint's audio VAE."""
