"""Every prompt-template crop counted with the real Qwen2 / Qwen2.5 tokenizer (Qwen's 151,643 BPE ranks, which the
`dashscope` wheel ships; built by loraflow.demo.qwen_vocab into .loraflow/qwen2-tokenizer/), not the tiny
checkpoints' one-token-a-byte tokenizer that every other test uses.

The pipelines hard-code their crops for this tokenizer; loraflow computes them from its templates. Kandinsky 5 video
and t2i encode by default with the original repository's templates ("You are a promt engineer", crops 129 / 41),
which the checkpoints were trained with and ComfyUI encodes with; diffusers 0.42.1's ("prompt", 128 / 40) is the
`kandinsky5_prompt_template: diffusers` option. The two are measured on a tiny Qwen2.5-VL with the real vocabulary:
the crop lands on the user text in both, and every prompt token's hidden state differs. Kandinsky 5 i2i
follows the original repository (kandinskylab/kandinsky-5, kandinsky/models/text_embedders.py): its "image_edit"
template and its crop of 55, which is 3 tokens past that template's 52-token prefix. diffusers' i2i template differs
(the "promt" typo fixed, two "\n" dropped: a 49-token prefix) and its crop of 54 cuts 5 tokens into the user text.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import (
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    Kandinsky5I2IPipeline,
    Kandinsky5I2VPipeline,
    Kandinsky5T2IPipeline,
    Kandinsky5T2VPipeline,
)
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from loraflow.demo import qwen_vocab
from loraflow.pipelines.hunyuanvideo15 import family as hunyuanvideo15
from loraflow.pipelines.hunyuanvideo15.tiny import hunyuan_video15_vae
from loraflow.pipelines.kandinsky5.image import family as kandinsky5_image
from loraflow.pipelines.kandinsky5.video import family as kandinsky5_video
from tests.factory import missing_input

# The original repository's crop_start per type_of_content (kandinsky/models/text_embedders.py, PROMPT_TEMPLATE).
ORIGINAL_CROPS = {"video": 129, "image": 41, "image_edit": 55}
I2I_PREFIX = 52  # tokens of the original image_edit template before the user text
PROMPT = "make the circle green"


@pytest.fixture(scope="module")
def qwen() -> Any:
    try:
        return qwen_vocab.load_tokenizer()
    except qwen_vocab.VocabularyUnavailable as error:
        missing_input(f"the real Qwen2 vocabulary cannot be had here (no package index reachable): {error}")


def count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def prefix(template: str) -> str:
    return template.split("{}")[0]


def constants_of(cls: type) -> Any:
    """The pipeline class's own __init__, with no components: only its template and crop are read."""
    return cls(**dict.fromkeys(list(inspect.signature(cls.__init__).parameters)[1:]))


def hv_constants_of(cls: type) -> Any:
    """As `constants_of`; the HunyuanVideo 1.5 pipelines read their VAE's config in __init__ (the tiny one does)."""
    return cls(**dict.fromkeys(list(inspect.signature(cls.__init__).parameters)[1:]) | {"vae": hunyuan_video15_vae()})


# -- the tokenizer ------------------------------------------------------------------------------------------
def test_tokenizer_has_qwen25_vl_ids_and_qwen2_pre_tokenizer(qwen: Any) -> None:
    assert len(qwen) == qwen_vocab.RANK_COUNT + len(qwen_vocab.ADDED_TOKENS)
    ids = qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                      "<|vision_end|>", "<|image_pad|>"])
    assert ids == [151643, 151644, 151645, 151652, 151653, 151655]  # Qwen2.5-VL's config names these ids
    assert qwen.tokenize("2025") == ["2", "0", "2", "5"]  # Qwen2 splits digits one by one (tiktoken's cl100k: 1-3)
    assert count(qwen, "<|im_end|>\n<|im_start|>user\n") == 5  # markers whole, each "\n" on its own


