"""The text_embeds stage: every distinct text the later stages need, encoded once, ever.

Texts: every caption, the empty prompt (caption dropout, unconditional), the negative prompts and every
validation prompt (`validation_prompt` and the `user_prompt_library`). Training and validation then never
load a text encoder.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from loraflow.config import LoraflowConfig
from loraflow.keys import content_key, data_version
from loraflow.ops.devices import free_models, pick_device
from loraflow.ops.report import StageReport
from loraflow.pipelines.base import ModelFamily, component_fingerprint, load_component
from loraflow.store import Store

CODE_VERSION = "text-1"
BATCH_TEXTS = 16


def needed_texts(config: LoraflowConfig, family: ModelFamily, store: Store) -> list[str]:
    texts = {caption for clip in store.read_manifest("clips") for caption in clip["captions"]}
    texts |= {"", family.default_negative_prompt, *config.validation_prompts.values()}
    if config.validation_negative_prompt is not None:
        texts.add(config.validation_negative_prompt)
    return sorted(texts)


def text_key(text: str, family: ModelFamily, encoders: dict[str, str]) -> str:
    return content_key(text=text, family=family.name, encoders=encoders, template=family.text_signature,
                       dtype="float32", code=CODE_VERSION)


def encode_texts(config: LoraflowConfig, family: ModelFamily, store: Store) -> StageReport:
    path = config.pretrained_model_name_or_path
    encoders = {name: component_fingerprint(path, name) for name in family.text_components}
    rows = [{"key": text_key(t, family, encoders), "text": t} for t in needed_texts(config, family, store)]
    have = store.keys("text_embeds")
    todo = [r for r in rows if r["key"] not in have]
    device = pick_device()
    if todo:
        components = {name: load_component(path, name, torch.float32, str(device)) for name in family.text_components}
        for start in tqdm(range(0, len(todo), BATCH_TEXTS), desc="text_embeds", unit="batch"):
            batch = todo[start : start + BATCH_TEXTS]
            encoded = family.encode_text(components, [r["text"] for r in batch])
            store.put("text_embeds", [{"key": r["key"], "text": r["text"], "n_tokens": len(e["text_embeds"]), **e} for r, e in zip(batch, encoded)])
        free_models(*components.values())
    store.write_manifest("text_embeds", rows)
    return StageReport(
        data_version=data_version(r["key"] for r in rows),
        computed=len(todo),
        reused=len(rows) - len(todo),
        facts={"distinct_texts": len(rows), "device": str(device)},
    )


def text_lookup(store: Store) -> dict[str, str]:
    """text -> key for the current text set."""
    return {row["text"]: row["key"] for row in store.read_manifest("text_embeds")}
