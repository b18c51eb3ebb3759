"""Kandinsky 6's audio VAE: the released facts the audio_latents stage relies on, and a tiny one from the real class.

Released (kandinskylab/Kandinsky-6.0-*-Diffusers `audio_vae/config.json`, class `MMAudioVAE`; diffusers 0.42.1
models/autoencoders/autoencoder_mmaudio.py, whose `__init__` defaults are the released 44.1 kHz MMAudio VAE):
    sample_rate 44100       the waveform's rate (`Kandinsky6TI2VAPipeline.audio_sample_rate` reads it)
    mono                    `MMAudioVAE.encode` takes (batch, num_samples): one channel; the pipeline's vocoder
                            output is (batch, 1, samples) and it keeps channel 0
    hop_length 512          mel frames every 512 samples; the encoder halves them once (`MMAudioEncoder1D`: one
                            downsample, after its first level), so `latent_hop_length` = 1024 samples: 44100 / 1024
                            = 43.07 latent frames per second, 215.3 per 5 s; the pipeline's audio length for F frames
                            at fps is ceil(F / fps x 44100 / 1024) (contracts/audio_rows.py `audio_latent_length`)
    latent_channels 40      = the transformer's `in_audio_dim`
    n_fft 2048, mel_bins 128, waveforms clamped to [-1, 1] by the mel front end (`MMAudioMelSpectrogram.forward`)
    scaling_factor          the checkpoint's own (0.417 the distilled, 0.5302 sft and pretrain: the k6v lane's
                            released/k6*.audio_vae.json cite where each was read); never assumed here: the stage
                            reads it from the loaded VAE's config

The tiny VAE keeps the released rate, FFT size and hop (so the audio arithmetic, the latent length of a clip, runs as
at released size) and shrinks only widths: two levels (the encoder's one 2x downsample, as released), 16 mel bins,
8 latent channels.
"""

from __future__ import annotations

from pathlib import Path

RELEASED_SAMPLE_RATE = 44_100
RELEASED_HOP_LENGTH = 512  # mel hop; the latent hop is twice it
RELEASED_LATENT_CHANNELS = 40
TINY_CONFIG = {"mel_bins": 16, "latent_channels": 8, "hidden_channels": 8, "channel_multipliers": (1, 2),
               "layers_per_block": 1, "sample_rate": RELEASED_SAMPLE_RATE, "n_fft": 2048,
               "hop_length": RELEASED_HOP_LENGTH, "scaling_factor": 0.417}


def tiny_audio_vae(seed: int = 0):  # -> diffusers.MMAudioVAE (heavy import inside)
    """A tiny MMAudioVAE with seeded random weights (the real class; its mel front end's buffers as it builds them)."""
    import torch
    from diffusers import MMAudioVAE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = MMAudioVAE(**TINY_CONFIG)
    return vae.eval()


def save_tiny_audio_vae(folder: str | Path, seed: int = 0) -> Path:
    """The tiny VAE saved as a checkpoint's `audio_vae` component folder (config.json + safetensors), which
    `from_pretrained` (and loraflow's `load_component`) loads."""
    folder = Path(folder)
    tiny_audio_vae(seed).save_pretrained(str(folder), safe_serialization=True)
    return folder
