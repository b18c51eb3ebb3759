"""Where a checkpoint's components are read from: a local diffusers folder, or a Hugging Face repository resolved into
the standard Hugging Face cache (downloaded when online, read from the cache under HF_HUB_OFFLINE=1).

Of a repository only the components the flavour needs are fetched, and of those only configs, tokenizer files and
safetensors weights: never pickled weights (.bin, .pt, .ckpt) and never code (.py), so no remote code can run.
Components may also come from folders elsewhere (`vae_path`, `text_encoder_path`, `vision_encoder_path`, and for
HunyuanVideo 1.5 the guide's HUNYUANVIDEO_*_PATH variables), checked and fingerprinted like the checkpoint's own.

Fingerprints (part of every latent and text key): a local folder's are its files' names, sizes and mtimes (as
always); a repository's are its commit hash and the component's file names and sizes, so moving the cache never
re-encodes anything and a new revision always does.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loraflow.keys import content_key, directory_fingerprint
from loraflow.pipelines.flavours import Flavour
from loraflow.safetensors_header import UnreadableSafetensors, read_header

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What a component folder is fetched with: configs, tokenizer files (vocab, merges, sentencepiece, chat template),
# safetensors weights. Everything else in a repository stays there.
FETCHED = (".json", ".safetensors", ".txt", ".jinja", ".model")
UNREAD_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack")  # pickles, TF and Flax weights
# Config keys naming a component folder from elsewhere -> the component it replaces.
FOLDER_KEYS = {"vae_path": "vae", "text_encoder_path": "text_encoder", "vision_encoder_path": "image_encoder"}


class ModelChoice(Protocol):
    """The config keys that say where the model is (the config model imports this package, never the reverse)."""

    model_family: str
    model_flavour: str | None
    pretrained_model_name_or_path: str
    revision: str | None
    vae_path: str | None
    text_encoder_path: str | None
    vision_encoder_path: str | None

    @property
    def flavour(self) -> Flavour: ...


@dataclass(frozen=True)
class ModelSource:
    """A diffusers-layout root (a local folder or a snapshot in the HF cache) and components from elsewhere."""

    root: Path
    repo_id: str | None = None  # set when root is a snapshot of this repository
    commit: str | None = None  # the snapshot's commit hash
    folders: tuple[tuple[str, Path], ...] = ()  # (component, folder) from elsewhere; a tuple keeps it hashable

    def folder(self, component: str) -> Path:
        return dict(self.folders).get(component, self.root / component)

    def fingerprint(self, component: str) -> str:
        folder = self.folder(component)
        if self.repo_id is None or component in dict(self.folders):  # a local folder: the keys it always had
            return content_key(component=component, files=directory_fingerprint(folder))
        files = [{"path": f.relative_to(folder).as_posix(), "size": f.stat().st_size} for f in _files(folder)]
        return content_key(component=component, repo=self.repo_id, revision=self.commit, files=files)

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.commit} ({self.root})" if self.repo_id else str(self.root)


def as_source(model: ModelSource | str | Path) -> ModelSource:
    """A local checkpoint folder is a source as it is."""
    return model if isinstance(model, ModelSource) else ModelSource(Path(model))


def is_hub_id(spec: str) -> bool:
    """`org/name` that is no existing path, as diffusers' from_pretrained tells them apart."""
    return bool(HUB_ID.fullmatch(spec)) and not Path(spec).expanduser().exists()


def model_source(choice: ModelChoice, download: bool = True) -> ModelSource:
    """The config's model; a repository is first downloaded into the HF cache (offline, or without `download`: only
    read from it). Checked before any stage imports or reads a component of it (`check_layout`)."""
    flavour = choice.flavour
    folders = component_folders(choice, flavour)
    spec, revision = choice.pretrained_model_name_or_path, choice.revision
    if not is_hub_id(spec):
        source = ModelSource(Path(spec), folders=tuple(folders.items()))
    else:
        wanted = tuple(c for c in flavour.components if c not in folders)
        if download and not hub_offline():
            root = _download(spec, revision, wanted, flavour.repo, hub_cache())
        else:
            root = _cached_snapshot(spec, revision, wanted, hub_cache())
        problem = layout_problem(_named(spec, revision), _relative_files(root), wanted, flavour.repo)
        if problem:
            raise FileNotFoundError(problem)
        source = ModelSource(root, spec, root.name, tuple(folders.items()))
    if (source.root / "model_index.json").is_file():  # else there is nothing to load (model_index() says so)
        check_layout(source, flavour)
    return source


