// The mii_async chat page: plain JS, no framework, nothing from another host.
//
// It streams over the gateway's WebSocket (/v1/ws, protocol 1; see mii_async/gateway/ws.py):
//   ← hello {model, max_message_bytes, max_requests}
//   → generate {id, messages, max_new_tokens, temperature, top_p, seed?}   → cancel {id}
//   ← token {id, text, token_ids} …  then  done {id, finish_reason, usage}  or  error {id, code, message, param}
// Each request sends the whole conversation (the system prompt first). Model output is only ever put in the
// page as text (Text nodes / textContent), never as HTML. A dropped connection is retried with backoff.
"use strict";

function startChat() {
  const $ = (id) => document.getElementById(id);
  const ui = {
    messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    newChat: $("new-chat"), status: $("status"), settings: $("settings"), toggle: $("toggle-settings"),
    reset: $("reset-settings"), maxTokens: $("max-tokens"), temperature: $("temperature"), topP: $("top-p"),
    seed: $("seed"), system: $("system"),
  };
  const statusText = ui.status.querySelector(".status-text");

  const PROTOCOL = 1;
  const DEFAULTS = { "max-tokens": "256", temperature: "0.7", "top-p": "0.9", seed: "", system: "" };
  const SETTINGS_KEY = "mii_async.chat.settings";
  const STOP_FALLBACK_MS = 15000;   // a cancel the server never answers: end the request here anyway
  const RETRY_MIN_MS = 500, RETRY_MAX_MS = 10000;

  let ws = null;
  let connState = "connecting";
  let model = null;
  let maxMessageBytes = Infinity;
  let retries = 0, retryTimer = null, countdownTimer = null;
  let history = [];          // finished turns, as sent: {role, content}
  let current = null;        // the request being streamed (at most one)
  let seq = 0;

  // ---------------------------------------------------------------- connection

  function wsUrl() {
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    const key = new URLSearchParams(location.search).get("api_key");
    return `${proto}//${location.host}/v1/ws` + (key ? `?api_key=${encodeURIComponent(key)}` : "");
  }

  function isOpen() {
    return ws !== null && ws.readyState === WebSocket.OPEN && connState === "connected";
  }

  function setStatus(state, text) {
    connState = state;
    ui.status.setAttribute("data-state", state);
    statusText.textContent = text;
    updateButtons();
  }

  function connect() {
    clearTimeout(retryTimer);
    clearInterval(countdownTimer);
    retryTimer = countdownTimer = null;
    setStatus("connecting", "Connecting…");
    let sock;
    try {
      sock = new WebSocket(wsUrl());
    } catch (e) {
      scheduleReconnect();
      return;
    }
    ws = sock;
    sock.onmessage = (ev) => { if (sock === ws) onFrame(ev.data); };
    sock.onclose = () => {
      if (sock !== ws) return;
      ws = null;
      onDisconnected();
    };
    sock.onerror = () => {};   // a close event always follows
  }

  function onDisconnected() {
    model = null;
    if (current) {
      if (current.stopping) finish("abort");
      else finish("error", null, "The connection to the server was lost.");
    }
    scheduleReconnect();
  }

  function scheduleReconnect() {
    const base = Math.min(RETRY_MAX_MS, RETRY_MIN_MS * 2 ** retries);
    const delay = Math.round(base * (0.8 + 0.4 * Math.random()));
    retries += 1;
    const at = Date.now() + delay;
    const show = () => {
      const s = Math.max(0, Math.ceil((at - Date.now()) / 1000));
      setStatus("disconnected", s > 0 ? `Disconnected — reconnecting in ${s} s` : "Disconnected — reconnecting…");
    };
    show();
    clearInterval(countdownTimer);
    countdownTimer = setInterval(show, 1000);
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, delay);
  }

  function reconnectNow() {
    if (connState === "disconnected") {
      retries = 0;
      connect();
    }
  }

  function sendFrame(frame) {
    if (!isOpen()) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  function onFrame(data) {
    let f;
    try {
      f = JSON.parse(data);
    } catch (e) {
      return;
    }
    if (!f || typeof f !== "object") return;
    const mine = current !== null && f.id === current.id;
    switch (f.type) {
      case "hello":
        model = typeof f.model === "string" ? f.model : "unknown model";
        maxMessageBytes = Number.isFinite(f.max_message_bytes) ? f.max_message_bytes : Infinity;
        retries = 0;
        setStatus("connected", `Connected · ${model}`);
        if (f.protocol !== PROTOCOL) notice(`The server speaks protocol ${f.protocol}; this page expects ${PROTOCOL}.`);
        break;
      case "token":
        if (mine) appendText(f);
        break;
      case "done":
        if (mine) finish(f.finish_reason || "stop", f.usage);
        break;
      case "error":
        if (mine) finish("error", null, describeError(f));
        else if (f.id === null || f.id === undefined) notice(describeError(f));
        // else: an error of a request this page already gave up (New chat): nothing to show
        break;
      default:
        break;   // pong and anything newer
    }
  }

  function describeError(f) {
    const msg = typeof f.message === "string" && f.message ? f.message : "request failed";
    return f.code ? `${msg} (${f.code})` : msg;
  }

  // ---------------------------------------------------------------- conversation

  function nearBottom() {
    const m = ui.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
  }

  function scrollToBottom() {
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function addMessage(role, text) {
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "user" ? "You" : "Assistant";
    const body = document.createElement("div");
    body.className = "body";
    const textNode = document.createTextNode(text);
    body.appendChild(textNode);
    el.append(label, body);
    ui.messages.appendChild(el);
    scrollToBottom();
    return { el, body, textNode };
  }

  function notice(text) {
    const stick = nearBottom();
    const el = document.createElement("div");
    el.className = "notice";
    el.setAttribute("role", "alert");
    el.textContent = text;
    ui.messages.appendChild(el);
    if (stick) scrollToBottom();
  }

  function appendText(f) {
    const text = typeof f.text === "string" ? f.text : "";
    current.tokens += Array.isArray(f.token_ids) ? f.token_ids.length : 0;
    if (!text) return;
    const stick = nearBottom();
    current.text += text;
    current.textNode.appendData(text);
    if (stick) scrollToBottom();
  }

  function finish(reason, usage, errorText) {
    const c = current;
    current = null;
    clearTimeout(c.stopTimer);
    c.el.classList.remove("streaming");
    c.el.removeAttribute("aria-busy");
    c.el.setAttribute("data-finish", reason);

    const tokens = usage && Number.isFinite(usage.completion_tokens) ? usage.completion_tokens : c.tokens;
    const secs = (performance.now() - c.started) / 1000;
    const stats = `${tokens} token${tokens === 1 ? "" : "s"} · ${secs.toFixed(1)} s` +
      (tokens > 1 && secs > 0 ? ` · ${(tokens / secs).toFixed(1)} tok/s` : "");
    const meta = document.createElement("div");
    meta.className = "meta";
    if (reason === "stop") meta.textContent = stats;
    else if (reason === "length") meta.textContent = `Cut off at max new tokens (${c.maxNewTokens}) · ${stats}`;
    else if (reason === "abort") meta.textContent = `Stopped · ${stats}`;
    else meta.textContent = "Failed";

    if (reason === "error") {
      const err = document.createElement("div");
      err.className = "error-text";
      err.textContent = errorText || "The request failed.";
      if (!c.text) c.body.classList.add("empty");
      c.el.append(err, meta);
      // A failed turn stays on screen but is not part of the history sent next time.
    } else {
      c.el.append(meta);
      history.push({ role: "user", content: c.user }, { role: "assistant", content: c.text });
    }
    if (nearBottom()) scrollToBottom();
    updateButtons();
  }

  function send() {
    if (current !== null || !isOpen()) return;
    const text = ui.prompt.value.trim();
    if (!text) {
      ui.prompt.focus();
      return;
    }
    const params = readSettings(true);
    if (params === null) return;

    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });
    seq += 1;
    const id = `c${seq}-${Date.now().toString(36)}`;
    const frame = { type: "generate", id, messages, ...params };
    const json = JSON.stringify(frame);
    const bytes = new TextEncoder().encode(json).length;
    if (bytes > maxMessageBytes) {
      notice(`The conversation is too long to send (${bytes} bytes; the server takes at most ${maxMessageBytes}). ` +
             "Start a new chat.");
      return;
    }

    addMessage("user", text);
    const a = addMessage("assistant", "");
    a.el.classList.add("streaming");
    a.el.setAttribute("aria-busy", "true");     // screen readers: read it once it is complete
    current = { id, ...a, text: "", tokens: 0, user: text, started: performance.now(), stopping: false,
                stopTimer: null, maxNewTokens: params.max_new_tokens };
    ws.send(json);
    ui.prompt.value = "";
    autosize();
    updateButtons();
  }

  function stop() {
    if (current === null || current.stopping) return;
    current.stopping = true;
    if (sendFrame({ type: "cancel", id: current.id })) {
      const c = current;
      c.stopTimer = setTimeout(() => { if (current === c) finish("abort"); }, STOP_FALLBACK_MS);
    } else {
      finish("abort");
    }
    updateButtons();
  }

  function newChat() {
    if (current !== null) {
      if (!current.stopping) sendFrame({ type: "cancel", id: current.id });
      clearTimeout(current.stopTimer);
      current = null;      // its remaining frames are ignored
    }
    history = [];
    ui.messages.replaceChildren();
    updateButtons();
    ui.prompt.focus();
  }

  function updateButtons() {
    ui.send.disabled = current !== null || connState !== "connected";
    ui.stop.disabled = current === null || current.stopping;
  }

  function autosize() {
    const p = ui.prompt;
    p.style.height = "auto";
    p.style.height = `${Math.min(p.scrollHeight + 2, 220)}px`;
  }

  // ---------------------------------------------------------------- settings

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

  // ---------------------------------------------------------------- wiring

  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (e) => {
    // Enter sends, Shift+Enter is a new line; Enter that confirms an IME composition does neither.
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      send();
    }
  });
  ui.prompt.addEventListener("input", autosize);
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", newChat);
  ui.toggle.addEventListener("click", () => openSettings(!ui.settings.classList.contains("open")));
  ui.reset.addEventListener("click", resetSettings);
  for (const f of fields) {
    f.el.addEventListener("input", () => { readSettings(false); saveSettings(); });
  }
  ui.system.addEventListener("input", saveSettings);
  ui.status.addEventListener("click", reconnectNow);
  window.addEventListener("online", reconnectNow);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) reconnectNow(); });

  loadSettings();
  readSettings(false);
  updateButtons();
  connect();
  ui.prompt.focus();
}

// index.html inserts this script from its head (to pass on ?api_key=): it may run before the body is parsed.
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startChat);
else startChat();
