// The chat page's settings panel: sampling parameters checked in the page (each bad field says why), and a
// system prompt, kept in localStorage. Loaded before chat.js, which calls chatSettings() once.
"use strict";

// -> {read(focusFirstBad)}: read() gives the generate frame's sampling parameters, or null (with the errors
// shown, and the settings opened on the first bad field when asked) when one is invalid.
function chatSettings() {
  const $ = (id) => document.getElementById(id);
  const ui = {
    settings: $("settings"), toggle: $("toggle-settings"), reset: $("reset-settings"), maxTokens: $("max-tokens"),
    temperature: $("temperature"), topP: $("top-p"), seed: $("seed"), system: $("system"),
  };
  const DEFAULTS = { "max-tokens": "256", temperature: "0.7", "top-p": "0.9", seed: "", system: "" };
  const SETTINGS_KEY = "mii_async.chat.settings";

  const fields = [
    { el: ui.maxTokens, key: "max-tokens", param: "max_new_tokens", label: "Max new tokens", int: true, min: 1 },
    { el: ui.temperature, key: "temperature", param: "temperature", label: "Temperature", min: 0, max: 100 },
    { el: ui.topP, key: "top-p", param: "top_p", label: "Top p", min: 0, minOpen: true, max: 1 },
    { el: ui.seed, key: "seed", param: "seed", label: "Seed", int: true, min: 0, max: Number.MAX_SAFE_INTEGER,
      optional: true },
  ];

  function fieldError(f) {
    return document.querySelector(`.field-error[data-for="${f.key}"]`);
  }

  // One field: {value} (undefined for an empty optional one) or {error}.
  function parseField(f) {
    const raw = f.el.value.trim();
    if (f.el.validity && f.el.validity.badInput) return { error: "not a number" };
    if (raw === "") return f.optional ? { value: undefined } : { error: "required" };
    const v = Number(raw);
    if (!Number.isFinite(v)) return { error: "not a number" };
    if (f.int && !Number.isInteger(v)) return { error: "must be a whole number" };
    const tooLow = f.minOpen ? v <= f.min : v < f.min;
    const hi = f.max !== undefined ? f.max : (f.int ? Number.MAX_SAFE_INTEGER : Infinity);
    if (tooLow || v > hi) {
      const range = `${f.minOpen ? "(" : "["}${f.min}, ${f.max !== undefined ? f.max : "∞"}]`;
      return { error: f.max === undefined && !f.minOpen ? `must be at least ${f.min}` : `must be in ${range}` };
    }
    return { value: v };
  }

  // The sampling parameters, or null (with the errors shown) when one is invalid.
  function readSettings(focusFirstBad) {
    const params = {};
    let firstBad = null;
    for (const f of fields) {
      const r = parseField(f);
      const errEl = fieldError(f);
      if (r.error) {
        f.el.setAttribute("aria-invalid", "true");
        if (errEl) errEl.textContent = `${f.label} ${r.error}.`;
        if (!firstBad) firstBad = f;
      } else {
        f.el.removeAttribute("aria-invalid");
        if (errEl) errEl.textContent = "";
        if (r.value !== undefined) params[f.param] = r.value;
      }
    }
    if (firstBad) {
      if (focusFirstBad) {
        openSettings(true);
        firstBad.el.focus();
      }
      return null;
    }
    return params;
  }

  function openSettings(open) {
    ui.settings.classList.toggle("open", open);
    ui.toggle.setAttribute("aria-expanded", String(open));
  }

  function saveSettings() {
    const s = {};
    for (const f of fields) s[f.key] = f.el.value;
    s.system = ui.system.value;
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
    } catch (e) { /* storage off: settings last for this page only */ }
  }

  function loadSettings() {
    let s = null;
    try {
      s = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "null");
    } catch (e) { s = null; }
    if (!s || typeof s !== "object") return;
    for (const f of fields) if (typeof s[f.key] === "string") f.el.value = s[f.key];
    if (typeof s.system === "string") ui.system.value = s.system;
  }

  function resetSettings() {
    for (const f of fields) f.el.value = DEFAULTS[f.key];
    ui.system.value = DEFAULTS.system;
    readSettings(false);
    saveSettings();
  }

  ui.toggle.addEventListener("click", () => openSettings(!ui.settings.classList.contains("open")));
  ui.reset.addEventListener("click", resetSettings);
  for (const f of fields) {
    f.el.addEventListener("input", () => { readSettings(false); saveSettings(); });
  }
  ui.system.addEventListener("input", saveSettings);

  loadSettings();
  readSettings(false);
  return { read: readSettings };
}
