"""The released checkpoints' component configs as data (nothing downloaded): one JSON per distinct config in this
folder, `{"source": {"repo_id", "file", "revision_note", "same_in"}, "config": {...}}`, where `config` is the
component's config.json as its library writes it (diffusers: `_class_name`; transformers: `architectures`) and
`revision_note` says which values were read from where and which were derived (checked by parameter counts,
tests/pipelines/test_released.py).

`released_config(flavour or repo id, component)` reads one; `released_model(...)` builds its real class from it
(on the meta device, or under a FakeTensorMode: no memory), which the real-size dry runs train, encode and render
through loraflow's own code (tests/pipelines/test_released_dry_runs.py).
"""

from __future__ import annotations

import json
import weakref
from functools import cache
from pathlib import Path
from typing import Any

from loraflow.pipelines.hunyuanvideo15_spec import SPEC as HV15
from loraflow.pipelines.kandinsky5_image_spec import SPEC as K5_IMAGE
from loraflow.pipelines.kandinsky5_video_spec import SPEC as K5_VIDEO

FOLDER = Path(__file__).parent
CREPA_ENCODER = "crepa_encoder"  # CREPA's teacher, the same for every flavour


def _k5_video(flavour: str) -> dict[str, str]:
    size = "pro" if "-pro-" in flavour else "lite"
    seconds = "10s" if flavour.endswith(("10s", "10s-hd")) else "5s"
    return {"transformer": f"k5-video-{size}-{seconds}", "vae": "hunyuanvideo", "text_encoder": "qwen2.5-vl-7b",
            "text_encoder_2": "clip-l"}


def _k5_image(flavour: str) -> dict[str, str]:
    return {"transformer": f"k5-image-{flavour.split('-')[0]}", "vae": "flux", "text_encoder": "qwen2.5-vl-7b",
            "text_encoder_2": "clip-l"}


def _hv15(flavour: str) -> dict[str, str]:
    task, resolution = flavour.split("-")
    files = {"transformer": f"hv15-{resolution}-{task}", "vae": "hv15", "text_encoder": "qwen2.5-vl-7b-text",
             "text_encoder_2": "glyph-byt5"}
    return files | ({"image_encoder": "siglip-so400m"} if task == "i2v" else {})


# flavour name -> {component: file stem}; the file is `<stem>.<component>.json`
FLAVOURS: dict[str, dict[str, str]] = {
    **{f.name: _k5_video(f.name) for f in K5_VIDEO.flavours},
    **{f.name: _k5_image(f.name) for f in K5_IMAGE.flavours},
    **{f.name: _hv15(f.name) for f in HV15.flavours},
}
# a flavour's diffusers repository -> its flavour (i2v-pro-pretrain-5s has none: its config is I2V-Pro-sft-5s's)
REPOS = {f.repo: f.name for spec in (K5_VIDEO, K5_IMAGE, HV15) for f in spec.flavours if f.repo}


@cache
def _read(name: str) -> dict[str, Any]:
    return json.loads((FOLDER / name).read_text())


def file_name(flavour_or_repo: str, component: str) -> str:
    """The name of the file in this folder holding a flavour's (or its diffusers repository's) component."""
    flavour = REPOS.get(flavour_or_repo, flavour_or_repo)
    if flavour not in FLAVOURS:
        raise KeyError(f"no released configs for {flavour_or_repo!r}; known flavours: {', '.join(sorted(FLAVOURS))}")
    parts = {**FLAVOURS[flavour], CREPA_ENCODER: "dinov2-giant"}
    if component not in parts:
        raise KeyError(f"flavour {flavour!r} has no component {component!r}; it has {', '.join(sorted(parts))}")
    return f"{parts[component]}.{component}.json"


def released_file(flavour_or_repo: str, component: str) -> dict[str, Any]:
    """The whole JSON (`source` and `config`) of a flavour's (or its diffusers repository's) component."""
    return _read(file_name(flavour_or_repo, component))


def released_config(flavour_or_repo: str, component: str) -> dict:
    """The config.json of a released checkpoint's component (a copy: callers may edit it)."""
    return json.loads(json.dumps(released_file(flavour_or_repo, component)["config"]))


def components(flavour_or_repo: str) -> list[str]:
    """The components of a flavour with a released config (CREPA's teacher included)."""
    return sorted({*FLAVOURS[REPOS.get(flavour_or_repo, flavour_or_repo)], CREPA_ENCODER})


