"""`loraflow`: what Dagster's CLI does not do well. Stage runs go through `dagster asset materialize`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loraflow.check_report import table
from loraflow.config import ConfigError, LoraflowConfig, load_config, parse_config
from loraflow.pipelines.sources import HubUnreachable

if TYPE_CHECKING:
    from loraflow.contracts.reports import CaptionsReport
    from loraflow.pipelines import FamilyPlan
    from loraflow.pipelines.sources import ModelSource
    from loraflow.stages.clips.buckets import LatentGeometry
    from loraflow.store import Store

DEMO_CONFIG = "configs/demo.yaml"
LORA_PATHS = ("lora_path", "comfyui_lora_path", "musubi_lora_path")  # the lora stage's files: diffusers, its twins


def prepare_demo(config_path: str = DEMO_CONFIG) -> None:
    """Build what the demo config points at: the tiny model and the generated dataset (idempotent). The dataset goes
    only into folders the demo owns (`demo.dataset.claim_folder`): a folder of someone's files is refused, naming it,
    before anything is written."""
    from loraflow.demo.dataset import FolderNotTheDemos, check_claimable, make_demo_dataset, make_demo_edits
    from loraflow.demo.tiny import build_tiny

    config = load_config(config_path)
    for dataset in config.training_datasets:  # every folder refused before anything is written or built
        sources = config.source_images(dataset)
        for entry in (dataset, *([sources] if sources else [])):
            try:
                if entry.instance_data_dir:  # a Hub dataset has no folder to write
                    check_claimable(entry.instance_data_dir)
            except FolderNotTheDemos as exc:
                raise FolderNotTheDemos(f"dataset '{entry.id}' of {config_path}: {exc}") from None
    build_tiny(config.model_family, config.pretrained_model_name_or_path, flavour=config.model_flavour, world=True)
    for dataset in config.training_datasets:
        sources = config.source_images(dataset)  # i2i: edit pairs, the sources in their own folder
        if sources is not None:
            make_demo_edits(dataset.instance_data_dir or "", sources.instance_data_dir or "")
        else:
            make_demo_dataset(dataset.instance_data_dir)


def run_demo(config_path: str) -> int:
    """Every stage: a partition and a `cache_dataset` run per dataset, then `train_and_validate`."""
    from loraflow.assets.jobs import materialize_everything
    from loraflow.assets.resources import LoraflowResource
    from loraflow.assets.runs.instance import home_instance

    try:
        prepare_demo(config_path)
    except ValueError as exc:  # the model folder holds another tiny checkpoint: what to delete, no traceback
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    with home_instance() as instance:
        # The resource names this config explicitly, whatever LORAFLOW_CONFIG says.
        results = materialize_everything(LoraflowResource(config_path=config_path), instance)
    if not results[-1].success:
        return 1
    print("\n".join(demo_summary(results)))
    config_env = "" if config_path == DEMO_CONFIG else f"LORAFLOW_CONFIG={config_path} "
    print(f"browse it: {config_env}make dev  (then open http://127.0.0.1:3000)")
    return 0


def demo_summary(results: list) -> list[str]:
    """One line per materialization (computed / reused), then where the LoRA (the diffusers file, the ComfyUI file
    for ComfyUI's models/loras, the musubi-tuner file for its --lora_weight), the video and its contact sheet (base
    frames over LoRA frames: the quickest look at what training did) are."""
    lines, paths = [], []
    for result in results:
        for event in result.get_asset_materialization_events():
            stage, meta = event.materialization.asset_key.path[-1], event.materialization.metadata
            where = f"[{event.partition}]" if event.partition else ""
            counts = {k: meta[k].value for k in ("computed", "reused") if k in meta}
            lines.append(f"{stage + where:>26}  computed {counts.get('computed', '-')}, "
                         f"reused {counts.get('reused', '-')}")
            paths += [f"{name}: {meta[name].value}" for name in LORA_PATHS + ("video",) if name in meta]
            if "video" in meta:  # validate() writes the sheet beside the renders
                paths.append(f"contact_sheet: {Path(meta['video'].value).with_name('contact_sheet.png')}")
    return lines + paths


def partitions(config_path: str) -> int:
    """Make the instance's `datasets` partitions the config's training datasets (what dataset_watch does)."""
    from loraflow.assets.partitions import sync_partitions
    from loraflow.assets.runs.instance import home_instance

    config = load_config(config_path)
    with home_instance() as instance:
        added, deleted = sync_partitions(instance, config)
        current = instance.get_dynamic_partitions("datasets")
    print(f"datasets partitions in {os.environ['DAGSTER_HOME']}: {', '.join(current) or 'none'} "
          f"(added: {', '.join(added) or 'none'}; deleted: {', '.join(deleted) or 'none'})")
    return 0


def check(config_path: str, estimate: bool = True) -> int:
    """Validate the config (every problem at once), say where each model component is and what a run would
    download, then plan buckets without loading a model."""
    from loraflow.check_report import print_estimates, print_shifts
    from loraflow.config.validation_adapters import adapter_problems
    from loraflow.contracts.clip_rows import changed_sources, changed_sources_warning
    from loraflow.pipelines import bucket_note, plan_family
    from loraflow.stages.clips.bucket_plan import human_bytes, plan_buckets
    from loraflow.store import CacheFileRefused, Store

    config = load_config(config_path)
    print(f"{config_path}: config ok ({config.model_family}, flavour {config.model_flavour or 'default'}, "
          f"{len(config.training_datasets)} training dataset(s))")
    family = plan_family(config)
    problems, source, geometry = model_problems(config, family)
    # a model folder that is there but refused is not built, not even on the meta device for an estimate
    refused = bool(problems) and (Path(config.pretrained_model_name_or_path) / "model_index.json").is_file()
    if source is not None and config.validation_size is not None:  # a local folder's was checked at load
        problem = family.validation_size_problem(source, *config.validation_size)
        problems += [problem] if problem else []
    problems += adapter_problems(config.validation_adapters_key, config.validation_adapters,
                                 None if source is None else source.folder("transformer"))
    plan = plan_buckets(config, family, geometry, source)
    problems += plan.problems
    rows = [(b.dataset, b.bucket, b.clips, human_bytes(b.frames_bytes), human_bytes(b.latent_bytes))
            for b in plan.buckets]
    print("\nbucket plan (WIDTHxHEIGHT@FRAMES; bytes of stored uint8 frames and float32 latents):")
    if note := bucket_note(family, source or config.pretrained_model_name_or_path):
        print(f"  {note}")
    print(table(rows, ("dataset", "bucket", "clips", "frames", "latents")) if rows else "  no clips")
    latent_total = None if geometry is None else sum(b.latent_bytes or 0 for b in plan.buckets)
    print(f"  total: {sum(b.clips for b in plan.buckets)} clip(s) in {len(plan.buckets)} bucket(s), frames "
          f"{human_bytes(sum(b.frames_bytes for b in plan.buckets))}, latents {human_bytes(latent_total)}"
          + ("" if geometry else " (unknown: no readable vae/config.json)"))
    if estimate and refused:
        print("\nestimates: left out until the model's problems below are fixed")
    elif estimate:
        problems += print_estimates(config, family, source, plan.buckets)
    print("\ncaption limits (a file past them is dropped):")
    for d in config.training_datasets:
        print(f"  {d.id}: at most {d.max_captions_per_file} caption(s) per file (max_captions_per_file), "
              f"{d.max_caption_chars} characters each (max_caption_chars)")
    if plan.clips:
        print(f"  one clip's text as the text encoder gets it: {plan.example_caption!r}")
    print_shifts(config, family, source)
    if config.train_audio and family.spec.compose_prompt is not None and plan.without_audio_caption:
        print(f"\nwarning: train_audio: {plan.without_audio_caption} of {plan.clips} clip(s) have no audio caption "
              "(NAME.audio.txt beside the file; the `audio_caption` column of a metadata_file): they train their "
              "sound with the plain caption, which does not describe it (docs/families.md, Kandinsky 6 captions)")
    store = Store(config.cache_dir, config.manifest_names)
    try:
        changed = changed_sources(store, config.dataset_folders)
        cached = cached_lists(config, store)
    except CacheFileRefused as exc:  # a truncated or foreign cache file crashed check
        problems.append(str(exc))
        changed, cached = [], ""
    if cached:
        print(f"\n{cached}")
    if plan.dropped:
        print(f"\ndropped {len(plan.dropped)} file(s):")
        print(table([(d.dataset, Path(d.file).name, d.reason, d.detail) for d in plan.dropped],
                    ("dataset", "file", "reason", "detail")))
    if changed:  # a warning, not a problem: training on the caches as they are is allowed
        print(f"\nwarning: {changed_sources_warning(changed)}")
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        print("\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    return 0


def cached_lists(config: LoraflowConfig, store: Store) -> str:
    """What the cache holds for these settings (each stage's lists of the config's names), or "" when it holds
    nothing yet: after a change of settings, which stages the next run makes anew."""
    stages = ["clips", "latents", *(["audio_latents"] if config.train_audio else [])]
    datasets = sorted(config.dataset_sources)
    listed = {stage: store.manifest_parts(stage) for stage in stages}
    text_set = store.fs.exists(store.manifest_file("text_embeds"))
    if not any(listed.values()) and not text_set and not store.fs.exists(store.root):
        return ""
    lines = [f"cached for these settings (cache_dir {config.cache_dir}):"]
    for stage, parts in listed.items():
        missing = [d for d in datasets if d not in parts]
        todo = (f"; not for {', '.join(missing)}: `loraflow cache CONFIG --dataset ID` (or the `cache_dataset` job) "
                "makes them") if missing else ""
        lines.append(f"  {stage}: {len(parts)} of {len(datasets)} dataset(s){todo}")
    lines.append(f"  text_embeds: {'made' if text_set else 'not yet: the `train_and_validate` job makes it'}")
    return "\n".join(lines)


def released_problems(config: LoraflowConfig, family: FamilyPlan) -> list[str]:
    """What the flavour cannot run in the released checkpoint's transformer config, before it is downloaded (the
    flavour's own repository only: another's config is unknown until it is on disk)."""
    from loraflow.pipelines.released import FLAVOURS, released_config
    from loraflow.pipelines.sources import transformer_problem

    flavour = family.flavour
    if flavour.name not in FLAVOURS or config.pretrained_model_name_or_path != flavour.repo:
        return []
    problem = transformer_problem(released_config(flavour.name, "transformer"), flavour)
    return [f"{flavour.repo} (released config, loraflow/pipelines/released/): {problem}"] if problem else []


def model_problems(config: LoraflowConfig, family: FamilyPlan) -> tuple[list[str], ModelSource | None,
                                                                          LatentGeometry | None]:
    """Print a table of the model's components (where, cached or not, size, what a run downloads) and return the
    problems, the model when it is on disk, and its VAE geometry (None: unknown until downloaded)."""
    from loraflow.pipelines.sources import ModelRefused, check_layout, component_status, model_source
    from loraflow.stages.clips.bucket_plan import human_bytes
    from loraflow.stages.clips.buckets import latent_geometry

    try:
        statuses = component_status(config)
    except FileNotFoundError as exc:  # offline, not in the cache: what the released config says, too
        return [str(exc), *released_problems(config, family)], None, None
    print(f"\nmodel {config.pretrained_model_name_or_path}" + (f" @ {config.revision}" if config.revision else ""))
    print(table([(s.component, s.state, human_bytes(s.size), s.where) for s in statuses],
                ("component", "state", "size", "from")))
    fetched = sum(s.size or 0 for s in statuses if s.state == "download")
    if fetched:  # nothing wrong: the first stage that needs the model downloads it
        print(f"  a run downloads {human_bytes(fetched)} into the Hugging Face cache (configs, tokenizers, "
              "safetensors)")
        return released_problems(config, family), None, None
    try:
        source = model_source(config, download=False)
        check_layout(source, family.flavour)  # components there, of the classes the flavour loads, readable
    except ModelRefused as exc:
        return exc.problems, None, None
    except FileNotFoundError as exc:  # not on disk: what the released config says, too
        return [str(exc), *released_problems(config, family)], None, None
    return [], source, latent_geometry(source, family)


def cache(config_path: str, dataset: str, workers: int, shard: str | None) -> int:
    """Cache one dataset with `workers` local latents workers (stages/shard_worker.py), or be the worker of one
    `shard`."""
    from loraflow.keys import Shard
    from loraflow.pipelines import get_family
    from loraflow.pipelines.sources import model_source
    from loraflow.stages import shard_worker as fanout

    if workers < 1:
        print(f"cache: --workers {workers}: give 1 or more worker processes", file=sys.stderr)
        return 2
    config = load_config(config_path)
    family, model = get_family(config), model_source(config)
    if shard is not None:  # one worker: what `--workers N` starts N of, and what a pod or container runs
        report = fanout.cache_shard(config, family, model, dataset, Shard.parse(shard))
        print(f"latents shard {shard} of '{dataset}': computed {report.computed}, reused {report.reused}, "
              f"quarantined {len(report.quarantined)}")
        return 0
    try:
        clips, latents, audio = fanout.cache_dataset(config_path, config, family, model, dataset, workers)
    except fanout.WorkersFailed as exc:  # each worker printed its own message (a full disk, ...): no traceback
        print(f"loraflow cache: {exc}", file=sys.stderr)
        return 1
    captions = _auto_captions(config, model, dataset)
    print(f"'{dataset}' cached by {workers} worker(s): clips computed {clips.computed}, reused {clips.reused}; "
          f"latents {latents.computed + latents.reused} listed (data version {latents.data_version})"
          + (f"; audio latents computed {audio.computed}, reused {audio.reused}" if audio else "")
          + (f"; captions computed {captions.computed}, reused {captions.reused}" if captions else ""))
    return 0


def _auto_captions(config: LoraflowConfig, model: ModelSource, dataset: str) -> CaptionsReport | None:
    """A `caption_strategy: auto` dataset's captions, as its `cache_dataset` run makes them; None for the others."""
    from loraflow.stages.captions.captions import auto_datasets, build_captions
    from loraflow.store import Store

    if dataset not in auto_datasets(config):
        return None
    store = Store(config.cache_dir, config.manifest_names)
    with store.part_lock(dataset):
        return build_captions(config, model, store, [dataset])


