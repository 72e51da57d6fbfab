// The mii_async chat page: plain JS, no framework, nothing from another host.
//
// It streams over the gateway's WebSocket (/v1/ws, protocol 1; see mii_async/gateway/ws.py):
//   ← hello {model, max_message_bytes, max_requests}
//   → generate {id, messages, max_new_tokens, temperature, top_p, seed?}   → cancel {id}
//   ← token {id, text, token_ids} …  then  done {id, finish_reason, usage}  or  error {id, code, message, param}
// Each request sends the whole conversation (the system prompt first); once it outgrows the context, the
// oldest turns are left out (as `mii-async chat` does). Model output is only ever put in the
// page as text (Text nodes / textContent), never as HTML. A dropped connection is retried with backoff.
"use strict";

// This script's own URL (…/static/chat.js): the gateway's routes are found relative to it (index.html loads
// it from the page's own path). Only known while the script first runs.
const SCRIPT_URL = document.currentScript ? document.currentScript.src
  : location.origin + location.pathname.replace(/^\/+/, "/").replace(/\/*$/, "/") + "static/chat.js";

function startChat() {
  const $ = (id) => document.getElementById(id);
  const ui = {
    messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    newChat: $("new-chat"), status: $("status"), system: $("system"),
  };
  const statusText = ui.status.querySelector(".status-text");
  const settings = chatSettings();   // static/settings.js

  const PROTOCOL = 1;
  const STOP_FALLBACK_MS = 15000;   // a cancel the server never answers: end the request here anyway
  const RETRY_MIN_MS = 500, RETRY_MAX_MS = 10000;
  // request_too_long naming one of these: the prompt and the answer do not fit together (not prompt_logprobs).
  const CONTEXT_PARAMS = new Set(["max_new_tokens", "prompt", "messages"]);

  let ws = null;
  let connState = "connecting";
  let model = null;
  let maxMessageBytes = Infinity;
  let retries = 0, retryTimer = null, countdownTimer = null;
  let history = [];          // finished turns, as sent: {role, content}
  let forgotten = 0;         // history[0:forgotten] is no longer sent: the conversation outgrew the context
  let current = null;        // the request being streamed (at most one)
  let seq = 0;

  // ---------------------------------------------------------------- connection

  function wsUrl() {
    // Next to static/, where this script came from: /v1/ws, or /mii/v1/ws behind a proxy's /mii/ prefix.
    const u = new URL("../v1/ws", SCRIPT_URL);
    u.protocol = u.protocol === "https:" ? "wss:" : "ws:";
    const key = new URLSearchParams(location.search).get("api_key");
    u.search = key ? `?api_key=${encodeURIComponent(key)}` : "";
    return u.href;
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
        if (mine) {
          keepShorterHistory(current);
          appendText(f);
        }
        break;
      case "done":
        if (mine) finish(f.finish_reason || "stop", f.usage);
        break;
      case "error":
        if (mine && !retryShorter(f)) finish("error", null, describeError(f));
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

  function notice(text, before) {
    const stick = nearBottom();
    const el = document.createElement("div");
    el.className = "notice";
    el.setAttribute("role", "alert");
    el.textContent = text;
    ui.messages.insertBefore(el, before || null);
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
      if (reason !== "abort") keepShorterHistory(c);
      c.el.append(meta);
      history.push({ role: "user", content: c.user }, { role: "assistant", content: c.text });
    }
    if (nearBottom()) scrollToBottom();
    updateButtons();
  }

  function nextId() {
    seq += 1;
    return `c${seq}-${Date.now().toString(36)}`;
  }

  // The generate frame of request c: the system prompt, the history from c.from on, then c's question.
  function frameFor(c) {
    const messages = [];
    if (c.system) messages.push({ role: "system", content: c.system });
    messages.push(...history.slice(c.from), { role: "user", content: c.user });
    return JSON.stringify({ type: "generate", id: c.id, messages, ...c.params });
  }

  // Refused as too long for the context (or the KV pool) while older turns are still sent: send the question
  // again without the oldest one. A refusal comes before any token; the window is kept once the model answers.
  function retryShorter(f) {
    const c = current;
    if (f.code !== "request_too_long" || !CONTEXT_PARAMS.has(f.param) || c.stopping || c.tokens > 0 ||
        c.from >= history.length || !isOpen()) return false;
    c.from += 2;
    c.id = nextId();
    ws.send(frameFor(c));
    return true;
  }

  function keepShorterHistory(c) {
    if (c.from <= forgotten) return;
    notice(`The conversation outgrew the model's context: its first ${c.from} messages are no longer sent ` +
           "with new questions (they stay on screen).", c.userEl);
    forgotten = c.from;
  }

  function send() {
    if (current !== null || !isOpen()) return;
    const text = ui.prompt.value.trim();
    if (!text) {
      ui.prompt.focus();
      return;
    }
    const params = settings.read(true);
    if (params === null) return;

    const c = { id: nextId(), user: text, system: ui.system.value.trim(), params, from: forgotten };
    const size = (s) => new TextEncoder().encode(s).length;
    let json = frameFor(c);
    while (size(json) > maxMessageBytes && c.from < history.length) {
      c.from += 2;                                // the oldest turns go first here too
      json = frameFor(c);
    }
    if (size(json) > maxMessageBytes) {
      notice(`The message is too long to send (${size(json)} bytes; the server takes at most ${maxMessageBytes}).`);
      return;
    }

    const u = addMessage("user", text);
    const a = addMessage("assistant", "");
    a.el.classList.add("streaming");
    a.el.setAttribute("aria-busy", "true");     // screen readers: read it once it is complete
    current = Object.assign(c, a, { userEl: u.el, text: "", tokens: 0, started: performance.now(),
                                    stopping: false, stopTimer: null, maxNewTokens: params.max_new_tokens });
    ws.send(json);
    ui.prompt.value = "";
    autosize();
    updateButtons();
    ui.prompt.focus();                            // after a click on Send too: type the next one right away
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
    forgotten = 0;
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
  ui.status.addEventListener("click", reconnectNow);
  window.addEventListener("online", reconnectNow);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) reconnectNow(); });

  updateButtons();
  connect();
  ui.prompt.focus();
}

// index.html inserts this script from its head (to pass on ?api_key=): it may run before the body is parsed.
if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startChat);
else startChat();
