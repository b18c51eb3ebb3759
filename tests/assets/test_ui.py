"""The Dagster UI on a materialized demo, in headless Chromium: what a user sees after `make demo && make dev`.

`dagster dev` runs on a free loopback port against a DAGSTER_HOME where every asset (and check) was
materialized; the browser must find the six assets (clips and latents with their one dataset partition), the
clips bucket table, the loss in words, and every picture (clips, loss curve, validation renders: an animation that
plays and a labelled sheet) decoded and whole inside the window. Screenshots go to the test's tmp dir; with
LORAFLOW_SAVE_SCREENSHOT=1 the validation preview's is copied to docs/ui.png. Skipped only where Chromium is
missing and CI is not set.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.keys import env_flag
from tests.dagster_dev import dagster_dev
from tests.factory import REPO, missing_input

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ASSETS = ("clips", "latents", "text_embeds", "teacher_features", "lora", "validation")
WAIT_MS = 30_000  # the UI fetches over GraphQL after the page loads; 2 CPU cores are slow


@pytest.fixture(scope="session", autouse=True)
def chromium() -> None:
    """This module's first fixture (session-scoped and autouse: before tiny_world), so that no demo is pre-trained or
    materialized for a browser that is not here."""
    if not CHROMIUM.exists():
        missing_input(f"headless Chromium is not installed at {CHROMIUM} (apt-get install chromium; .ci/run does)")


@pytest.fixture(scope="module")
def materialized(demo_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(this module's folder for screenshots, DAGSTER_HOME, config): the README's demo (configs/demo.yaml on the tiny
    world), every asset and check materialized into a real instance by `loraflow demo` (conftest `demo_run`): what a
    newcomer sees after `make demo && make dev`."""
    return tmp_path_factory.mktemp("ui"), demo_run / "dagster_home", demo_run / "config.yaml"


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


def _open_images(page, root: Path, key: str) -> list[dict]:
    """Open `key`'s markdown dialog, screenshot it, and check that every embedded image decoded and is shown whole,
    at its own size, inside the window; close the dialog. Markdown metadata of 1,000 characters or more (any real
    image) sits behind [Show Markdown]: Dagster 1.13 (ui-core MetadataEntry.tsx) shows only shorter ones inline."""
    _metadata_row(page, key).get_by_text("[Show Markdown]").click()
    dialog = page.get_by_role("dialog")
    images = dialog.locator('img[src^="data:image/"]')
    images.first.wait_for()
    page.wait_for_function("imgs => imgs.every(i => i.complete)", arg=images.element_handles())
    page.wait_for_function("() => document.getAnimations().length === 0")  # the dialog's zoom-in has ended
    shown = images.evaluate_all("""imgs => imgs.map(i => ({type: i.src.slice(5, i.src.indexOf(';')),
        width: i.naturalWidth, height: i.naturalHeight, box: i.getBoundingClientRect().toJSON()}))""")
    window = page.viewport_size
    for image in shown:
        box = image["box"]
        assert image["width"] > 0 and image["height"] > 0, f"a {key} image did not decode in the browser: {image}"
        assert (box["width"], box["height"]) == (image["width"], image["height"]), f"{key}: scaled: {image}"
        assert 0 <= box["left"] and box["right"] <= window["width"], f"{key}: cut off on the side: {image}"
    assert shown[0]["box"]["top"] >= 0 and shown[0]["box"]["bottom"] <= window["height"], shown[0]
    scroller = dialog.evaluate("d => [...d.querySelectorAll('*')].some(e => e.scrollWidth > e.clientWidth + 1 && "
                               "getComputedStyle(e).overflowX !== 'visible')")
    assert not scroller, f"the {key} dialog scrolls sideways"
    _shot(page, root, f"{page.url.rsplit('/', 1)[-1]}_{key}")
    return shown


def _close(page) -> None:
    page.keyboard.press("Escape")
    page.get_by_role("dialog").wait_for(state="detached")


def test_catalog_lists_the_six_assets_and_the_dataset_partitions(page, server: str, materialized) -> None:
    from playwright.sync_api import expect

    page.goto(f"{server}/assets")
    for asset in ASSETS:
        page.locator(f'a[href$="/assets/{asset}"]').first.wait_for()
    # text_embeds, teacher_features (CREPA off: one "off" version), lora, validation
    expect(page.get_by_text("Materialized", exact=True)).to_have_count(4)
    # clips and latents: a partition per dataset (the demo has one), "All" of them materialized
    expect(page.get_by_text("1 partition", exact=True)).to_have_count(2)
    expect(page.get_by_text("All", exact=True)).to_have_count(2)
    _shot(page, materialized[0], "catalog")


def test_validation_page_shows_the_renders_playing_and_a_labelled_sheet(page, server: str, materialized) -> None:
    page.goto(f"{server}/assets/validation")
    for key in ("computed", "status", "video", "base_video"):
        _metadata_row(page, key)
    assert ".mp4" in _metadata_row(page, "video").inner_text()
    start, animation, sheet = _open_images(page, materialized[0], "preview")  # i2v: the first frame given, first
    assert start["type"] == "image/png" and (start["width"], start["height"]) == (96, 64)  # at the render size
    assert animation["type"] == "image/webp" and sheet["type"] == "image/png"
    assert animation["width"] > animation["height"]  # base and LoRA side by side
    # it plays: two looks at the animation 120 ms apart (a 17-frame loop of 708 ms) show different frames
    image = page.get_by_role("dialog").locator('img[src^="data:image/webp"]')
    first = image.screenshot()
    page.wait_for_timeout(120)
    assert image.screenshot() != first, "the animated preview does not move in the browser"
    path = _shot(page, materialized[0], "validation")
    if env_flag("LORAFLOW_SAVE_SCREENSHOT"):
        shutil.copyfile(path, REPO / "docs" / "ui.png")
    _close(page)


def test_lora_page_shows_the_loss_in_words_and_its_curve(page, server: str, materialized) -> None:
    page.goto(f"{server}/assets/lora")
    words = _metadata_row(page, "loss").locator("td").last.inner_text()  # the value cell
    assert re.fullmatch(r"\d\.\d+ at step 1 → \d\.\d+ at step 200", words.strip()), words  # the demo's 200 steps
    assert re.search(r"\d\.\d", _metadata_row(page, "final_loss").inner_text())
    (curve,) = _open_images(page, materialized[0], "loss_curve")
    assert curve["type"] == "image/png" and curve["width"] > curve["height"]
    _close(page)


def test_clips_page_shows_the_bucket_table_and_the_first_frames(page, server: str, materialized) -> None:
    page.goto(f"{server}/assets/clips")
    assert "demo-videos" in _metadata_row(page, "dataset").inner_text()  # the latest partition's metadata
    table = _metadata_row(page, "buckets").locator("table")
    headers = [h.strip() for h in table.locator("th").all_inner_texts()]
    assert headers[:3] == ["dataset", "bucket", "clips"], headers
    cells = table.locator("td").all_inner_texts()
    assert any(cell.strip().endswith("@17") for cell in cells), cells  # WIDTHxHEIGHT@FRAMES, 17-frame clips
    _shot(page, materialized[0], "clips")
    _open_images(page, materialized[0], "preview")
    _close(page)