def export_captions(config_path: str, folder: str, datasets: list[str] | None) -> int:
    """`loraflow captions export DIR`: the generated captions as user caption files (stages/captions/captions.py)."""
    from loraflow.stages.captions.captions import export_captions as export
    from loraflow.store import Store

    config = load_config(config_path)
    written, kept = export(config, Store(config.cache_dir, config.manifest_names), Path(folder), datasets)
    print(f"captions export: {len(written)} caption file(s) written under {folder}"
          + (f"; {len(kept)} already there kept (e.g. {kept[0]})" if kept else ""))
    return 0


def import_simpletuner(config_json: str, backend_json: str | None, out_path: str | None, force: bool = False) -> int:
    """Convert, write (or print), report every key not carried over, then validate the result. An existing output
    file is replaced only with `force`."""
    from loraflow import simpletuner

    if out_path and Path(out_path).exists() and not force:
        print(f"import-simpletuner: {out_path} exists; pass --force to replace it, or choose another -o",
              file=sys.stderr)
        return 2
    try:
        settings = simpletuner.read_json(config_json)
        backends = simpletuner.read_json(backend_json) if backend_json else None
        imported = simpletuner.import_simpletuner(settings, backends, base_dir=Path(config_json).parent)
    except simpletuner.ImportProblem as exc:  # not SimpleTuner's shape: the file or key, and what to do
        print(f"import-simpletuner: {exc}", file=sys.stderr)
        return 2
    text = simpletuner.to_yaml(imported, [s for s in (config_json, backend_json) if s])
    if out_path:
        from loraflow.atomic import write_atomic

        write_atomic(Path(out_path), lambda tmp: tmp.write_text(text))
        print(f"wrote {out_path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    print(f"{len(imported.unmapped)} key(s) not carried over:" if imported.unmapped else "every key carried over",
          file=sys.stderr)
    for key, value, why in imported.unmapped:
        print(f"  - {key} = {value!r}: {why}", file=sys.stderr)
    for note in imported.notes:
        print(f"note: {note}", file=sys.stderr)
    for left in imported.left:
        print(f"SimpleTuner default not taken: {left}", file=sys.stderr)
    parse_config(imported.config, out_path or "imported config", Path(out_path or ".").parent)
    return 0


