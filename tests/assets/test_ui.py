"""The Dagster UI on a materialized demo, in headless Chromium: what a user sees after `make demo && make dev`.

`dagster dev` runs on a free loopback port against a DAGSTER_HOME where every asset (and check) was
materialized; the browser must find the five assets (clips and latents with their one dataset partition),
the validation preview image inline, and the clips bucket table. Screenshots go to the test's tmp dir; with
LORAFLOW_SAVE_SCREENSHOT=1 one is copied to docs/ui.png. Skipped only where Chromium is missing and CI is not set.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterInstance

from loraflow.assets.jobs import materialize_everything
from loraflow.assets.resources import LoraflowResource
from loraflow.keys import env_flag
from tests.conftest import REPO, demo_dict, write_config
from tests.dagster_dev import dagster_dev

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSETS = ("clips", "latents", "text_embeds", "lora", "validation")
WAIT_MS = 30_000  # the UI fetches over GraphQL after the page loads; 2 CPU cores are slow

if not CHROMIUM.exists() and not os.environ.get("CI"):
    pytest.skip("headless Chromium is not installed at /usr/bin/chromium (apt-get install chromium); "
                "under CI this test runs and fails instead", allow_module_level=True)


@pytest.fixture(scope="module")
def materialized(tiny_k5: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(root, DAGSTER_HOME, config): the demo, every asset and check materialized into a real instance."""
    root = tmp_path_factory.mktemp("ui")
    config = write_config(root / "config.yaml", demo_dict(tiny_k5, demo_data, root, max_train_steps=2,
                                                          checkpointing_steps=2))
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\nnux:\n  enabled: false\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DAGSTER_HOME", str(home))
        with DagsterInstance.get() as instance:  # what `loraflow demo` runs: the partition, then the rest
            results = materialize_everything(LoraflowResource(config_path=str(config)), instance)
            assert [r.success for r in results] == [True, True]
    return root, home, config


@pytest.fixture(scope="module")
def server(materialized: tuple[Path, Path, Path]) -> Iterator[str]:
    root, home, config = materialized
    with dagster_dev(home, config, root / "dagster_dev.log") as url:
        yield url


@pytest.fixture(scope="module")
def page(server: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_MS)
        yield page
        browser.close()


def _shot(page, root: Path, name: str) -> Path:
    path = root / f"{name}.png"
    page.screenshot(path=str(path), animations="disabled")  # not a dialog caught mid fade-in
    return path


def _metadata_row(page, key: str):
    """The row of the asset page's metadata table whose key cell is exactly `key`."""
    row = page.locator("tr", has=page.locator("td", has_text=re.compile(rf"^\s*{key}\s*$"))).first
    row.wait_for()
    return row


def _open_image(page, key: str):
    """Markdown metadata over 1,000 characters (any real image) sits behind [Show Markdown]: open it."""
    _metadata_row(page, key).get_by_text("[Show Markdown]").click()
    image = page.get_by_role("dialog").locator('img[src^="data:image/png;base64,"]').first
    image.wait_for()
    complete, width, height = image.evaluate("img => [img.complete, img.naturalWidth, img.naturalHeight]")
    assert complete and width > 0 and height > 0, f"the {key} PNG did not decode in the browser"
    return width, height


def test_catalog_lists_the_five_assets_and_the_dataset_partitions(page, server: str, materialized) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server}/assets")
    for asset in ASSETS:
        page.locator(f'a[href$="/assets/{asset}"]').first.wait_for()
    expect(page.get_by_text("Materialized", exact=True)).to_have_count(3)  # text_embeds, lora, validation
    # clips and latents: a partition per dataset (the demo has one), "All" of them materialized
    expect(page.get_by_text("1 partition", exact=True)).to_have_count(2)
    expect(page.get_by_text("All", exact=True)).to_have_count(2)
    _shot(page, materialized[0], "catalog")


def test_validation_page_shows_its_metadata_and_the_preview_image(page, server: str, materialized) -> None:
    page.goto(f"{server}/assets/validation")
    for key in ("computed", "status", "video", "base_video"):
        _metadata_row(page, key)
    assert ".mp4" in _metadata_row(page, "video").inner_text()
    width, height = _open_image(page, "preview")
    assert width > height  # a contact sheet: frames side by side, base row over LoRA row
    path = _shot(page, materialized[0], "validation")
    if env_flag("LORAFLOW_SAVE_SCREENSHOT"):
        shutil.copyfile(path, REPO / "docs" / "ui.png")


def test_clips_page_shows_the_bucket_table_and_the_first_frames(page, server: str, materialized) -> None:
    page.goto(f"{server}/assets/clips")
    assert "demo-videos" in _metadata_row(page, "dataset").inner_text()  # the latest partition's metadata
    table = _metadata_row(page, "buckets").locator("table")
    headers = [h.strip() for h in table.locator("th").all_inner_texts()]
    assert headers[:3] == ["dataset", "bucket", "clips"], headers
    cells = table.locator("td").all_inner_texts()
    assert any(cell.strip().endswith("@17") for cell in cells), cells  # WIDTHxHEIGHT@FRAMES, 17-frame clips
    _shot(page, materialized[0], "clips")
    _open_image(page, "preview")
    _shot(page, materialized[0], "clips_preview")
