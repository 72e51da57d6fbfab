"""The chat page's Jobs panel (static/jobs.js) in a real browser — Debian's chromium, headless, as the chat page
tests — against gateway processes of the session's deployment, each with a jobs_dir of its own: a JSONL file
uploaded through the panel runs as a batch, its progress shows, and its results download."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.gateway.test_chat_page import ARTIFACTS, MISSING, REQUIRE, browser  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None and not REQUIRE, reason=f"no browser: {MISSING}")]
BATCH_MS = 180_000        # a few short lines on the CPU model, behind whatever else runs
UI_MS = 30_000


def _jsonl(model: str, prompts: list[str], max_tokens: int = 6, **body) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "messages": [{"role": "user", "content": p}],
                                        "max_tokens": max_tokens, "temperature": 0, **body}}) + "\n"
                   for i, p in enumerate(prompts)).encode()


@pytest.fixture
def page(browser):  # noqa: F811 - the fixture imported above
    ctx = browser.new_context(viewport={"width": 1280, "height": 860}, accept_downloads=True)
    p = ctx.new_page()
    p.errors = []
    p.on("console", lambda m: p.errors.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: p.errors.append(f"uncaught: {e}"))
    yield p
    ctx.close()


def _served_model(url: str, key: str | None = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]


def _submit(page, name: str, data: bytes, endpoint: str = "/v1/chat/completions") -> None:
    page.select_option("#jobs-endpoint", endpoint)
    page.set_input_files("#jobs-file", files=[{"name": name, "mimeType": "application/jsonl", "buffer": data}])
    page.click("#jobs-submit")


def test_jobs_panel_runs_a_batch_and_downloads_its_results(page, start_gateway, tmp_path):
    """Nothing is asked of the jobs API until the panel opens. A 3-line JSONL chosen in the panel is uploaded and
    run: its row shows the file's name, the status moving to completed and the bar at 3/3, polled while active
    (and no longer after); the Results link downloads a file of 3 lines holding the custom_ids in order."""
    from playwright.sync_api import expect

    jobs_dir = tmp_path / "jobs"
    gw = start_gateway(jobs_dir=str(jobs_dir))
    model = _served_model(gw.url)
    listed: list[str] = []
    page.on("request", lambda r: listed.append(r.url) if "/v1/batches" in r.url and r.method == "GET" else None)
    page.goto(f"{gw.url}/")
    expect(page.locator("#status")).to_have_attribute("data-state", "connected", timeout=UI_MS)
    expect(page.locator("#jobs")).to_be_hidden()
    assert listed == [] and not jobs_dir.exists()

    page.click("#toggle-jobs")
    expect(page.locator("#jobs")).to_be_visible()
    expect(page.locator("#toggle-jobs")).to_have_attribute("aria-expanded", "true")
    expect(page.locator("#jobs-submit")).to_be_disabled()
    _submit(page, "three.jsonl", _jsonl(model, ["Say one.", "Say two.", "Say three."]))

    row = page.locator("#jobs-list .job").first
    expect(row.locator(".job-name")).to_have_text("three.jsonl", timeout=UI_MS)
    expect(row).to_have_attribute("data-status", "completed", timeout=BATCH_MS)
    expect(row.locator(".job-status")).to_have_text("completed")
    expect(row.locator(".progress")).to_have_attribute("aria-valuenow", "3")
    expect(row.locator(".progress")).to_have_attribute("aria-valuemax", "3")
    expect(row.locator(".job-counts")).to_have_text("3 / 3 done")
    expect(row.locator(".job-cancel")).to_be_hidden()
    expect(row.locator(".job-error-file")).to_be_hidden()
    assert len(listed) >= 2, listed                   # listed after the submit, then polled until it ended

    with page.expect_download(timeout=UI_MS) as dl:
        row.locator(".job-output").click()
    assert dl.value.suggested_filename.endswith("_output.jsonl")
    out = [json.loads(x) for x in Path(dl.value.path()).read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["line-0", "line-1", "line-2"]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"][0]["message"]["content"]
               for x in out)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "jobs_panel.png"))
    polls = len(listed)
    page.wait_for_timeout(3000)
    assert len(listed) <= polls + 1, "still polling after every batch ended"
    assert page.errors == []
    gw.stop()


def test_jobs_panel_with_an_api_key_limits_and_cancel(page, start_gateway, deployment, tmp_path):
    """On a gateway with an API key (the page opened with ?api_key=), the panel's calls carry it and so do its
    download links; an upload past jobs_max_file_bytes shows the server's 413 naming the bound; a running batch
    is cancelled with its Cancel button."""
    from playwright.sync_api import expect

    key = "panel-secret"
    gw = start_gateway(jobs_dir=str(tmp_path / "jobs"), api_key=key, jobs_max_file_bytes=8000)
    model = _served_model(gw.url, key)
    page.goto(f"{gw.url}/?api_key={key}")
    page.click("#toggle-jobs")

    _submit(page, "big.jsonl", b"x" * 8001 + b"\n")
    expect(page.locator("#jobs-error")).to_contain_text("max_file_bytes", timeout=UI_MS)
    expect(page.locator("#jobs-error")).to_contain_text("file_too_large")

    _submit(page, "one.jsonl", _jsonl(model, ["Say yes."]))
    row = page.locator("#jobs-list .job").first
    expect(row).to_have_attribute("data-status", "completed", timeout=BATCH_MS)
    expect(page.locator("#jobs-error")).to_be_empty()
    href = row.locator(".job-output").get_attribute("href")
    assert re.search(rf"[?&]api_key={key}$", href), href
    with page.expect_download(timeout=UI_MS) as dl:
        row.locator(".job-output").click()
    [line] = [json.loads(x) for x in Path(dl.value.path()).read_text().splitlines()]
    assert line["custom_id"] == "line-0" and line["response"]["status_code"] == 200

    limits = deployment.run(deployment.health())["limits"]
    long = min(limits["max_model_len"], limits["max_request_tokens"]) - 64   # minutes of decoding on the CPU
    _submit(page, "long.jsonl", _jsonl(model, [f"Tell story {i}." for i in range(12)], max_tokens=long,
                                        ignore_eos=True))
    row = page.locator("#jobs-list .job").first
    expect(row.locator(".job-name")).to_have_text("long.jsonl", timeout=UI_MS)
    expect(row).to_have_attribute("data-status", "in_progress", timeout=BATCH_MS)
    expect(row.locator(".job-cancel")).to_be_visible()
    row.locator(".job-cancel").click()
    expect(row).to_have_attribute("data-status", "cancelled", timeout=BATCH_MS)
    expect(row.locator(".job-cancel")).to_be_hidden()
    expect(page.locator("#jobs-list .job")).to_have_count(2)
    assert page.errors == [] or all("413" in e for e in page.errors), page.errors
    gw.stop()