def model_from_config(config: dict[str, Any]) -> Any:
    """The real diffusers/transformers class built from a config.json dict on the current default device or fake
    mode (callers choose: `torch.device("meta")` or `fake_mode()`), for shapes, not values: transformers' weight
    init is skipped (its truncated normal asks values of the tensor, which a fake tensor has none of)."""
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    if "_class_name" in config:
        return getattr(diffusers, config["_class_name"]).from_config(config)
    cls = getattr(transformers, config["architectures"][0])
    fields = {k: v for k, v in config.items() if k != "architectures"}
    with no_init_weights():
        return cls._from_config(cls.config_class(**fields))


def released_model(flavour_or_repo: str, component: str, **overrides: Any) -> Any:
    """`model_from_config` of a released config, with `overrides` of its top-level keys (a dry run's depth)."""
    return model_from_config(released_config(flavour_or_repo, component) | overrides)


def fake_mode() -> Any:
    """A FakeTensorMode for models built from these configs: real inputs (a batch, its draws) are taken as they are
    (the mode fakes them), and `nn.Module.to` works: torch memoizes each new fake tensor by a weak reference, and
    Module.to swaps fake parameters, which a weakly referenced tensor refuses; a fresh tensor needs no memo (its meta
    tensor is new: nothing can look it up), so this mode's converter keeps none for them."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fresh(fake_mode: FakeTensorMode, t: Any, device: Any, pytype: Any = None, dispatch_keys: Any = None) -> Any:
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)

    mode.fake_tensor_converter.from_meta_and_device = fresh
    return mode


KNOWN_NUMEL = 2**20  # the largest tensor whose values `known_values` keeps: masks and SigLIP's 729 x 1152 tokens


def known_values() -> Any:
    """A TorchDispatchMode, entered inside a `fake_mode()` (and inside any other mode, so it sees each op first),
    that answers the value questions a model asks of fake tensors (HunyuanVideo 1.5: `torch.all(image_embeds == 0)`
    and `text[text_mask]`) from values the caller knows: beside each fake tensor of at most KNOWN_NUMEL elements
    computed only from known tensors (a real input: the batch the caller built; a factory: zeros, ones; not empty
    memory nor a random draw) it keeps the real tensor it would be, computing that op for real too. A scalar read
    (`_local_scalar_dense`, `is_nonzero`) or `nonzero` of a known tensor returns its real answer, and a known boolean
    index becomes its real long indices, so the result has its real shape. Exact, not assumed: the answer is the one
    a real run of the same batch gets. A question about a tensor computed from the model's weights is not answered
    (it raises as before), and a write of an unknown value into a known tensor forgets the tensor's storage."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_map

    aten = torch.ops.aten
    answers = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default}

    def unknowable(func: Any) -> bool:
        """Uninitialized memory and random draws: a real run's values differ from any computed here."""
        return (torch.Tag.nondeterministic_seeded in func.tags
                or func._overloadpacket.__name__ in ("empty", "empty_like", "empty_strided", "new_empty"))

    class KnownValues(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.values: dict[int, torch.Tensor] = {}  # id(fake tensor) -> its real value
            self.forgotten: set[int] = set()  # storages written with an unknown value

        def value(self, t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if not isinstance(t, FakeTensor):
                return t  # the caller's real tensor
            if t.untyped_storage()._cdata in self.forgotten:
                return None
            return self.values.get(id(t))

        def keep(self, fake: Any, real: Any) -> None:
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and isinstance(fake, FakeTensor):
                self.values[id(fake)] = real
                weakref.finalize(fake, self.values.pop, id(fake), None)

        def real(self, func: Any, args: tuple, kwargs: dict) -> Any:
            with _disable_current_modes():
                return func(*tree_map(self.value, args), **tree_map(self.value, kwargs))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            known = not unknowable(func) and all(self.value(t) is not None for t in tensors)
            if func in answers and known:
                real = self.real(func, args, kwargs)
                if not isinstance(real, torch.Tensor):
                    return real
                out = aten.clone.default(real)  # the fake mode below makes it a fake of the real shape
                self.keep(out, real)
                return out
            if func is aten.index.Tensor:  # known boolean masks -> their real long indices (real inputs: allowed)
                indices = []
                for i in args[1]:
                    mask = self.value(i) if i is not None and i.dtype == torch.bool else None
                    with _disable_current_modes():
                        indices += list(mask.nonzero(as_tuple=True)) if mask is not None else [i]
                args = (args[0], indices)
            out = func(*args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if known and all(t.numel() <= KNOWN_NUMEL for t in outs):
                for fake, real in zip(tree_flatten(out)[0], tree_flatten(self.real(func, args, kwargs))[0]):
                    self.keep(fake, real)
            elif func._schema.is_mutable:
                written = [a for s, a in zip(func._schema.arguments, args) if s.alias_info and s.alias_info.is_write]
                self.forgotten |= {t.untyped_storage()._cdata for t in written if isinstance(t, FakeTensor)}
            return out

    return KnownValues()