# -- Kandinsky 5 video and t2i: the pipelines' crops are their prefixes -------------------------------------
@pytest.mark.parametrize(("cls", "module", "crop"), [
    (Kandinsky5T2VPipeline, kandinsky5_video, 128), (Kandinsky5I2VPipeline, kandinsky5_video, 128),
    (Kandinsky5T2IPipeline, kandinsky5_image, 40),
])
def test_k5_diffusers_crop_is_the_template_prefix(qwen: Any, cls: type, module: Any, crop: int) -> None:
    pipe = constants_of(cls)
    assert pipe.prompt_template_encode_start_idx == crop
    assert count(qwen, prefix(pipe.prompt_template)) == crop
    assert module.DIFFUSERS_TEMPLATE == pipe.prompt_template  # the option is diffusers 0.42.1's template, verbatim
    assert module.template_crop(qwen, "diffusers") == crop  # loraflow's, computed from its copy of the template


@pytest.mark.parametrize(("module", "kind"), [(kandinsky5_video, "video"), (kandinsky5_image, "image")])
def test_k5_encodes_with_the_original_template_and_its_crop_by_default(qwen: Any, module: Any, kind: str) -> None:
    """The original's templates are diffusers' with "promt" (one token more): its crops 129 / 41 are their prefixes,
    and they are loraflow's default (before issue 44: diffusers', 128 / 40)."""
    family = module.make_family(None)
    assert family.template == "original" and "You are a promt engineer" in family.prompt_template
    assert module.ORIGINAL_TEMPLATE == module.DIFFUSERS_TEMPLATE.replace("a prompt engineer", "a promt engineer")
    assert module.template_crop(qwen) == count(qwen, prefix(family.prompt_template)) == ORIGINAL_CROPS[kind]


@pytest.fixture(scope="module")
def real_vocab_components(qwen: Any) -> dict[str, Any]:
    """A tiny Qwen2.5-VL (random, 3 layers of 32) over the real vocabulary, and the tiny CLIP: `encode_text`'s parts."""
    from loraflow.pipelines.tiny_parts import clip_text_encoder, clip_tokenizer, qwen_vl_encoder

    torch.manual_seed(0)
    clip = clip_tokenizer()
    return {"tokenizer": qwen, "text_encoder": qwen_vl_encoder(qwen), "tokenizer_2": clip,
            "text_encoder_2": clip_text_encoder(clip)}


@pytest.mark.parametrize("module", [kandinsky5_video, kandinsky5_image])
def test_the_two_templates_differ_in_every_prompt_token(real_vocab_components: dict[str, Any],
                                                         module: Any) -> None:
    """Measured on a tiny Qwen with the real vocabulary, through loraflow's own `encode_text`: both crops start at
    the user text (the same prompt tokens are kept), and because Qwen is causal the one-token-longer system prompt
    moves the hidden state of every one of them (what the checkpoints saw is the original's; docs/families.md gives
    the numbers). CLIP's pooled output, which sees no template, is the same."""
    qwen = real_vocab_components["tokenizer"]
    rows = {}
    for template in ("original", "diffusers"):
        family = replace(module.make_family(None), template=template)
        rows[template] = family.encode_text(real_vocab_components, [PROMPT])[0]
        ids = qwen(family.prompt_template.format(PROMPT))["input_ids"][module.template_crop(qwen, template):]
        assert qwen.decode(ids) == PROMPT + "<|im_end|>"
    original, diffusers = (torch.from_numpy(rows[t]["text_embeds"]) for t in ("original", "diffusers"))
    assert original.shape == diffusers.shape == (count(qwen, PROMPT) + 1, 32)
    per_token = (original - diffusers).norm(dim=-1) / original.norm(dim=-1)
    assert bool((per_token > 1e-3).all()), per_token  # float32 noise is ~1e-7: every token moved
    assert (rows["original"]["pooled_embeds"] == rows["diffusers"]["pooled_embeds"]).all()