@dataclass(frozen=True)
class ComponentStatus:
    """What `loraflow check` says of one component before any work: where it is, and what a run would download."""

    component: str
    where: str  # a folder, or repo@revision
    state: str  # local | cached | download | missing
    size: int | None  # bytes on disk; for `download`, bytes to download; None: unknown


def component_status(choice: ModelChoice) -> list[ComponentStatus]:
    """Each component the flavour needs, without downloading (online, the Hub is asked what a run would fetch)."""
    flavour = choice.flavour
    folders = component_folders(choice, flavour)
    spec, revision = choice.pretrained_model_name_or_path, choice.revision
    wanted = tuple(c for c in flavour.components if c not in folders)
    elsewhere = [_on_disk(c, folder, "local") for c, folder in folders.items()]
    if not is_hub_id(spec):
        return [_on_disk(c, Path(spec) / c, "local") for c in wanted] + elsewhere
    named = _named(spec, revision)
    if hub_offline():
        try:
            root = _cached_snapshot(spec, revision, wanted, hub_cache())
        except FileNotFoundError:
            return [ComponentStatus(c, named, "missing", None) for c in wanted] + elsewhere
        return [_on_disk(c, root / c, "cached", named) for c in wanted] + elsewhere
    from huggingface_hub import snapshot_download

    _refuse_unusable(spec, revision, wanted, flavour.repo)
    with _hub_answers(spec, revision, wanted):
        planned = snapshot_download(spec, revision=revision, allow_patterns=fetched_patterns(wanted),
                                    cache_dir=hub_cache(), dry_run=True)
    rows = []
    for c in wanted:
        files = [f for f in planned if f.filename.startswith(f"{c}/")]
        fetch = [f for f in files if f.will_download]
        rows.append(ComponentStatus(c, named, "download" if fetch else "cached",
                                    sum(f.file_size or 0 for f in fetch or files)))
    return rows + elsewhere


def _on_disk(component: str, folder: Path, state: str, where: str | None = None) -> ComponentStatus:
    if not folder.is_dir():
        return ComponentStatus(component, where or str(folder), "missing", None)
    return ComponentStatus(component, where or str(folder), state, sum(f.stat().st_size for f in _files(folder)))


def hub_cache() -> str:
    """HF_HUB_CACHE as the environment says now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def hub_offline() -> bool:
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.upper() in constants.ENV_VARS_TRUE_VALUES


def fetched_patterns(components: tuple[str, ...]) -> list[str]:
    """snapshot_download's allow_patterns: the index, and each component's configs, tokenizer files, safetensors."""
    return ["model_index.json", *(f"{c}/*{suffix}" for c in components for suffix in FETCHED)]


def _cached_snapshot(repo: str, revision: str | None, components: tuple[str, ...], cache: str) -> Path:
    """The snapshot huggingface_hub finds in the cache for this revision (refs/<branch> or a commit), no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=fetched_patterns(components),
                                      cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        offline = "; HF_HUB_OFFLINE is set: run once online, or" if hub_offline() else ": run the stages, or"
        raise FileNotFoundError(f"{_named(repo, revision)} is not in the Hugging Face cache ({cache}){offline} "
                                f"{_download_command(repo, components)}") from None


def _download_command(repo: str, components: tuple[str, ...]) -> str:
    return (f"`hf download {repo}` with --include for {', '.join(components)} (*.json, *.safetensors and tokenizer "
            "files)")


class HubUnreachable(ConnectionError):
    """The Hugging Face Hub did not answer (no network, a proxy, a firewall): one message, printed without a
    traceback, naming the repository, the cache and the two ways out."""

    def __init__(self, repo: str, revision: str | None, components: tuple[str, ...], cache: str, error: Exception):
        from huggingface_hub import constants

        super().__init__(
            f"the Hugging Face Hub ({constants.ENDPOINT}) did not answer for {_named(repo, revision)} "
            f"({type(error).__name__}: {error}). Either download it where the Hub is reachable, "
            f"{_download_command(repo, components)}, into the Hugging Face cache ({cache}, or copy that cache here), "
            "then run with HF_HUB_OFFLINE=1; or set `pretrained_model_name_or_path` to a local diffusers-layout folder")


