"""The text_embeds stage: every distinct text the later stages need, encoded once, ever.

Texts: every caption, the empty prompt (caption dropout, unconditional; an empty caption file is the empty
prompt too), the negative prompts and every validation prompt (`validation_prompt` and the
`user_prompt_library`). Training and validation then never load a text encoder.

A family with a `text_twin` (Kandinsky 6: Kandinsky 5 Video) keys each text its twin encodes alike as the twin keys
it (family, template and token limit the twin's; `encodes_like_twin`, with the first encoder's tokenizer): a cache the
twin filled serves it, and rows it computes for such texts serve the twin.

Kandinsky 5 i2i's prompt embedding also sees the source image, so there a text is a (text, image) item: each
caption and the empty prompt with its clip's source image (`clip["condition"]`), the validation prompts and the
negative prompt with the image validation renders from (`validate.prompt_image`). Every other flavour's items
have image "" and keys without an image.

Store schema (`text_embeds/shards/*.parquet`, one row per distinct key):
    key              str   content_key(text, family, encoder fingerprints (config + weight files), template
                           and token limit (`family.text_signature`, `max_text_tokens`), dtype, CODE_VERSION); the
                           twin's family, template and limit for a text it encodes alike
    text             str   the text as given (the family cleans it before encoding)
    image            str   i2i: the id of the source image the embedding saw; "" for every other flavour
    family           str   the family whose computation it is (the twin's for a text keyed as the twin's)
    encoders         str   JSON {component: fingerprint} of the text encoders and tokenizers
    precision        str   fp32 | bf16 | int8-torchao: the first text encoder's (`text_encoder_1_precision`)
    n_tokens         int   valid tokens of `text_embeds` (L)
    truncated        bool  the encoding was cut at the limit: the cleaned caption inside its template had more tokens
                           than the family keeps (its end, <|im_end|>, is cut first); the family says so per row
    text_embeds      float32 (L, D) valid tokens only: padding and the text mask are rebuilt by
                           `family.collate_text` at batch time, so no row stores padding
    pooled_embeds    float32 (768,)       Kandinsky 5: CLIP pooled output
    byt5_embeds      float32 (L2, 1472)   HunyuanVideo 1.5: Glyph-ByT5 tokens (one zero token when no quotes)
    byt5_mask        float32 (L2,)        HunyuanVideo 1.5: its mask
Tensors of varying length are flat lists plus a `<name>__shape` column (see store.py). The manifest
(`text_embeds/manifest-<name>.parquet`, one per config sharing the cache: store.py) lists the current text set:
key, text, image, n_tokens, truncated (`contracts/text_set.TextSetRow`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from loraflow.config import LoraflowConfig
from loraflow.contracts.clip_rows import read_clips, uncaptioned
from loraflow.contracts.renders import (
    condition_frame,
    conditioning_image,
    negative_prompt,
    prompt_image,
    render_settings,
)
from loraflow.contracts.reports import TextEmbedsReport, TokenBin, TruncatedText
from loraflow.contracts.text_set import ImageLoader, TextItem, TextSetRow
from loraflow.kernels.devices import free_models, pick_device
from loraflow.kernels.quantize import quantize_int8
from loraflow.keys import content_key, data_version
from loraflow.pipelines.base import ModelFamily, component_fingerprint, load_component
from loraflow.pipelines.sources import ModelSource
from loraflow.store import Store

log = logging.getLogger(__name__)

CODE_VERSION = "text-2"  # text-2: rows carry family, encoders, precision, truncated
BATCH_TEXTS = 16  # texts per committed shard: the resume granularity of a killed run
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8-torchao": torch.bfloat16}  # int8: bf16 compute
HISTOGRAM_EDGES = (16, 32, 64, 128, 256, 512, 1024)  # upper bounds of the token-count bins


def needed_texts(config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                 store: Store) -> dict[TextItem, ImageLoader | None]:
    """Every item later stages read, sorted, with how to load the image it sees (None: the text alone)."""
    clips = read_clips(store)
    if waiting := uncaptioned(clips):  # caption_strategy auto, before its captions: no clip trains on ""
        raise FileNotFoundError(waiting.strip())
    if not family.flavour.prompt_sees_image:
        texts = {caption for clip in clips for caption in clip.captions}
        texts |= {"", family.default_negative_prompt, *config.validation_prompts.values()}
        if config.validation_negative_prompt is not None:
            texts.add(config.validation_negative_prompt)
        return {(t, ""): None for t in sorted(texts)}
    items: dict[TextItem, ImageLoader | None] = {}
    for clip in clips:  # each caption, and the empty prompt for caption dropout, with the clip's source image
        for caption in {*clip.captions, ""}:
            items[caption, clip.condition_key] = partial(condition_frame, store, clip.key)
    if config.validation_prompts:
        settings = render_settings(config, family, model, store)
        clip_key, image = prompt_image(config, family, store, settings)
        render = partial(conditioning_image, store, clip_key, settings)
        items |= {(p, image): render for p in [*config.validation_prompts.values(), negative_prompt(config, family)]}
    return dict(sorted(items.items()))


def text_key(text: str, family: ModelFamily, encoders: dict[str, str], precision: str = "fp32", image: str = "") -> str:
    dtype = "float32" if precision == "fp32" else precision
    seen = {"image": image} if image else {}  # keys of text-only items stay as they were
    return content_key(text=text, family=family.name, encoders=encoders, template=family.text_signature,
                       max_tokens=family.max_text_tokens, dtype=dtype, code=CODE_VERSION, **seen)


def encode_texts(
    config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store, batch_texts: int = BATCH_TEXTS
) -> TextEmbedsReport:
    """Encode the texts not yet in the store (shortest first, `batch_texts` per shard) and list the text set."""
    started = time.perf_counter()
    store = store.named(config.manifest_names)  # its text set named by what it is made from, whoever opened it
    precision = config.text_encoder_1_precision
    encoders = {name: component_fingerprint(model, name) for name in family.text_components}
    items = needed_texts(config, family, model, store)
    keyed = keying_families(family, model, items)
    keys = {item: text_key(item[0], keyed[item], encoders, precision, image=item[1]) for item in items}
    have = store.keys("text_embeds")
    todo = {item: image for item, image in items.items() if keys[item] not in have}
    device = pick_device()
    stats = _encode(config, family, model, store, todo, keys, keyed, encoders, device, batch_texts) if todo else {}
    if len(stats) < len(items):  # reused rows: their counts come from the store, not the encoder
        stored = store.get("text_embeds", [keys[i] for i in items if i not in stats], columns=["n_tokens", "truncated"])
        by_key = {k: item for item, k in keys.items()}
        stats |= {by_key[key]: row for key, row in stored.items()}
    rows = [TextSetRow(key=keys[i], text=i[0], image=i[1], n_tokens=int(stats[i]["n_tokens"]),
                       truncated=bool(stats[i]["truncated"])) for i in items]
    store.write_manifest("text_embeds", [r.to_row() for r in rows])
    seconds = time.perf_counter() - started
    truncated = truncation_table(rows, store, family.max_text_tokens)
    for row in truncated:
        log.warning("text longer than %d tokens truncated (%d tokens kept), used by %s: %r", row.limit,
                    row.tokens_kept, row.files, row.text)
    return TextEmbedsReport(
        data_version=data_version(r.key for r in rows),
        computed=len(todo),
        reused=len(rows) - len(todo),
        tokens_histogram=token_histogram([r.n_tokens for r in rows]),
        truncated=truncated,
        distinct_texts=len(rows), device=str(device), text_encoder_1_precision=precision,
        bytes_on_disk=stage_bytes(store), seconds=round(seconds, 3),
        texts_per_s=round(len(todo) / seconds, 2) if todo else 0.0,
    )


def keying_families(family: ModelFamily, model: ModelSource, items: Iterable[TextItem]) -> dict[TextItem, ModelFamily]:
    """The family each item is keyed as: the twin for a text-only item it encodes alike, else `family` itself. The
    first text encoder's tokenizer (alone: no model loads) counts the tokens."""
    twin = family.text_twin
    if twin is None:
        return {item: family for item in items}
    tokenizer = load_component(model, family.text_components[1])
    return {item: twin if not item[1] and family.encodes_like_twin(tokenizer, item[0]) else family for item in items}


