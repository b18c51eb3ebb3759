"""Where loraflow's released numbers come from: the sources it cites, and `cite`, which every cited number goes
through (no torch: the flavour specs import it).

A citation is "<source>: <where in it, and what it says>", <source> one of `SOURCES` (a repository at the commit read,
a document, or loraflow's own choice with its reason). Each flavour carries one per number (`Flavour.sources`) and
each released config file one per key (`loraflow/pipelines/released/*.json`, `source.values`);
tests/pipelines/test_citations.py fails on a number without one. docs/families.md's table shows them.
"""

from __future__ import annotations

# source -> what it is (a repository at the commit read here, or a document)
SOURCES: dict[str, str] = {
    "kandinsky-5": "kandinskylab/kandinsky-5 (the original Kandinsky 5 repository, ai-forever/Kandinsky-5 before) at "
                   "6e2a80517cdf, 2025-11-28",
    "musubi-tuner": "kohya-ss/musubi-tuner at 30c658c4f4b0 (src/musubi_tuner/kandinsky5/configs.py: its `--task` "
                    "configs; docs/kandinsky5.md)",
    "diffusers 0.42.1": "the diffusers wheel loraflow runs (pipelines/kandinsky5, pipelines/hunyuan_video1_5, "
                        "pipelines/kandinsky6, models/transformers/transformer_kandinsky6.py, models/autoencoders/"
                        "autoencoder_mmaudio.py and mmaudio_vocoder.py, schedulers/scheduling_piflow.py)",
    "diffusers@d641013": "huggingface/diffusers at d641013f9140: docs/source/en/api/pipelines/kandinsky6.md (its "
                         "\"Available models\" table: each Kandinsky 6 repository's steps and guidance)",
    "kandinsky-6": "kandinskylab/kandinsky-6 (the original Kandinsky 6 repository): README.md at 00e33441f92d, "
                   "comfyui/kandinsky6/register.py at 8195e726f952, comfyui/kandinsky6/nodes.py and model_base.py at "
                   "9d2ffe177da0 (the index holds no other file of it)",
    "kandinsky-6 fork": "KozlovKY/kandinsky-6 at 60c4ff66c9ba, a fork that carries the original's kandinsky/ package "
                        "(pipeline/config.py, runtime/weights.py, runtime/sampler.py, core/components/"
                        "text_embedder.py, core/algo/prepare_latents.py), which the index lacks for kandinskylab/"
                        "kandinsky-6",
    "FastVideo K6": "hao-ai-lab/FastVideo at 02184dc49c78: docs/inference/kandinsky6.md (its Models table, read from "
                    "each repository's scheduler_config.json and transformer/config.json)",
    "sglang": "sgl-project/sglang at ccfb9239d719: python/sglang/multimodal_gen/test/unit/"
              "test_kandinsky6_arch_config.py (PRO_DISTILL_TRANSFORMER_CONFIG, \"transformer/config.json of "
              "kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers\", and the audio_vae scaling factors of the Pro "
              "repositories)",
    "diffusers@58eb52c": "huggingface/diffusers main at 58eb52c0803e (0.40.0.dev0): its docs, its "
                         "scripts/convert_hunyuan_video1_5_to_diffusers.py, and its Kandinsky 5 pipelines before "
                         "0.42 changed their template",
    "HunyuanVideo-1.5": "Tencent-Hunyuan/HunyuanVideo-1.5 at 60783e704160 (README.md, generate.py, train.py, hyvideo/)",
    "ComfyUI": "comfyanonymous/ComfyUI (comfy/text_encoders/byt5_config_small_glyph.json at d7c3a3f27e48, "
               "comfy/text_encoders/kandinsky5.py at 0c4b64d53faf)",
    "FastVideo": "hao-ai-lab/FastVideo at 2f3d4074064e (fastvideo/pipelines/basic/kandinsky5/presets.py, "
                 "fastvideo/configs/pipelines/kandinsky5.py)",
    "SimpleTuner": "bghira/SimpleTuner at 029f437c5a83 (simpletuner/helpers/models/*/model.py)",
    "seed guide": "the guides loraflow's users follow (/work/shared/seeds/, SimpleTuner's quickstarts)",
    "issue 30": "loraflow issue 30, which gave the public model facts of the released configs (not re-read here)",
    "Hub config": "the model's own config.json on the Hugging Face Hub, as recalled when the file was written (not "
                  "read offline: unverified)",
    "derived": "computed by loraflow from other cited numbers (the citation says how)",
    "loraflow": "loraflow's own choice where no release states the number (the citation says why)",
}


def cite(source: str, where: str) -> str:
    """"<source>: <where>" for one of `SOURCES` (an unknown source is a programming error, raised at import)."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; known: {', '.join(SOURCES)}")
    if not where.strip():
        raise ValueError(f"a citation of {source!r} must say where in it the number is")
    return f"{source}: {where}"


def citation_problem(text: object) -> str:
    """Why `text` is no citation ("" when it is one): "<one of SOURCES>: <where>"."""
    if not isinstance(text, str) or ": " not in text:
        return f"not a citation ('<source>: <where>'): {text!r}"
    source, where = text.split(": ", 1)
    if source not in SOURCES:
        return f"unknown source {source!r} in {text!r}"
    return "" if where.strip() else f"no place in {source} given: {text!r}"


# The citations several flavours share
K5_VIDEO_DEFAULT_SCALE = cite("kandinsky-5", "kandinsky/t2v_pipeline.py and i2v_pipeline.py __call__ "
                                             "scheduler_scale=10.0 (the yaml gives none); musubi-tuner's task sets "
                                             "10.0")
K5_IMAGE_SCALE = cite("kandinsky-5", "kandinsky/t2i_pipeline.py and i2i_pipeline.py __call__ scheduler_scale=3.0; "
                                     "musubi-tuner k5-lite-t2i-hd / k5-lite-i2i-hd scheduler_scale=3.0")
K5_FPS = cite("kandinsky-5", "kandinsky/t2v_pipeline.py: num_frames = time_length * 24 // 4 + 1 latent frames "
                             "(24 fps)")
K5_SD_SIZE = cite("kandinsky-5", "kandinsky/t2v_pipeline.py __call__ width=768, height=512, in RESOLUTIONS[512] "
                                 "(the *_sd.yaml configs: metrics.resolution 512)")
K5_HD_SIZE = cite("kandinsky-5", "kandinsky/t2v_pipeline.py RESOLUTIONS[1024] holds (768, 1280), as wide as the SD "
                                 "default (the *_hd.yaml configs: metrics.resolution 1024; all sides multiples of 128)")
K5_OLD_STEPS = cite("loraflow", "30, the config default before issue 33, kept so validation keys stay; the release "
                                "samples with 50 (kandinsky-5 configs/*.yaml model.num_steps 50)")
K5_VIDEO_TEXT = cite("kandinsky-5", "configs/k5_*_t2v_*.yaml and k5_*_i2v_*.yaml text_embedder.qwen.max_length 256 "
                                    "(musubi-tuner _text_default 256, SimpleTuner caps 256; diffusers 0.42.1's "
                                    "__call__ max_sequence_length=512 differs)")
K5_IMAGE_TEXT = cite("kandinsky-5", "configs/k5_lite_t2i_sft_hd.yaml text_embedder.qwen.max_length 512 (diffusers "
                                    "0.42.1 Kandinsky5T2IPipeline max_sequence_length=512 agrees)")