@contextmanager
def _hub_answers(repo: str, revision: str | None, components: tuple[str, ...]) -> Iterator[None]:
    """Every call to the Hub goes through here: a connection that fails or times out (HF_HUB_ETAG_TIMEOUT seconds,
    no retries) becomes HubUnreachable."""
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub.errors import DryRunError, LocalEntryNotFoundError

    try:
        yield
    # DryRunError, LocalEntryNotFoundError: what snapshot_download raises online when its own listing failed
    except (httpx2.TransportError, DryRunError, LocalEntryNotFoundError) as exc:
        raise HubUnreachable(repo, revision, components, hub_cache(), exc) from None


@functools.lru_cache(maxsize=8)
def _download(repo: str, revision: str | None, components: tuple[str, ...], flavour_repo: str | None,
              cache: str) -> Path:
    """Download what the cache lacks of `components` (once per process: a branch cannot move under a running
    stage)."""
    from huggingface_hub import snapshot_download

    _refuse_unusable(repo, revision, components, flavour_repo)
    with _hub_answers(repo, revision, components):
        return Path(snapshot_download(repo, revision=revision, allow_patterns=fetched_patterns(components),
                                      cache_dir=cache))


def _refuse_unusable(repo: str, revision: str | None, components: tuple[str, ...], flavour_repo: str | None) -> None:
    """From the repository's file list on the Hub: a repository that cannot be used fails before any download."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:
        # one request, bounded, never retried (list_repo_files retries a refused connection for 23 s)
        with _hub_answers(repo, revision, components):
            info = HfApi().model_info(repo, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        files = [s.rfilename for s in info.siblings or []]
    except HfHubHTTPError as exc:  # no such repo or revision, gated, private: as diffusers, no such folder either
        raise FileNotFoundError(f"{_named(repo, revision)} is neither a folder here nor a Hugging Face repository "
                                f"this machine can read ({type(exc).__name__}; gated or private: `hf auth login`)"
                                ) from None
    problem = layout_problem(_named(repo, revision), files, components, flavour_repo)
    if problem:
        raise FileNotFoundError(problem)


def layout_problem(named: str, files: list[str], components: tuple[str, ...], flavour_repo: str | None) -> str:
    """Why a repository's file list (relative paths) cannot give `components` ("" when it can)."""
    instead = f": use the flavour's diffusers-format repository {flavour_repo}" if flavour_repo else ""
    if "model_index.json" not in files:
        return f"{named} is not in the diffusers layout (no model_index.json){instead}"
    by_component = {c: [f for f in files if f.startswith(f"{c}/")] for c in components}
    missing = [c for c, listed in by_component.items() if not listed]
    if missing:
        return f"{named} lacks component(s) {', '.join(missing)}{instead}"
    for component, listed in by_component.items():
        problem = weights_problem(f"{named} {component}/", listed)
        if problem:
            return problem
    return ""


def weights_problem(where: str, files: list[str]) -> str:
    """A folder whose weights are only in formats loraflow never reads (pickles can run code when loaded)."""
    unread = [Path(f).name for f in files if f.endswith(UNREAD_WEIGHTS)]
    if unread and not any(f.endswith(".safetensors") for f in files):
        return (f"{where} holds weights only as {', '.join(sorted(unread)[:3])}: loraflow reads safetensors only "
                "(a pickled checkpoint can run code when loaded); convert it with safetensors, or use a repository "
                "that ships .safetensors")
    return ""


