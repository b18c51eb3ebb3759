"""The text set the text_embeds stage encodes and validation reads: its (text, image) items, whose image is "" where
prompts see no image (all but i2i; the flavour's `prompt_sees_image`), its manifest rows, the current keys and their
cached rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from loraflow.pipelines.base import TextRow
from loraflow.store import Store

TextItem = tuple[str, str]  # (text, image id): the image is "" where prompts see no image (all but i2i)
ImageLoader = Callable[[], np.ndarray]  # uint8 (H, W, 3), read only when the item must be encoded


@dataclass(frozen=True)
class TextSetRow:
    """A row of the store's `text_embeds` manifest: one item of the current text set. The fields are its Parquet
    columns, in order; `to_row`/`from_row` are the only crossings to and from the store."""

    key: str
    text: str
    image: str  # "" where prompts see no image
    n_tokens: int  # valid tokens of the stored embedding
    truncated: bool  # the encoding was cut at the family's token limit

    @property
    def item(self) -> TextItem:
        return self.text, self.image

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TextSetRow:
        # a manifest written before i2i added the `image` column has none: every item there is text alone
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name != "image"}, image=row.get("image") or "")


def read_text_set(store: Store) -> list[TextSetRow]:
    """The `text_embeds` manifest, typed."""
    return [TextSetRow.from_row(row) for row in store.read_manifest("text_embeds")]


def text_lookup(store: Store) -> dict[TextItem, str]:
    """(text, image) -> key for the current text set."""
    return {row.item: row.key for row in read_text_set(store)}


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