def _encode(
    config: LoraflowConfig, family: ModelFamily, model: ModelSource, store: Store,
    todo: dict[TextItem, ImageLoader | None], keys: dict[TextItem, str], keyed: dict[TextItem, ModelFamily],
    encoders: dict[str, str], device: torch.device, batch_texts: int,
) -> dict[TextItem, dict[str, Any]]:
    """Load the encoders, encode `todo` shortest first and commit each batch as a shard; free the encoders."""
    offload = config.offload_during_startup and device.type != "cpu"
    components = load_encoders(config, family, model, torch.device("cpu") if offload else device)
    stats: dict[TextItem, dict[str, Any]] = {}
    try:
        tokenizer = next(c for c in components.values() if not isinstance(c, torch.nn.Module))  # the first encoder's
        counts = {text: caption_tokens(tokenizer, text) for text, _ in todo}
        order = sorted(todo, key=lambda item: (counts[item[0]], item))  # similar lengths share a batch
        fixed = {"encoders": json.dumps(encoders, sort_keys=True),
                 "precision": config.text_encoder_1_precision}
        for start in tqdm(range(0, len(order), batch_texts), desc="text_embeds", unit="batch"):
            batch = order[start : start + batch_texts]
            sees_image = family.flavour.prompt_sees_image
            images = [todo[item]() for item in batch] if sees_image else None  # type: ignore[misc]
            with on_device(components, device, offload):
                encoded = family.encode_text(components, [text for text, _ in batch], images=images)
            # a family may say itself (i2i: the budget left beside the image's vision tokens)
            cut = [e.pop("truncated", counts[item[0]] > family.max_text_tokens) for item, e in zip(batch, encoded)]
            shard = [{"key": keys[item], "text": item[0], "image": item[1], "family": keyed[item].name, **fixed,
                      "n_tokens": len(e["text_embeds"]),
                      "truncated": bool(c), **e} for item, e, c in zip(batch, encoded, cut)]
            store.put("text_embeds", shard)
            stats |= {item: row for item, row in zip(batch, shard)}
    finally:  # an encoder error must not leave the encoders holding the GPU for the next stage in the pool
        free_models(*components.values())
        components.clear()
    return stats