def folder_problem(key: str, folder: str | Path) -> str:
    """Why a component folder from elsewhere cannot be loaded ("" when it can): a model's config and safetensors."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return f"`{key}` {folder} is not a folder"
    files = [f.name for f in path.iterdir() if f.is_file()]
    if "config.json" not in files:
        return f"`{key}` {folder} holds no config.json: point it at a component folder (config.json + safetensors)"
    problem = weights_problem(f"`{key}` {folder}", files)
    if problem or any(f.endswith(".safetensors") for f in files):
        return problem
    return f"`{key}` {folder} holds no .safetensors weights"


def component_folders(choice: ModelChoice, flavour: Flavour) -> dict[str, Path]:
    """Components from elsewhere: the config's keys, else (HunyuanVideo 1.5) the guide's environment variables."""
    named = {component: (key, getattr(choice, key)) for key, component in FOLDER_KEYS.items() if getattr(choice, key)}
    for component, variable in flavour.folder_variables:
        if component not in named and os.environ.get(variable) and component in flavour.components:
            named[component] = (f"${variable}", os.environ[variable])
    folders = {}
    for component, (key, folder) in named.items():
        problem = folder_problem(key, folder) or unused_problem(key, component, flavour)
        if problem:
            raise FileNotFoundError(problem)
        folders[component] = Path(folder).expanduser()
    return folders


def unused_problem(key: str, component: str, flavour: Flavour) -> str:
    if component in flavour.components:
        return ""
    return f"`{key}` names a {component}, which flavour '{flavour.name}' does not use: remove it"


def _named(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _relative_files(root: Path) -> list[str]:
    return [f.relative_to(root).as_posix() for f in _files(root)]


def model_index(model: ModelSource | str | Path) -> dict[str, Any]:
    index = as_source(model).root / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{model} is not a diffusers checkpoint folder (no model_index.json). Point "
            "`pretrained_model_name_or_path` at a local folder laid out like the Hugging Face repo, "
            "or at the repo's id."
        )
    return json.loads(index.read_text())


class ModelRefused(ValueError):
    """A model whose components loraflow will not load; `problems` names each, with what to do."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def check_layout(model: ModelSource | str | Path, flavour: Flavour) -> None:
    """Fail before anything is imported or read, naming every problem: a component the flavour needs is missing
    (FileNotFoundError), or one cannot be loaded (`ModelRefused`, `component_problems`)."""
    source = as_source(model)
    index = model_index(source)
    missing = [c for c in flavour.components if not source.folder(c).is_dir() or index.get(c, [None])[0] is None]
    if missing:
        raise FileNotFoundError(
            f"{source} lacks component(s) {', '.join(missing)} that flavour '{flavour.name}' needs "
            f"(expected sub-folders: {', '.join(flavour.components)})"
        )
    problems = [p for c in flavour.components for p in component_problems(source, c, index[c], flavour)]
    if not problems and (problem := transformer_problem(source.folder("transformer") / "config.json", flavour)):
        problems.append(f"{source}: {problem}")
    if problems:
        raise ModelRefused(problems)


def transformer_problem(config: Path | Mapping[str, Any], flavour: Flavour) -> str:
    """Why the flavour cannot run this transformer config (a config.json, or its contents):
    `Flavour.transformer_problem` ("" it can, or the flavour asks nothing, or there is no config.json to read)."""
    if flavour.transformer_problem is None:
        return ""
    if isinstance(config, Path):
        try:
            config = json.loads(config.read_text())
        except (OSError, ValueError):  # none, or unreadable: the component's own checks say so
            return ""
    return flavour.transformer_problem(config) if isinstance(config, Mapping) else ""


def component_problems(source: ModelSource, component: str, entry: Any, flavour: Flavour) -> list[str]:
    """Why one component cannot be loaded ([] when it can): its model_index.json entry names a class the flavour
    does not load (the entry picks the Python module and class from_pretrained imports: nothing else is imported);
    its folder holds weights only as pickles; its config.json is unreadable or past its family's released sizes
    (`released.size_problems`); a .safetensors header does not describe its file."""
    found = ".".join(entry) if isinstance(entry, list) and all(isinstance(e, str) for e in entry) else repr(entry)
    expected = flavour.classes.get(component, ())
    if found not in expected:
        return [f"{source} {component}: model_index.json names {found}; flavour '{flavour.name}' loads "
                f"{' or '.join(expected) or 'no class declared for it'} (that entry picks the Python class loraflow "
                "imports, so no other is imported): point `pretrained_model_name_or_path` at a checkpoint of this "
                "family, or set `model_family` to the one the checkpoint is for"]
    files = _files(source.folder(component))
    problem = weights_problem(f"{source} {component}/", [f.name for f in files])
    if problem:
        return [problem]
    problems = config_problems(source.folder(component) / "config.json", flavour, component)
    for file in files:
        if file.suffix == ".safetensors":
            try:
                read_header(file)
            except UnreadableSafetensors as exc:
                problems.append(str(exc))
    return problems


def config_problems(path: Path, flavour: Flavour, component: str) -> list[str]:
    """Why a component's config.json cannot be built from ([] when it can, or when the component has none)."""
    from loraflow.pipelines.released import read_model_config, size_problems

    if not path.is_file():
        return []
    try:
        return size_problems(read_model_config(path), path, flavour.name, component)
    except ValueError as exc:
        return [str(exc)]
