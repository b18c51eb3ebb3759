"""Models by Hugging Face id, read offline from a cache laid out as huggingface_hub lays it out; folders from elsewhere.

No network: every repository here is a tiny real checkpoint put into a temporary HF cache (`hf_cache_snapshot`), read
with HF_HUB_OFFLINE=1; an unreachable Hub is a loopback port that refuses connections.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraflow.cli import main
from loraflow.config import ConfigError, parse_config
from loraflow.keys import content_key, directory_fingerprint
from loraflow.pipelines import family_flavour, get_family
from loraflow.pipelines.base import component_fingerprint, load_component
from loraflow.pipelines.sources import check_layout, layout_problem, model_source
from loraflow.stages.clips.bucket_plan import human_bytes
from loraflow.stages.latents.latents import latent_rows
from tests.factory import K5_DEFAULT_REPO, REPO, clip_row, hf_cache_snapshot, k5_settings, write_config

K5 = "kandinsky5-video"
COMMIT, NEXT_COMMIT = "a" * 40, "b" * 40


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_left_out_the_model_is_the_flavours_diffusers_repository_read_from_the_cache(
        tiny_k5: Path, tmp_path: Path, offline_cache: Path) -> None:
    snapshot = hf_cache_snapshot(offline_cache, K5_DEFAULT_REPO, tiny_k5, COMMIT)
    config = parse_config(k5_settings(tmp_path))
    assert config.pretrained_model_name_or_path == K5_DEFAULT_REPO
    source = model_source(config)
    assert (source.root, source.repo_id, source.commit) == (snapshot, K5_DEFAULT_REPO, COMMIT)
    check_layout(source, family_flavour(K5, None))
    from_cache, from_folder = load_component(source, "vae"), load_component(tiny_k5, "vae")
    for (name, a), (_, b) in zip(from_cache.state_dict().items(), from_folder.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_moved_cache_keeps_every_fingerprint_and_a_new_revision_changes_them(
        tiny_k5: Path, tmp_path: Path, offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_cache_snapshot(offline_cache, "org/tiny", tiny_k5, COMMIT)
    config = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path="org/tiny"))
    before = {c: component_fingerprint(model_source(config), c) for c in ("vae", "text_encoder", "transformer")}
    moved = tmp_path / "elsewhere"
    shutil.move(offline_cache, moved)  # relative links: the cache still reads the same
    monkeypatch.setenv("HF_HUB_CACHE", str(moved))
    assert model_source(config).root.is_relative_to(moved)
    assert {c: component_fingerprint(model_source(config), c) for c in before} == before
    hf_cache_snapshot(moved, "org/tiny", tiny_k5, NEXT_COMMIT)  # main moves on; same files, new revision
    after = {c: component_fingerprint(model_source(config), c) for c in before}
    assert all(after[c] != before[c] for c in before)
    pinned = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path="org/tiny", revision=COMMIT))
    assert {c: component_fingerprint(model_source(pinned), c) for c in before} == before


def test_a_local_folder_keeps_the_fingerprint_it_always_had(tiny_k5: Path, tmp_path: Path) -> None:
    config = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path=str(tiny_k5)))
    assert model_source(config).repo_id is None
    for component in ("vae", "text_encoder", "text_encoder_2", "transformer"):
        assert component_fingerprint(model_source(config), component) == content_key(
            component=component, files=directory_fingerprint(tiny_k5 / component))


def test_offline_without_the_repository_in_the_cache_names_it_and_the_cache(tmp_path: Path,
                                                                           offline_cache: Path) -> None:
    config = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path="org/absent", revision="v2"))
    with pytest.raises(FileNotFoundError) as error:
        model_source(config)
    message = f"org/absent@v2 is not in the Hugging Face cache ({offline_cache}); HF_HUB_OFFLINE is set"
    assert message in str(error.value)


def test_a_repository_with_only_pickled_weights_is_refused_before_loading(
        tiny_k5: Path, tmp_path: Path, offline_cache: Path) -> None:
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_k5, pickled)
    (pickled / "vae" / "diffusion_pytorch_model.safetensors").rename(pickled / "vae" / "diffusion_pytorch_model.bin")
    hf_cache_snapshot(offline_cache, "org/pickled", pickled, COMMIT)
    config = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path="org/pickled"))
    with pytest.raises(FileNotFoundError, match=r"org/pickled vae/ holds weights only as diffusion_pytorch_model.bin: "
                                                r"loraflow reads safetensors only"):
        model_source(config)


def test_a_repository_not_in_the_diffusers_layout_is_refused_naming_the_flavours_repository() -> None:
    files = ["config.json", "transformer/480p_t2v/config.json", "vae/config.json"]
    hv = family_flavour("hunyuanvideo-1.5", "t2v-480p")
    assert layout_problem("tencent/HunyuanVideo-1.5", files, hv.components, hv.repo) == (
        "tencent/HunyuanVideo-1.5 is not in the diffusers layout (no model_index.json): use the flavour's "
        "diffusers-format repository hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v")


def test_the_hunyuanvideo_guides_repository_is_refused_at_load_naming_the_diffusers_one(tmp_path: Path) -> None:
    guide = {**k5_settings(tmp_path), "model_family": "hunyuanvideo-1.5", "model_flavour": "i2v-720p",
             "pretrained_model_name_or_path": "tencent/HunyuanVideo-1.5"}
    with pytest.raises(ConfigError, match="not in the diffusers layout.*use 'hunyuanvideo-community/"
                                          "HunyuanVideo-1.5-Diffusers-720p_i2v'"):
        parse_config(guide)


def test_a_vae_folder_from_elsewhere_is_loaded_and_fingerprinted_from_there(tiny_k5: Path, tmp_path: Path) -> None:
    checkpoint, vae = tmp_path / "checkpoint", tmp_path / "my-vae"
    shutil.copytree(tiny_k5, checkpoint)
    shutil.move(checkpoint / "vae", vae)
    config = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path=str(checkpoint), vae_path=str(vae)))
    source = model_source(config)
    check_layout(source, family_flavour(K5, None))
    assert source.fingerprint("vae") == content_key(component="vae", files=directory_fingerprint(vae))
    loaded = load_component(source, "vae")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), load_component(tiny_k5, "vae").parameters()))
    without = parse_config(k5_settings(tmp_path, pretrained_model_name_or_path=str(tiny_k5)))

    class Clips:  # the one store call latent_rows makes
        def read_manifest(self, name: str, parts: list[str] | None = None) -> list[dict]:
            return [clip_row("clip", "v", bucket="b").to_row()]

    (vae / "config.json").write_text((vae / "config.json").read_text() + "\n")  # another VAE: other latent keys
    family = get_family(config)
    assert (latent_rows(config, family, model_source(config), Clips())[0].key
            != latent_rows(without, family, model_source(without), Clips())[0].key)


def test_component_folders_are_checked_at_load_naming_the_key(tiny_k5: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pickled = tmp_path / "pickled-vae"
    shutil.copytree(tiny_k5 / "vae", pickled)
    (pickled / "diffusion_pytorch_model.safetensors").rename(pickled / "diffusion_pytorch_model.bin")
    base = k5_settings(tmp_path, pretrained_model_name_or_path=str(tiny_k5))
    with pytest.raises(ConfigError, match=r"`vae_path` .*pickled-vae holds weights only as diffusion_pytorch_model"):
        parse_config({**base, "vae_path": str(pickled)})
    with pytest.raises(ConfigError, match=r"`vision_encoder_path` names a image_encoder, which flavour "
                                          r"'t2v-lite-sft-5s' does not use"):
        parse_config({**base, "vision_encoder_path": str(tiny_k5 / "text_encoder")})
    with pytest.raises(ConfigError, match=r"`revision` 'main' picks a version of a Hugging Face repository"):
        parse_config({**base, "revision": "main"})
    monkeypatch.setenv("HUNYUANVIDEO_TEXT_ENCODER_PATH", str(tmp_path / "nowhere"))  # another family's variable
    assert model_source(parse_config(base)).folders == ()


def test_the_guides_text_encoder_variable_replaces_hunyuanvideos_text_encoder(
        tiny_hv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    encoder = tmp_path / "qwen"
    shutil.copytree(tiny_hv / "text_encoder", encoder)  # copied with its mtimes: the same fingerprint, until edited
    (encoder / "config.json").write_text((encoder / "config.json").read_text() + "\n")
    base = {**k5_settings(tmp_path), "model_family": "hunyuanvideo-1.5", "pretrained_model_name_or_path": str(tiny_hv)}
    plain = model_source(parse_config(base))
    monkeypatch.setenv("HUNYUANVIDEO_TEXT_ENCODER_PATH", str(encoder))
    source = model_source(parse_config(base))
    assert source.folder("text_encoder") == encoder and source.folder("tokenizer") == tiny_hv / "tokenizer"
    assert source.fingerprint("text_encoder") != plain.fingerprint("text_encoder")
    assert source.fingerprint("text_encoder_2") == plain.fingerprint("text_encoder_2")
    monkeypatch.setenv("HUNYUANVIDEO_TEXT_ENCODER_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"`\$HUNYUANVIDEO_TEXT_ENCODER_PATH` .*nowhere is not a folder"):
        model_source(parse_config(base))


@pytest.fixture(scope="module")
def tiny_hv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.demo.tiny import build_tiny

    return build_tiny("hunyuanvideo-1.5", tmp_path_factory.mktemp("models") / "hv15")


def test_check_says_what_is_cached_and_what_is_missing(tiny_k5: Path, tmp_path: Path, offline_cache: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path))
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{K5_DEFAULT_REPO} is not in the Hugging Face cache ({offline_cache}); HF_HUB_OFFLINE is set" in err
    hf_cache_snapshot(offline_cache, K5_DEFAULT_REPO, tiny_k5, COMMIT)
    main(["check", str(config)])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.split("component")[1].split("bucket plan")[0]
            .splitlines()[1:] if line.strip()}
    assert set(rows) == set(family_flavour(K5, None).components)
    vae_bytes = sum(f.stat().st_size for f in (tiny_k5 / "vae").iterdir())
    assert rows["vae"][0] == "cached" and " ".join(rows["vae"][1:3]) == human_bytes(vae_bytes)
    assert all(row[0] == "cached" for row in rows.values())


def test_a_download_fetches_only_the_flavours_configs_tokenizers_and_safetensors(tiny_hv: Path) -> None:
    """The allow patterns as huggingface_hub applies them (its own filter) to a repository's file list."""
    from huggingface_hub.utils import filter_repo_objects

    from loraflow.pipelines.sources import fetched_patterns

    wanted = [f.relative_to(tiny_hv).as_posix() for f in sorted(tiny_hv.rglob("*")) if f.is_file()]
    wanted = [f for f in wanted if not f.startswith(("image_encoder/", "feature_extractor/"))]  # i2v only
    elsewhere = ["README.md", ".gitattributes", "transformer/diffusion_pytorch_model.bin", "vae/model.ckpt",
                 "text_encoder/modeling_qwen.py", "text_encoder_2/tf_model.h5", "image_encoder/model.safetensors"]
    t2v = family_flavour("hunyuanvideo-1.5", "t2v-480p").components
    assert sorted(filter_repo_objects(wanted + elsewhere, allow_patterns=fetched_patterns(t2v))) == sorted(wanted)