# -- HunyuanVideo 1.5 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline])
def test_hv15_crop_is_the_chat_prefix(qwen: Any, cls: type) -> None:
    pipe = hv_constants_of(cls)
    marker = "\x00prompt\x00"
    rendered = qwen.apply_chat_template(format_text_input([marker], pipe.system_message), tokenize=False,
                                        add_generation_prompt=True)[0]
    assert pipe.prompt_template_encode_start_idx == 108
    assert count(qwen, rendered.split(marker)[0]) == 108
    assert hunyuanvideo15.template_crop(qwen) == 108


# -- Kandinsky 5 i2i: loraflow follows the original repository ----------------------------------------------
def test_i2i_crop_is_the_original_repos(qwen: Any) -> None:
    template = kandinsky5_image.I2I_PROMPT_TEMPLATE
    assert count(qwen, prefix(template)) == I2I_PREFIX
    assert kandinsky5_image.i2i_template_crop(qwen) == ORIGINAL_CROPS["image_edit"] == I2I_PREFIX + 3


def test_diffusers_i2i_template_and_crop_differ_from_the_original(qwen: Any) -> None:
    """diffusers fixed the typo and dropped the "\n" after <|im_end|> and after "user": 49 prefix tokens, crop 54."""
    pipe = constants_of(Kandinsky5I2IPipeline)
    original = kandinsky5_image.I2I_PROMPT_TEMPLATE
    assert pipe.prompt_template == original.replace("promt", "prompt").replace(
        "<|im_end|>\n<|im_start|>user\n", "<|im_end|><|im_start|>user")
    assert count(qwen, prefix(pipe.prompt_template)) == I2I_PREFIX - 1 - 2
    assert pipe.prompt_template_encode_start_idx - count(qwen, prefix(pipe.prompt_template)) == 5


# -- Kandinsky 5 i2i: the image part of the template ---------------------------------------------------------
@pytest.fixture(scope="module")
def i2i_checkpoint(qwen: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only the i2i processor: the real tokenizer and Qwen2-VL's image processor
    (patch 14, merge 2: 28 px a vision token)."""
    path = tmp_path_factory.mktemp("k5-i2i-real-tokenizer")
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=qwen,
                     video_processor=Qwen2VLVideoProcessor()).save_pretrained(path / "tokenizer")
    (path / "model_index.json").write_text(json.dumps({"tokenizer": ["transformers", "Qwen2VLProcessor"]}))
    return path


def vision_tokens(height: int, width: int) -> int:
    """The pipeline halves the source; the image processor rounds each side to 28 px (inside its pixel bounds)."""
    return round(height / 2 / 28) * round(width / 2 / 28)


@pytest.mark.parametrize(("width", "height"), constants_of(Kandinsky5I2IPipeline).resolutions)
def test_i2i_image_part_of_the_template(qwen: Any, i2i_checkpoint: Path, width: int, height: int) -> None:
    """At every i2i resolution: the processor expands <|image_pad|> to the arithmetic's count, which size_problem
    uses; the templated prompt is prefix + text + <|vision_start|> + vision tokens + <|vision_end|><|im_end|>."""
    expected = vision_tokens(height, width)
    assert kandinsky5_image.source_vision_tokens(str(i2i_checkpoint), height, width) == expected
    processor = Qwen2VLProcessor.from_pretrained(i2i_checkpoint / "tokenizer")
    source = Image.new("RGB", (width // 2, height // 2))
    ids = processor(text=[kandinsky5_image.I2I_PROMPT_TEMPLATE.format(PROMPT)], images=[source],
                    return_tensors="np")["input_ids"][0]
    assert int((ids == processor.image_token_id).sum()) == expected
    assert len(ids) == I2I_PREFIX + count(qwen, PROMPT) + expected + kandinsky5_image.I2I_CLOSING_TOKENS
    assert kandinsky5_image.make_family("i2i-lite-sft").size_problem(i2i_checkpoint, height, width) == ""
