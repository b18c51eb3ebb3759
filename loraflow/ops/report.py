"""What every stage op returns: small, frozen, and enough for the asset's metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StageReport:
    data_version: str
    computed: int
    reused: int
    quarantined: list[dict[str, str]] = field(default_factory=list)  # rows of {file, reason, detail}
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # scalars for metadata: paths, bytes, seconds