@pytest.mark.parametrize("command", [["check"], ["cache", "--dataset", "v"]])
def test_an_unreachable_hub_fails_at_once_with_what_to_do_and_no_traceback(
        tmp_path: Path, unreachable_hub: dict[str, str], command: list[str]) -> None:
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path))  # the flavour's repository, not cached
    # the timeout only bounds a hang: huggingface_hub's own retries took 23 s on a refused connection
    done = subprocess.run([sys.executable, "-m", "loraflow.cli", command[0], str(config), *command[1:]], cwd=REPO,
                          env=unreachable_hub, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert (f"loraflow {command[0]}: the Hugging Face Hub ({unreachable_hub['HF_ENDPOINT']}) did not answer for "
            f"{K5_DEFAULT_REPO} (ConnectError") in done.stderr
    assert f"`hf download {K5_DEFAULT_REPO}` with --include for transformer, vae" in done.stderr
    assert f"into the Hugging Face cache ({tmp_path / 'hf'}" in done.stderr
    assert "run with HF_HUB_OFFLINE=1; or set `pretrained_model_name_or_path` to a local diffusers" in done.stderr


def tampered(tiny_k5: Path, folder: Path, **entries: list) -> Path:
    """A copy of the tiny checkpoint whose model_index.json names `entries` for those components."""
    shutil.copytree(tiny_k5, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **entries}))
    return folder


