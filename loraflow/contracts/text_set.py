"""The text set the text_embeds stage encodes and validation reads: its (text, image) items, whose image is "" where
prompts see no image (all but i2i; the flavour's `prompt_sees_image`), the current keys and their cached rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loraflow.pipelines.base import TextRow
from loraflow.store import Store

TextItem = tuple[str, str]  # (text, image id): the image is "" where prompts see no image (all but i2i)
ImageLoader = Callable[[], np.ndarray]  # uint8 (H, W, 3), read only when the item must be encoded


def text_lookup(store: Store) -> dict[TextItem, str]:
    """(text, image) -> key for the current text set."""
    return {(row["text"], row.get("image") or ""): row["key"] for row in store.read_manifest("text_embeds")}


def cached_texts(store: Store, items: list[TextItem]) -> dict[TextItem, TextRow]:
    """(text, image) -> embedding row; every item must have been encoded by the text_embeds stage."""
    keys = text_lookup(store)
    missing = [text for text, image in items if (text, image) not in keys]
    if missing:
        raise KeyError(f"{len(missing)} validation text(s) have no cached embedding, e.g. {missing[0]!r}: "
                       "materialize `text_embeds` again (it encodes every validation prompt and the negative prompt"
                       ", with the image validation renders from for i2i)")
    rows = store.get("text_embeds", {keys[i] for i in items})
    return {i: rows[keys[i]] for i in items}
