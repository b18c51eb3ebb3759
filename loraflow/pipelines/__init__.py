"""Model families. Only this package knows family names: stages ask `get_family(config)` and call methods.

A family is a folder `pipelines/<family>/` (Kandinsky 5: `kandinsky5/video/`, `kandinsky5/image/`, beside what both
share) with `spec.py` (its plain `SPEC`), `family.py` (the adapter: torch, diffusers) and `tiny.py` (its tiny
checkpoint), registered by one row of `registry.FAMILIES`; docs/families.md says how to add one. This module re-exports
the registry's names, which is what callers import.
"""

from loraflow.pipelines.registry import (
    FAMILIES,
    FamilyChoice,
    FamilyPlan,
    FamilyPlanning,
    bucket_blocks,
    bucket_multiple,
    bucket_note,
    describe_families,
    family_flavour,
    family_names,
    family_spec,
    family_specs,
    flavour_names,
    get_family,
    known_flavour,
    load_family,
    nearest_multiple,
    plan_family,
)

__all__ = [
    "FAMILIES", "FamilyChoice", "FamilyPlan", "FamilyPlanning", "bucket_blocks", "bucket_multiple", "bucket_note",
    "describe_families", "family_flavour", "family_names", "family_spec", "family_specs", "flavour_names",
    "get_family", "known_flavour", "load_family", "nearest_multiple", "plan_family",
]
