// The chat page's Jobs panel: a JSONL file of requests run as a batch through the gateway's OpenAI Files and
// Batches API (docs/jobs.md). The file is uploaded (POST /v1/files, purpose "batch") and a batch created for the
// chosen endpoint (POST /v1/batches); GET /v1/batches lists the batches, polled every second while one is active
// and the panel is open; an ended batch links its output and error files (/v1/files/{id}/content) and an active
// one can be cancelled (POST /v1/batches/{id}/cancel). Nothing is asked of the server before the panel is first
// opened, so a gateway whose page never opened it keeps no jobs store. The page's ?api_key= is sent as a Bearer
// header, and on the download links (which cannot carry headers). Server text goes in as text, never as HTML.
"use strict";

// This script's own URL: the API is found relative to it, like the chat's WebSocket (chat.js).
const JOBS_SCRIPT_URL = document.currentScript ? document.currentScript.src
  : location.origin + location.pathname.replace(/^\/+/, "/").replace(/\/*$/, "/") + "static/jobs.js";

function startJobs() {
  const $ = (id) => document.getElementById(id);
  const ui = {
    panel: $("jobs"), toggle: $("toggle-jobs"), form: $("jobs-form"), file: $("jobs-file"),
    endpoint: $("jobs-endpoint"), submit: $("jobs-submit"), error: $("jobs-error"), list: $("jobs-list"),
  };
  const POLL_MS = 1000;           // while a batch is active
  const RETRY_MS = 3000;          // after a failed listing
  const LIST_LIMIT = 20;          // the newest batches shown
  const SHOWN_ERRORS = 3;         // a batch that failed validation: its first errors
  const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
  const CANCELLABLE = new Set(["validating", "in_progress"]);
  const apiKey = new URLSearchParams(location.search).get("api_key");

  const rows = new Map();         // batch id → the parts of its list item
  let busy = false;               // an upload and batch creation under way
  let pollTimer = null;
  let refreshing = false, again = false;
  let listFailed = false;         // the error shown is the listing's: the next good listing clears it

  // ---------------------------------------------------------------- the API

  function apiUrl(path, withKey) {
    const u = new URL(`..${path}`, JOBS_SCRIPT_URL);      // …/static/jobs.js → …/v1/…
    if (withKey && apiKey) u.searchParams.set("api_key", apiKey);
    return u.href;
  }

  // The JSON answer; an Error with the server's message (and code) otherwise.
  async function api(method, path, body) {
    const headers = {};
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    let payload = body;
    if (body !== undefined && !(body instanceof FormData)) {
      headers["Content-Type"] = "application/json";
      payload = JSON.stringify(body);
    }
    const r = await fetch(apiUrl(path, false), { method, headers, body: payload });
    let data = null;
    try {
      data = await r.json();
    } catch (e) { data = null; }
    if (!r.ok) {
      const err = data && typeof data.error === "object" ? data.error : null;
      const msg = err && typeof err.message === "string" && err.message ? err.message
        : `${method} ${path} failed (HTTP ${r.status})`;
      throw new Error(err && err.code ? `${msg} (${err.code})` : msg);
    }
    return data;
  }

  function showError(text, fromList) {
    ui.error.textContent = text;
    listFailed = Boolean(text) && Boolean(fromList);
  }

  // ---------------------------------------------------------------- submit

  function updateForm() {
    ui.submit.disabled = busy || !ui.file.files || ui.file.files.length === 0;
    ui.submit.textContent = busy ? "Uploading…" : "Run batch";
  }

  async function submit() {
    const f = ui.file.files && ui.file.files[0];
    if (!f || busy) return;
    busy = true;
    updateForm();
    showError("");
    let uploaded = null;
    try {
      const form = new FormData();
      form.append("purpose", "batch");
      form.append("file", f, f.name);
      uploaded = await api("POST", "/v1/files", form);
      await api("POST", "/v1/batches", {
        input_file_id: uploaded.id, endpoint: ui.endpoint.value, completion_window: "24h",
        metadata: { filename: f.name.slice(0, 512) },
      });
      ui.file.value = "";
    } catch (e) {
      showError(e.message);
      // A file no batch was made of is of no use: not left to take up the store until it expires.
      if (uploaded) api("DELETE", `/v1/files/${encodeURIComponent(uploaded.id)}`).catch(() => {});
    }
    busy = false;
    updateForm();
    refresh();
  }

  // ---------------------------------------------------------------- the list

  async function refresh() {
    if (refreshing) {                 // one listing at a time: another follows this one
      again = true;
      return;
    }
    refreshing = true;
    clearTimeout(pollTimer);
    pollTimer = null;
    let next = null;
    try {
      const page = await api("GET", `/v1/batches?limit=${LIST_LIMIT}`);
      const batches = page && Array.isArray(page.data) ? page.data : [];
      render(batches);
      if (listFailed) showError("");
      if (batches.some((b) => ACTIVE.has(b.status))) next = POLL_MS;
    } catch (e) {
      showError(`Could not list the batches: ${e.message}`, true);
      next = RETRY_MS;
    } finally {
      refreshing = false;
    }
    if (again) {
      again = false;
      refresh();
    } else if (next !== null && !ui.panel.hidden) {
      pollTimer = setTimeout(refresh, next);
    }
  }

  function el(tag, className, text) {
    const e = document.createElement(tag);
    if (className) e.className = className;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function makeRow(id) {
    const r = { li: el("li", "job") };
    r.li.setAttribute("data-id", id);
    const head = el("div", "job-head");
    r.name = el("span", "job-name");
    r.status = el("span", "job-status");
    head.append(r.name, r.status);
    r.progress = el("div", "progress");
    r.progress.setAttribute("role", "progressbar");
    r.progress.setAttribute("aria-valuemin", "0");
    r.bar = el("div", "bar");
    r.progress.append(r.bar);
    r.counts = el("div", "job-counts");
    r.errors = el("div", "job-errors");
    const actions = el("div", "job-actions");
    r.output = el("a", "job-output", "Results");
    r.errorFile = el("a", "job-error-file", "Errors");
    r.cancel = el("button", "btn small job-cancel", "Cancel");
    r.cancel.type = "button";
    r.cancel.addEventListener("click", () => cancel(id, r.cancel));
    actions.append(r.output, r.errorFile, r.cancel);
    r.li.append(head, r.progress, r.counts, r.errors, actions);
    return r;
  }

  function setLink(a, fileId, name) {
    a.hidden = !fileId;
    if (fileId) {
      a.href = apiUrl(`/v1/files/${encodeURIComponent(fileId)}/content`, true);
      a.download = name;
    } else {
      a.removeAttribute("href");
    }
  }

  function update(r, b) {
    const rc = b.request_counts || { total: 0, completed: 0, failed: 0 };
    const done = rc.completed + rc.failed;
    const meta = b.metadata && typeof b.metadata.filename === "string" ? b.metadata.filename : "";
    r.li.setAttribute("data-status", b.status);
    r.name.textContent = meta || b.id;
    r.name.title = b.id;
    r.status.textContent = b.status.replace(/_/g, " ");
    r.progress.setAttribute("aria-valuemax", String(rc.total));
    r.progress.setAttribute("aria-valuenow", String(done));
    r.bar.style.width = `${rc.total ? Math.round((100 * done) / rc.total) : 0}%`;
    let counts = rc.total ? `${done} / ${rc.total} done` : (b.status === "validating" ? "Validating…" : "");
    if (rc.failed) counts += ` · ${rc.failed} failed`;
    r.counts.textContent = counts;
    const errs = b.errors && Array.isArray(b.errors.data) ? b.errors.data : [];
    const shown = errs.slice(0, SHOWN_ERRORS).map((e) => (e && typeof e.message === "string" ? e.message : "error"));
    if (errs.length > SHOWN_ERRORS) shown.push(`… and ${errs.length - SHOWN_ERRORS} more`);
    r.errors.textContent = shown.join("\n");
    setLink(r.output, b.output_file_id, `${b.id}_output.jsonl`);
    setLink(r.errorFile, b.error_file_id, `${b.id}_error.jsonl`);
    r.cancel.hidden = !CANCELLABLE.has(b.status);
  }

  // Newest first, as listed; each item kept across polls (a click on Cancel is never lost to a redraw).
  function render(batches) {
    const seen = new Set();
    let prev = null;
    for (const b of batches) {
      if (!b || typeof b.id !== "string" || typeof b.status !== "string") continue;
      seen.add(b.id);
      let r = rows.get(b.id);
      if (!r) {
        r = makeRow(b.id);
        rows.set(b.id, r);
      }
      update(r, b);
      const at = prev ? prev.nextSibling : ui.list.firstChild;
      if (at !== r.li) ui.list.insertBefore(r.li, at);
      prev = r.li;
    }
    for (const [id, r] of rows) {
      if (!seen.has(id)) {
        r.li.remove();
        rows.delete(id);
      }
    }
  }

  async function cancel(id, button) {
    button.disabled = true;
    try {
      await api("POST", `/v1/batches/${encodeURIComponent(id)}/cancel`);
    } catch (e) {
      showError(e.message);
    }
    button.disabled = false;
    refresh();
  }

  // ---------------------------------------------------------------- wiring

  function openPanel(open) {
    ui.panel.hidden = !open;
    ui.toggle.setAttribute("aria-expanded", String(open));
    if (open) {
      refresh();
    } else {
      clearTimeout(pollTimer);
      pollTimer = null;
    }
  }

  ui.toggle.addEventListener("click", () => openPanel(ui.panel.hidden));
  ui.file.addEventListener("change", updateForm);
  ui.form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  updateForm();
}

// index.html inserts this script from its head: it may run before the body is parsed.
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startJobs);
else startJobs();
