"""Fake tensors for real-size work without memory: build a diffusers/transformers model from its config.json (or a
released checkpoint's: `released_model`) on the meta device or under a fake mode, run the real code on it, answer the
few value questions a forward asks of its batch (`known_values`), and count the bytes and FLOPs of what runs
(`measured_step`). Knows no model family: the released-size dry runs (tests/pipelines/test_released_dry_runs.py) and
the memory estimates (the rest of `loraflow.estimates`) both stand on it."""

from __future__ import annotations

import importlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class ConfigRefused(ValueError):
    """A component's config.json that its own class will not build (a value the library rejects): names the class
    (`class_name`) and the library's words."""

    def __init__(self, cls: type, error: Exception) -> None:
        self.class_name = cls.__name__
        super().__init__(f"the {cls.__module__.split('.')[0]} class {cls.__name__} refuses it "
                         f"({type(error).__name__}: {str(error)[:300]})")


# what a library's class raises of a config it cannot build (a KeyError: an unknown rope_type, a TypeError: a list
# where a number goes, ...)
_REFUSALS = (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError, ZeroDivisionError)


@contextmanager
def building(cls: type) -> Iterator[None]:
    """Building `cls` from a config: what it raises of the config becomes `ConfigRefused`."""
    try:
        yield
    except _REFUSALS as exc:
        raise ConfigRefused(cls, exc) from None


def model_class(component_config: Mapping[str, Any]) -> type:
    """The class a component's config.json names (`_class_name` for diffusers, `architectures[0]` for
    transformers)."""
    if "_class_name" in component_config:
        return getattr(importlib.import_module("diffusers"), component_config["_class_name"])
    return getattr(importlib.import_module("transformers"), component_config["architectures"][0])


def meta_model(component_config: Mapping[str, Any], dtype: torch.dtype, adapter: Any = None,
               fp8: bool = False) -> torch.nn.Module:
    """The component built from its config on the meta device (no memory) as training loads it: in `dtype` with its
    `_keep_in_fp32_modules` kept fp32 (what from_pretrained does), `fp8`: diffusers' layerwise casting to
    float8_e4m3fn storage, then `adapter` (a function that adds one to the model: training's `add_adapter`) with
    its trainable parameters (peft's own notion: those it leaves requiring grad) in fp32."""
    import torch

    cls = model_class(component_config)
    config = {k: v for k, v in component_config.items() if not k.startswith("_")}
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    with torch.device("meta"):
        with building(cls):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(cls.config_class(**config))
        for module_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point() and not keep & set(module_name.split(".")):
                    module._parameters[name] = torch.nn.Parameter(p.to(dtype), requires_grad=False)
        model.requires_grad_(False)  # the kept fp32 modules too: only an adapter's parameters train
        if fp8:
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        if adapter is not None:
            adapter(model)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def fake_model(model: torch.nn.Module, mode: Any, device: str = "cpu") -> torch.nn.Module:
    """`model` (a `meta_model`) with each parameter, buffer and plain tensor attribute (Kandinsky 5 keeps its time
    frequencies as one) replaced by a fake tensor of its shape and dtype on `device`, the adapter's parameters
    trainable and the rest frozen (as `meta_model` left them): ops on it run the real code at no memory. (peft
    cannot add an adapter to a model built under FakeTensorMode, hence the meta step; nor can a module be moved or
    cast there, so layerwise casting is counted on the meta model only.)"""
    import torch

    with mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                                  requires_grad=p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
            for name, t in list(vars(module).items()):
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    setattr(module, name, torch.empty(t.shape, dtype=t.dtype, device=device))
    return model