def test_a_model_index_naming_another_module_is_refused_by_check_and_the_stage_before_any_import(
        tiny_k5: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """model_index.json picked the module `load_component` imported (`["this", ...]` printed the Zen of Python): a
    module planted on the import path must never run."""
    ran = tmp_path / "planted-module-ran"
    (tmp_path / "planted_by_the_model.py").write_text(f"open({str(ran)!r}, 'w').close()\nclass AutoencoderKL: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tampered(tiny_k5, tmp_path / "model", vae=["planted_by_the_model", "AutoencoderKL"])
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path, pretrained_model_name_or_path=str(model)))
    assert main(["check", str(config), "--no-estimates"]) == 2
    err = capsys.readouterr().err
    assert (f"{model} vae: model_index.json names planted_by_the_model.AutoencoderKL; flavour 't2v-lite-sft-5s' "
            "loads diffusers.AutoencoderKLHunyuanVideo") in err
    with pytest.raises(ValueError, match="names planted_by_the_model.AutoencoderKL"):
        model_source(parse_config(k5_settings(tmp_path, pretrained_model_name_or_path=str(model))))  # every stage's
    with pytest.raises(ValueError, match="names library 'planted_by_the_model'; loraflow loads components from"):
        load_component(model, "vae")  # a bare folder, as the tests load them
    assert not ran.exists()