def post_hoc_ema(files: list[str], decay: float, out: str) -> int:
    """musubi-tuner's post-hoc EMA over saved LoRA files (training/options/ema.py), written to `out`."""
    from loraflow.training.options.ema import post_hoc_ema as average

    missing = [f for f in files if not Path(f).is_file()]
    problem = f"no such file: {', '.join(missing)}" if missing else None
    if not 0 <= decay <= 1:
        problem = f"--decay {decay} is not in [0, 1]"
    if problem:
        print(f"post-hoc-ema: {problem}", file=sys.stderr)
        return 2
    try:
        print(f"wrote {average(files, decay, out)}", file=sys.stderr)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The subcommands and their options (also read by tests/test_docs.py: the docs name only what exists)."""
    parser = argparse.ArgumentParser(prog="loraflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the tiny model + demo data, materialize every stage")
    demo.add_argument("--config", default=DEMO_CONFIG)
    parts = sub.add_parser("partitions", help="add a Dagster partition per training dataset, delete removed ones")
    parts.add_argument("config", nargs="?", default=os.environ.get("LORAFLOW_CONFIG", DEMO_CONFIG))
    checker = sub.add_parser("check", help="validate a config, print every problem and the bucket plan; no model loads")
    checker.add_argument("config")
    checker.add_argument("--no-estimates", action="store_true",
                         help="leave out the memory/TFLOP estimates (a config's first check imports torch and "
                              "traces each stage: seconds to minutes; an unchanged config's next check reads them)")
    cacher = sub.add_parser("cache", help="cache one dataset's clips and latents, the latents by N worker processes "
                            "(and with train_audio the clips' sound)")
    cacher.add_argument("config")
    cacher.add_argument("--dataset", required=True, help="a training dataset's id")
    cacher.add_argument("--workers", type=int, default=1, help="latents worker processes (one GPU each where any)")
    cacher.add_argument("--shard", help="INDEX/COUNT: be that one worker (no clips, no manifest)")
    captioner = sub.add_parser("captions", help="caption_strategy auto: the captions the `captions` asset made")
    captions_sub = captioner.add_subparsers(dest="action", required=True)
    exporter = captions_sub.add_parser("export", help="write each as its user caption file under DIR, laid out as "
                                       "the dataset folder (NAME.txt; with scene cuts NAME.nnnn.txt): edited and in "
                                       "the dataset folder, it is a user caption; files already there are kept")
    exporter.add_argument("dir")
    exporter.add_argument("--config", default=os.environ.get("LORAFLOW_CONFIG", DEMO_CONFIG))
    exporter.add_argument("--dataset", action="append", help="a dataset id (repeatable); default: every auto dataset")
    importer = sub.add_parser("import-simpletuner", help="convert a SimpleTuner config.json (+ multidatabackend.json)")
    importer.add_argument("config_json")
    importer.add_argument("backend_json", nargs="?", help="default: the file its data_backend_config names")
    importer.add_argument("-o", "--output", help="YAML file to write (default: standard output)")
    importer.add_argument("--force", action="store_true", help="replace the -o file if it exists")
    averager = sub.add_parser("post-hoc-ema", help="the EMA of saved LoRA files (the checkpoints' "
                              "pytorch_lora_weights.safetensors), given in step order (musubi-tuner's post-hoc EMA)")
    averager.add_argument("files", nargs="+")
    averager.add_argument("--decay", type=float, required=True, help="ema <- decay * ema + (1 - decay) * file")
    averager.add_argument("-o", "--output", required=True, help="the averaged .safetensors to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit code; as the process itself (`loraflow ...`, `python -m loraflow.cli`:
    `argv` None) exit with it, without finalizing the interpreter (`exit_process`)."""
    code = run_command(argv)
    if argv is None:
        exit_process(code)
    return code