def tensor_bytes(tensors: Any) -> int:
    """Bytes of distinct storages (a tied weight counts once)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def op_leaves(tree: Any) -> list:
    """The leaves of an op's arguments or outputs (nested lists, tuples and dicts; the rest are leaves), in the order
    torch's `tree_flatten` gives them: what the dispatch modes below look at on every op of a trace, where pytree's
    general flatten (namedtuples, registered nodes: which aten ops neither take nor return) took a tenth of a
    released-size trace (py-spy: 4.5 of 43 s in Kandinsky 5 Pro's check)."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in op_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in op_leaves(item)]
    return [tree]


# What `StepCounter` counts, each as bytes alive now and at most: on the device, on the host, and the two in place
COUNTS = DEVICE, HOST, DEVICE_IN_PLACE, HOST_IN_PLACE = range(4)


def _counter_mode() -> type:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from loraflow.training.flops import flop_formulas

    formulas = flop_formulas()
    attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    convolution, to_copy = torch.ops.aten.convolution, torch.ops.aten._to_copy.default

    class StepCounter(TorchDispatchMode):
        """Bytes of the storages alive now and at most, from every storage an op returns (each counted once,
        uncounted when it is freed), and the FLOPs of every op torch's flop counter has a formula for. Works on
        real and fake tensors alike: what the allocator would hold, without its rounding. `existing` tensors (the
        model's) are never counted, not even when an op returns a view of them (a weight's transpose in every
        linear). Storages on the meta device are host memory (`HOST`, apart): the fake step's activation offload
        holds its copies there (kernels/checkpointing.py). (FlopCounterMode itself is not used: its module hooks
        keep recomputed activations alive under gradient checkpointing, which would be counted.)

        Beside, the same step counted in place (`DEVICE_IN_PLACE`, `HOST_IN_PLACE`): each copy between the host and
        the device is the tensor it copies, held as long as that tensor or any copy of it is, which is what the
        step without activation offload holds (its checkpoints keep the blocks' inputs themselves, the recompute
        reads them and their gradients pass on uncopied): one trace counts a step with and without it."""

        def __init__(self, existing: Iterable[Any] = (), device_type: str = "cuda") -> None:
            super().__init__()
            self.device_type = device_type
            self.now, self.peak = [0] * len(COUNTS), [0] * len(COUNTS)  # bytes alive, most alive: per COUNTS
            self.flops = 0
            # keyed by the C storage: views (and fake tensors' storage objects) share it; value: (bytes, count)
            self.live: dict[int, tuple[int, int]] = {t.untyped_storage()._cdata: (0, DEVICE) for t in existing}
            # in place: each storage belongs to a group (itself, or what it is a copy of), counted while one is alive
            self.group: dict[int, int] = dict.fromkeys(self.live, 0)  # storage -> group; 0: never counted
            self.groups: dict[int, list] = {0: [0, DEVICE_IN_PLACE, 1]}  # group -> [bytes, count, storages alive]
            self.group_ids = itertools.count(1)  # not the storage's key: freed, another storage may take it

        def add(self, count: int, n: int) -> None:
            self.now[count] += n
            self.peak[count] = max(self.peak[count], self.now[count])

        def track(self, t: Any, copied: Any = None) -> None:
            """Count `t`'s storage if it is new; `copied`: the tensor `t` is a copy of between host and device."""
            if not hasattr(t, "untyped_storage"):
                return
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live:
                return
            n, on_host = storage.nbytes(), t.device.type == "meta"
            self.live[key] = n, HOST if on_host else DEVICE
            self.add(self.live[key][1], n)
            if copied is not None:  # held in place by the storage it copies (an untracked one: never counted)
                self.group[key] = self.group.get(copied.untyped_storage()._cdata, 0)
                self.groups[self.group[key]][2] += 1
            else:
                self.group[key] = group = next(self.group_ids)
                self.groups[group] = [n, HOST_IN_PLACE if on_host else DEVICE_IN_PLACE, 1]
                self.add(self.groups[group][1], n)
            weakref.finalize(storage, self._free, key)

        def _free(self, key: int) -> None:
            n, count = self.live.pop(key)
            self.now[count] -= n
            group = self.group.pop(key)
            held = self.groups[group]
            held[2] -= 1
            if not held[2]:
                del self.groups[group]
                self.now[held[1]] -= held[0]

        def beside(self, workspace: int) -> None:
            """A kernel's `workspace`, which no op returns, allocated beside the tensors alive now."""
            for count in (DEVICE, DEVICE_IN_PLACE):
                self.peak[count] = max(self.peak[count], self.now[count] + workspace)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if func._overloadpacket is attention_backward:  # its workspace lives while it runs
                self.beside(attention_workspace(args[1], args[2], self.device_type))
            out = func(*args, **kwargs)
            if func._overloadpacket in formulas:
                self.flops += formulas[func._overloadpacket](*args, **kwargs, out_val=out)
            if func is to_copy and (args[0].device.type == "meta") != (out.device.type == "meta"):
                self.track(out, copied=args[0])
            for t in op_leaves(out):
                self.track(t)
            if func._overloadpacket is convolution and self.device_type == "cpu":  # beside its output
                self.beside(conv3d_columns(args[1], out))
            return out

    return StepCounter


def attention_workspace(query: torch.Tensor, key: torch.Tensor, device_type: str) -> int:
    """Bytes an attention backward allocates inside itself, which no op returns. Both FlashAttention-2 on CUDA
    (`dq_accum`) and torch's CPU flash kernel accumulate dQ in an fp32 buffer of the query's shape (B, H, N_q, d):
    4 * B * H * N_q * d. The CPU kernel adds per thread two fp32 tiles (scores and their gradient) of
    q_split x kv_split, q_split = 256 / 64 / 32 for N_q >= 768 / >= 192 / less and kv_split = min(512, N_kv) (the
    split sizes aten's dispatcher passes it). Measured against the CPU allocator (fp32, 1 and 2 threads, N_q from
    100 to 4096, N_q != N_kv): exact to 128 bytes; bf16 inputs take about 8% more (reduced-precision copies,
    left out)."""
    import torch

    batch, heads, n_q, dim = query.shape
    workspace = 4 * batch * heads * n_q * dim
    if device_type == "cpu":
        q_split = 256 if n_q >= 768 else 64 if n_q >= 192 else 32
        workspace += torch.get_num_threads() * 2 * min(q_split, n_q) * min(512, key.shape[2]) * 4
    return workspace


def conv3d_columns(weight: torch.Tensor, out: torch.Tensor) -> int:
    """Bytes of the column buffer torch's CPU 3D convolution (slow_conv3d) unfolds its input into, which no op
    returns: B * (C_in / groups) * kT * kH * kW * output voxels, in the input's dtype (measured: exact against the
    CPU allocator). 0 for 2D convolutions and on CUDA, where cuDNN keeps its workspace within its own limit (left
    out)."""
    if weight.dim() != 5:
        return 0
    return out.shape[0] * weight[0].numel() * out[0, 0].numel() * weight.element_size()


class NotFakeable(Exception):
    """The model's forward reads tensor values that `known_values` cannot answer (values computed from the model's
    weights), which fake tensors do not have."""


class Measured(NamedTuple):
    """What `measured_step` counts: the peak bytes of the tensors a step makes and of the attention backward's
    workspace on the device, TFLOP, the peak bytes it holds in host memory (on the meta device); and the peaks of
    the same step with every copy between host and device in place (`StepCounter`): without activation offload."""

    peak: int
    tflop: float
    host: int
    peak_in_place: int
    host_in_place: int


def measured_step(fn: Callable[[], Any], mode: Any, model: torch.nn.Module, device_type: str = "cuda",
                  repeated: Iterable[torch.nn.Module] = ()) -> Measured:
    """Run `fn` under the fake `mode` and count it (`Measured`), `model`'s own tensors not counted. Each module of
    `repeated` runs once per distinct input shape (`measured_once`)."""
    from contextlib import ExitStack

    from torch._subclasses.fake_tensor import DataDependentOutputException

    counter = _counter_mode()([*model.parameters(), *model.buffers()], device_type)
    try:
        # known_values answers from the batch `fn` builds what a forward asks of values (HV1.5: its image and
        # text masks); innermost, so the counter counts what it returns as any op's output
        with mode, counter, known_values(), ExitStack() as once:
            for module in repeated:
                once.enter_context(measured_once(module, counter))
            fn()
    except DataDependentOutputException as exc:
        raise NotFakeable(f"not estimated yet: {type(model).__name__}'s forward reads tensor values ({exc.func}), "
                          "which fake tensors do not have") from None
    peak = counter.peak
    return Measured(peak[DEVICE], counter.flops / 1e12, peak[HOST], peak[DEVICE_IN_PLACE], peak[HOST_IN_PLACE])


class _Shape:
    """A tensor's shape, dtype and device: a pytree leaf (a named tuple would be a node)."""

    def __init__(self, shape: Any, dtype: Any, device: Any) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device


@contextmanager
def measured_once(module: torch.nn.Module, counter: Any) -> Iterator[None]:
    """While inside, `module` runs for real once per distinct input (the shapes, strides and dtypes of its tensor
    arguments, its other arguments as they are): what that call added is kept (its peak above the bytes alive when
    it was called, on the device and on the host, and its FLOPs), and a later call with the same input adds that
    peak to the bytes alive then, adds the same FLOPs again and returns new empty tensors of the outputs' shapes.
    Exact for a no-grad call of a module whose allocations and ops depend on its input's shapes alone (a VAE's
    encoder or decoder on one tile): a tiled encode or decode calls it once per tile, dozens of times at released
    size, each call seconds of Python on fake tensors."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    own = module.__dict__.get("forward")  # an instance's own forward (patch conv's), else the class's
    original, seen = module.forward, {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        key = tuple((tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t
                    for t in tree_flatten((args, kwargs))[0])
        if key in seen:
            peaks, flops, shapes = seen[key]
            counter.peak[:] = [max(peak, now + added) for peak, now, added in zip(counter.peak, counter.now, peaks)]
            counter.flops += flops
            return tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)
                            if isinstance(t, _Shape) else t, shapes)
        entry, outer, flops_entry = list(counter.now), list(counter.peak), counter.flops
        counter.peak[:] = entry
        out = original(*args, **kwargs)
        # shapes only: keeping the output itself would keep its bytes alive in the count
        seen[key] = [peak - now for peak, now in zip(counter.peak, entry)], counter.flops - flops_entry, \
            tree_map(lambda t: _Shape(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t, out)
        counter.peak[:] = map(max, outer, counter.peak)
        return out

    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward  # the class's forward again
        else:
            module.forward = own


def model_from_config(config: dict[str, Any]) -> Any:
    """The real diffusers/transformers class built from a config.json dict on the current default device or fake
    mode (callers choose: `torch.device("meta")` or `fake_mode()`), for shapes, not values: transformers' weight
    init is skipped (its truncated normal asks values of the tensor, which a fake tensor has none of)."""
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    if "_class_name" in config:
        cls = getattr(diffusers, config["_class_name"])
        with building(cls):
            return cls.from_config(config)
    cls = getattr(transformers, config["architectures"][0])
    fields = {k: v for k, v in config.items() if k != "architectures"}
    with no_init_weights(), building(cls):
        return cls._from_config(cls.config_class(**fields))



def released_model(flavour_or_repo: str, component: str, **overrides: Any) -> Any:
    """`model_from_config` of a released config (`loraflow.pipelines.released`), with `overrides` of its top-level
    keys (a dry run's depth)."""
    from loraflow.pipelines.released import released_config

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


def known_values(limit: int = KNOWN_NUMEL) -> Any:
    """A TorchDispatchMode, entered inside a `fake_mode()` (and inside any other mode, so it sees each op first),
    that answers the value questions a model asks of fake tensors (HunyuanVideo 1.5: `torch.all(image_embeds == 0)`
    and `text[text_mask]`) from values the caller knows: beside each fake tensor of at most `limit` elements
    computed only from known tensors (a real input: the batch the caller built; a factory: zeros, ones; not empty
    memory nor a random draw) it keeps the real tensor it would be, computing that op for real too. A scalar read
    (`_local_scalar_dense`, `is_nonzero`) or `nonzero` of a known tensor returns its real answer, and a known boolean
    index becomes its real long indices, so the result has its real shape. Exact, not assumed: the answer is the one
    a real run of the same batch gets. A question about a tensor computed from the model's weights is not answered
    (it raises as before), and a write of an unknown value into a known tensor forgets the tensor's storage."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_map

    aten = torch.ops.aten
    answers = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default}

    # per op overload, asked of every op a trace runs (once each: a schema's properties are C++ calls)
    unknowable: dict[Any, bool] = {}  # uninitialized memory and random draws: a real run's values differ
    written: dict[Any, tuple[int, ...]] = {}  # the positions of the arguments it writes (a mutable op's)

    def op_facts(func: Any) -> tuple[bool, tuple[int, ...]]:
        if func not in unknowable:
            unknowable[func] = (torch.Tag.nondeterministic_seeded in func.tags
                                or func._overloadpacket.__name__ in ("empty", "empty_like", "empty_strided",
                                                                     "new_empty"))
            written[func] = tuple(i for i, s in enumerate(func._schema.arguments)
                                  if s.alias_info and s.alias_info.is_write) if func._schema.is_mutable else ()
        return unknowable[func], written[func]

    class KnownValues(TorchDispatchMode):
        supports_higher_order_operators = True  # flex attention (NABLA) is one: see __torch_dispatch__

        def __init__(self) -> None:
            super().__init__()
            self.values: dict[int, torch.Tensor] = {}  # id(fake tensor) -> its real value
            self.forgotten: set[int] = set()  # storages written with an unknown value

        def value(self, t: Any) -> Any:
            if not isinstance(t, FakeTensor):
                return t  # not a tensor, or the caller's real tensor
            real = self.values.get(id(t))
            if real is None or t.untyped_storage()._cdata in self.forgotten:
                return None
            return real

        def keep(self, fake: Any, real: Any) -> None:
            if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                self.values[id(fake)] = real
                weakref.finalize(fake, self.values.pop, id(fake), None)

        def forget(self, storage: Any) -> None:
            # until the storage is freed: a later storage at the same address is another tensor's (a render's
            # scheduler timesteps were taken for its latents' and went unanswered, depending on the allocator)
            if storage._cdata not in self.forgotten:
                self.forgotten.add(storage._cdata)
                weakref.finalize(storage, self.forgotten.discard, storage._cdata)

        def real(self, func: Any, args: tuple, kwargs: dict) -> Any:
            if kwargs.get("device") == torch.device("meta"):  # the estimates' host memory (activation offload's
                kwargs = {k: v for k, v in kwargs.items() if k != "device"}  # copies): the values, where they are
            with _disable_current_modes():
                return func(*tree_map(self.value, args), **tree_map(self.value, kwargs))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):  # run by the modes below; its outputs unknown
                return func(*args, **kwargs)
            unknown, writes = op_facts(func)
            known = not unknown and all(self.value(t) is not None for t in op_leaves((args, kwargs))
                                        if isinstance(t, torch.Tensor))
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
            if known and all(t.numel() <= limit for t in op_leaves(out) if isinstance(t, torch.Tensor)):
                for fake, real in zip(op_leaves(out), op_leaves(self.real(func, args, kwargs))):
                    self.keep(fake, real)
            else:
                for i in writes:
                    if i < len(args) and isinstance(args[i], FakeTensor):
                        self.forget(args[i].untyped_storage())
            return out

    return KnownValues()


def fresh_saves() -> Any:
    """A context in which autograd saves, for each tensor a backward needs, a fresh fake tensor of its shape,
    strides and dtype instead of the tensor itself. Fake tensors have no values, so the backward computes the same
    shapes; but no saved view then references a parameter, so `Module.to` can swap the fake parameters (it must:
    a fake parameter's data cannot be set in place), which diffusers' layerwise casting does after each layer's
    forward. (torch.utils.checkpoint's recompute saves with its own hooks, inside this one: not covered.)"""
    import torch

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)

    return torch.autograd.graph.saved_tensors_hooks(fresh, lambda t: t)