def test_a_checkpoint_of_another_family_is_refused_by_check_naming_component_found_and_expected(
        tiny_k5: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tampered(tiny_k5, tmp_path / "model", vae=["diffusers", "AutoencoderKLHunyuanVideo15"],
                     transformer=["diffusers", "HunyuanVideo15Transformer3DModel"])
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path, pretrained_model_name_or_path=str(model)))
    assert main(["check", str(config), "--no-estimates"]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err  # the third: the data folder is empty
    assert (f"{model} transformer: model_index.json names diffusers.HunyuanVideo15Transformer3DModel; flavour "
            "'t2v-lite-sft-5s' loads diffusers.Kandinsky5Transformer3DModel") in err
    assert "vae: model_index.json names diffusers.AutoencoderKLHunyuanVideo15" in err


def test_a_local_checkpoint_with_only_pickled_weights_is_refused_by_check(
        tiny_k5: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_k5, model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path, pretrained_model_name_or_path=str(model)))
    assert main(["check", str(config), "--no-estimates"]) == 2
    assert (f"{model} transformer/ holds weights only as diffusion_pytorch_model.bin: loraflow reads safetensors "
            "only") in capsys.readouterr().err


def test_a_corrupt_safetensors_header_in_the_model_is_named_by_check_and_by_the_loader(
        tiny_k5: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_k5, model)
    weights = model / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes((1 << 40).to_bytes(8, "little") + weights.read_bytes()[8:])  # a header length of 2^40
    config = write_config(tmp_path / "config.yaml", k5_settings(tmp_path, pretrained_model_name_or_path=str(model)))
    assert main(["check", str(config), "--no-estimates"]) == 2
    named = f"{weights} is not a readable safetensors file: its header length says 1099511627776 bytes"
    assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not a readable safetensors file") as info:
        load_component(model, "vae")
    assert named in str(info.value)


def test_the_family_tables_accept_the_classes_diffusers_pipelines_declare() -> None:
    """Each flavour's `Flavour.classes` holds what its family's diffusers pipelines annotate for each component it
    loads (diffusers' own declaration, `DiffusionPipeline._get_signature_types`)."""
    import diffusers

    from loraflow.pipelines import family_spec

    pipelines = {"kandinsky5-video": ("Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline"),
                 "kandinsky5-image": ("Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"),
                 "hunyuanvideo-1.5": ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
                 "kandinsky6": ("Kandinsky6TI2VAPipeline",)}
    for family, names in pipelines.items():
        for name in names:
            for component, types in getattr(diffusers, name)._get_signature_types().items():
                declared = {f"{t.__module__.split('.')[0]}.{t.__name__}" for t in types}
                for flavour in family_spec(family).flavours:
                    if component in flavour.components:
                        assert declared & set(flavour.classes[component]), (flavour.name, name, component, declared)
