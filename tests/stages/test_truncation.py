"""`truncated` says whether the tokens the encoder saw were cut: counted on what the pipelines encode (the cleaned
text inside the template), not on the raw caption.

Kandinsky 5 cleans a caption first (`prompt_clean`: HTML entities unescaped, so "&amp; " becomes "& "), and the
template's end (<|im_end|> and the assistant turn) comes after the caption, so it is the first thing a long caption
cuts off. HunyuanVideo 1.5 encodes the caption in its chat template the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraflow.demo.tiny import build_tiny
from loraflow.pipelines import load_family
from loraflow.pipelines.base import load_component
from loraflow.stages.text.text_embeds import caption_tokens

# raw: > 256 tokens (Kandinsky 5 Video's limit) in the tiny byte-level tokenizer; cleaned: "& " * 100, 199 tokens
FITS_ONCE_CLEANED = "&amp; " * 100


@pytest.fixture(scope="module", params=["kandinsky5-video", "hunyuanvideo-1.5"])
def encoder(request: pytest.FixtureRequest, tiny_k5: Path, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    path = tiny_k5 if name == "kandinsky5-video" else build_tiny(name, tmp_path_factory.mktemp("hv") / name)
    family = load_family(name)
    return family, {c: load_component(path, c) for c in family.text_components}


def test_truncated_counts_the_tokens_actually_encoded(encoder) -> None:
    family, components = encoder
    limit = family.max_text_tokens
    cuts_the_template_end = "a" * limit  # as many caption tokens as the limit: none left for <|im_end|> after it
    raw = [caption_tokens(components["tokenizer"], t) for t in (FITS_ONCE_CLEANED, cuts_the_template_end)]
    texts = ["a red ball", cuts_the_template_end]
    if family.name == "kandinsky5-video":  # the only family that cleans captions
        assert raw[0] > limit  # the raw count (the old rule) would flag it
        texts.append(FITS_ONCE_CLEANED)
    assert raw[1] <= limit  # the raw count (the old rule) would not flag it
    rows = family.encode_text(components, texts)
    assert [r["truncated"] for r in rows] == [False, True] + [False] * (len(texts) - 2)
    assert len(rows[1]["text_embeds"]) == limit  # cut at the limit: the template's end is gone
