"""Kandinsky 6's tiny checkpoints (`loraflow.demo.tiny.build_tiny`), from the real diffusers classes: a
Kandinsky6TI2VAPipeline with a two-block transformer, the tiny MMAudio VAE and BigVGAN vocoder, and Kandinsky 5
Video's tiny text encoders and video VAE.

Those Kandinsky 5 parts are built exactly as Kandinsky 5 Video's tiny builder builds them (its builder is run first,
from the seed `build_tiny` sets), so their files hold the same bytes as Kandinsky 5's tiny checkpoint of that seed: the
same computation, as in the release. The audio parts keep the released sample rate, FFT size and hop (44.1 kHz, 2048,
512: one latent frame per 1024 samples), so the audio arithmetic runs as at released size; only widths shrink.
"""

from __future__ import annotations

from collections.abc import Callable

from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5T2VPipeline,
    Kandinsky6TI2VAPipeline,
    Kandinsky6Transformer3DModel,
    MMAudioVAE,
    MMAudioVocoder,
    PiflowScheduler,
)

from loraflow.pipelines.flavours import Flavour
from loraflow.pipelines.kandinsky5.tiny_parts import kandinsky5_pipeline
from loraflow.pipelines.kandinsky5.video.tiny import hunyuan_video_vae
from loraflow.pipelines.kandinsky6.audio_vae import TINY_CONFIG as TINY_AUDIO_VAE
from loraflow.pipelines.kandinsky6.spec import SPEC, is_distilled
from loraflow.pipelines.tiny_parts import TEXT_DIM, TinyPipeline, recipe_name

AUDIO_CHANNELS = TINY_AUDIO_VAE["latent_channels"]  # = the transformer's audio input width (released: 40)
MEL_BINS = TINY_AUDIO_VAE["mel_bins"]  # released: 128
N_GRID = 2  # π-Flow velocities per channel of the distilled tiny transformer (released: 10)
SHIFT = 5.0  # the released schedulers' shift (spec.py cites it)


def transformer(n_grid: int = 1) -> Kandinsky6Transformer3DModel:
    """Released Lite's layout at width 32 (2 heads of 4+6+6 rope axes; the audio stream 16 wide, one head of the same
    axes: `ca_rope` applies each stream's rope to the other's keys), one text block, two fused blocks; every flag the
    released configs set (released/k6-lite.transformer.json), and the two I2VA token types, which the released Lite
    sft and pretrain lack (that file cites it), so that one tiny checkpoint runs t2v and i2v. `n_grid` > 1: the π-Flow
    head."""
    return Kandinsky6Transformer3DModel(
        in_visual_dim=16, out_visual_dim=16 * n_grid, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM, time_dim=32,
        patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6),
        visual_cond=True, in_audio_dim=AUDIO_CHANNELS, out_audio_dim=AUDIO_CHANNELS * n_grid, model_dim_a=16,
        time_dim_a=32, ff_dim_a=32, axes_dims_a=(4, 6, 6), audio_freqs_scaling=0.144, scale_factor=(1.0, 2.0, 2.0),
        text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
        visual_token_type_num_embeddings=2,
    ).eval()


def audio_vae() -> MMAudioVAE:
    """Two levels (the encoder halves the mel frames once, as released), released rate, FFT and hop (audio_vae.py)."""
    return MMAudioVAE(**TINY_AUDIO_VAE).eval()


def vocoder() -> MMAudioVocoder:
    """Three 8x upsamplings: 512 samples per mel frame, the audio VAE's hop."""
    return MMAudioVocoder(num_mels=MEL_BINS, upsample_initial_channel=16, upsample_rates=(8, 8, 8),
                          upsample_kernel_sizes=(16, 16, 16), resblock_kernel_sizes=(3,),
                          resblock_dilation_sizes=((1,),)).eval()


def _pipeline(n_grid: int, scheduler: object) -> TinyPipeline:
    k5, _ = kandinsky5_pipeline(Kandinsky5T2VPipeline, visual_cond=True, vae=hunyuan_video_vae, shift=10.0)
    pipe = Kandinsky6TI2VAPipeline(
        transformer=transformer(n_grid), vae=k5.vae, text_encoder=k5.text_encoder, tokenizer=k5.tokenizer,
        text_encoder_2=k5.text_encoder_2, tokenizer_2=k5.tokenizer_2, scheduler=scheduler, audio_vae=audio_vae(),
        vocoder=vocoder())
    return pipe, {}


def flow_pipeline() -> TinyPipeline:
    """pretrain and sft: flow matching, FlowMatchEulerDiscreteScheduler."""
    return _pipeline(1, FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT))


def piflow_pipeline() -> TinyPipeline:
    """distill: the π-Flow head and PiflowScheduler."""
    return _pipeline(N_GRID, PiflowScheduler(num_train_timesteps=1000, shift=SHIFT, n_grid=N_GRID))


def tiny(flavour: Flavour) -> tuple[type, str, Callable[[], TinyPipeline]]:
    """The tiny checkpoint `build_tiny` writes for a flavour: t2v and i2v share one, as their release does; the
    distilled flavours have their own (π-Flow head and scheduler)."""
    if is_distilled(flavour):
        return Kandinsky6TI2VAPipeline, recipe_name(SPEC.name, "piflow", 1), piflow_pipeline
    return Kandinsky6TI2VAPipeline, recipe_name(SPEC.name, "flow", 1), flow_pipeline