def exit_process(code: int) -> None:
    """Exit after atexit's handlers and a flush of the streams, skipping the interpreter's finalization (when no
    other thread of ours runs). A C++ thread holding a Python thread state that wakes while the interpreter
    finalizes (torch's autograd device threads pt_autograd_0..7, which check's first estimates start) is ended by
    pthread_exit, whose unwinding through its C++ frames aborts the process: "terminate called without an active
    exception", exit 134, in 2 of ~156 checks (pytorch/pytorch#38228)."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a thread of ours still works: the interpreter joins it, as it always did
    atexit._run_exitfuncs()  # logging, the media workers, temporary folders: what finalization would run of ours
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


def reader_left(stream: object) -> bool:
    """Whether the pipe `stream` writes to has lost its reader: poll reports an error on a pipe's write end then."""
    import select

    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # no file of its own (a test's capture)
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def run_command(argv: list[str] | None) -> int:
    from loraflow.atomic import DiskFull

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("loraflow").setLevel(logging.INFO)  # our progress, not every library's INFO chatter
    try:
        if args.command == "demo":
            return run_demo(args.config)
        if args.command == "partitions":
            return partitions(args.config)
        if args.command == "cache":
            return cache(args.config, args.dataset, args.workers, args.shard)
        if args.command == "captions":
            return export_captions(args.config, args.dir, args.dataset)
        if args.command == "import-simpletuner":
            return import_simpletuner(args.config_json, args.backend_json, args.output, args.force)
        if args.command == "post-hoc-ema":
            return post_hoc_ema(args.files, args.decay, args.output)
        return check(args.config, estimate=not args.no_estimates)
    except ConfigError as exc:  # every problem, each naming its key: no traceback for a bad config
        print(exc, file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`loraflow check CONFIG | head -1`): nothing to say, no traceback
        if not reader_left(sys.stdout):  # another pipe broke (a worker's): an error of its own, to be seen
            raise
        # what stdout still buffers goes nowhere: the flush at exit does not meet the closed pipe again
        # (the signal module's "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (HubUnreachable, DiskFull) as exc:  # no network, no space: what to do, no traceback from inside a library
        print(f"loraflow {args.command}: {exc}", file=sys.stderr)
        return 1
    except remote_store_errors() as exc:  # an s3:// cache_dir that does not answer (no network, no credentials)
        print(f"loraflow {args.command}: the cache (`cache_dir`) did not answer ({type(exc).__name__}: {exc}): check "
              "the network, the endpoint (AWS_ENDPOINT_URL) and the credentials, or set `cache_dir` to a local "
              "folder", file=sys.stderr)
        return 1


def remote_store_errors() -> tuple[type[BaseException], ...]:
    """What a remote store's client raises when the store does not answer or takes no credentials: botocore's
    errors (s3fs), once it has been imported (only an s3:// store imports it)."""
    botocore = sys.modules.get("botocore.exceptions")
    return (botocore.BotoCoreError,) if botocore is not None else ()


if __name__ == "__main__":
    sys.exit(main())