def load_encoders(config: LoraflowConfig, family: ModelFamily, model: ModelSource,
                  device: torch.device) -> dict[str, Any]:
    """Text encoders and tokenizers; the first encoder in `text_encoder_1_precision`, the others in fp32."""
    first, precision = family.text_components[0], config.text_encoder_1_precision
    if precision != "fp32" and device.type == "cpu":
        log.warning("text_encoder_1_precision %s on the CPU: allowed, but much slower than fp32 there", precision)
    components = {name: load_component(model, name,
                                       DTYPES[precision] if name == first else torch.float32, str(device))
                  for name in family.text_components}
    if precision == "int8-torchao":
        quantize_int8(components[first], "text_encoder_1_precision")
    return components


@contextmanager
def on_device(components: dict[str, Any], device: torch.device, offload: bool) -> Iterator[None]:
    """With `offload`, the encoders sit on the CPU and visit `device` only while a batch encodes."""
    models = [c for c in components.values() if isinstance(c, torch.nn.Module)]
    if offload:
        for model in models:
            model.to(device)
    try:
        yield
    finally:
        if offload:
            for model in models:
                model.to("cpu")
            if device.type == "cuda":  # give the memory back now, not at the stage's end (no gc: per batch)
                torch.cuda.empty_cache()


def caption_tokens(tokenizer: Any, text: str) -> int:
    """Tokens of the caption alone, as the first encoder's tokenizer splits it (no template, no specials).
    i2i's tokenizer is a Qwen2-VL processor: its text tokenizer counts."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def token_histogram(counts: list[int]) -> tuple[TokenBin, ...]:
    """Texts per bin of stored tokens (`n_tokens`), up to the bin of the longest text."""
    table, low = [], 0
    for high in HISTOGRAM_EDGES:
        table.append(TokenBin(tokens=f"{low}-{high}", texts=sum(low <= c <= high for c in counts)))
        low = high + 1
        if not any(c >= low for c in counts):
            return tuple(table)
    table.append(TokenBin(tokens=f">{HISTOGRAM_EDGES[-1]}", texts=sum(c >= low for c in counts)))
    return tuple(table)


def truncation_table(rows: list[TextSetRow], store: Store, limit: int) -> tuple[TruncatedText, ...]:
    """One row per truncated item, with the source files whose captions use it.

    An i2i caption is one item per source image (the image's vision tokens share the budget), so it may be cut
    beside one image and not another: such an item lists only the files paired with that image."""
    cut = {r.item: r.n_tokens for r in rows if r.truncated}
    files: dict[TextItem, list[str]] = {item: [] for item in cut}
    for clip in read_clips(store) if cut else []:
        for caption in clip.captions:
            for item in {(caption, ""), (caption, clip.condition_key)} & cut.keys():
                if clip.path not in files[item]:
                    files[item].append(clip.path)
    return tuple(TruncatedText(text=text[:80] + ("..." if len(text) > 80 else ""), tokens_kept=cut[text, image],
                               limit=limit, files=", ".join(files[text, image]) or "(validation prompt)")
                 for text, image in sorted(cut))


def stage_bytes(store: Store) -> int:
    """Bytes of every committed text_embeds shard (stale texts included until `store.clean`)."""
    shards = store.shard_paths("text_embeds")
    return int(sum(store.fs.size(s) for s in shards))


