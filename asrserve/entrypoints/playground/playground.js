// The asrserve playground: calls this server's public API the way any client does.
// Plain browser JavaScript, no build step and nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const LIVE_RATE = 24000; // OpenAI's audio/pcm rate; the server also takes 16 kHz
const KEY_STORAGE = "asrserve-playground-api-key";

function setStatus(id, text, isError = false) {
  const element = $(id);
  element.textContent = text;
  element.classList.toggle("error", isError);
}

function apiKey() {
  return $("api-key").value.trim();
}

// A header holds printable ASCII only: fetch refuses anything else (a pasted zero-width space)
// with a message about ISO-8859-1 that reads like a network failure.
const UNSENDABLE_KEY = "the API key holds a character a request cannot carry (an invisible one, pasted?): type it again";

function authHeaders() {
  const key = apiKey();
  if (/[^\x21-\x7e]/.test(key)) throw new Error(UNSENDABLE_KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// OpenAI's error shape: {"error": {"message": ...}}
async function errorMessage(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error.message}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// URLs are relative to the page, so that it works behind a reverse proxy's path prefix too.
async function loadModels() {
  const select = $("model");
  const response = await fetch("v1/models", { headers: authHeaders() });
  if (!response.ok) {
    setStatus("server-status", `models: ${await errorMessage(response)}`, true);
    return;
  }
  const { data } = await response.json();
  const chosen = select.value;
  const names = data.map((model) => model.id);
  if (names.join("\n") !== [...select.options].map((option) => option.value).join("\n")) {
    select.replaceChildren(...names.map((name) => new Option(name, name))); // (an open list stays open)
  }
  if (names.includes(chosen)) select.value = chosen;
  const ready = data.every((model) => model.ready);
  setStatus("server-status", ready ? "ready" : "loading the model…");
  // Ready, it is asked again now and then: a server that went away is then shown so.
  pollTimer = setTimeout(pollModels, ready ? 10000 : 1000);
}

// Until the model is ready, then now and then; every 2 s while the server cannot be reached
// (restarting, say). A key that cannot be sent is said once, not retried.
let pollTimer = null;
function pollModels() {
  clearTimeout(pollTimer);
  loadModels().catch((error) => {
    if (error.message === UNSENDABLE_KEY) {
      setStatus("server-status", error.message, true);
      return;
    }
    setStatus("server-status", `server unreachable (${error.message}); retrying`, true);
    pollTimer = setTimeout(pollModels, 2000);
  });
}

// A control that is a span or a cell: reachable with Tab, Enter or Space plays from it.
function playable(element, start) {
  element.tabIndex = 0;
  element.setAttribute("role", "button");
  element.addEventListener("click", () => playFrom(start));
  element.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      playFrom(start);
    }
  });
  return element;
}

// --- a file: verbose_json with segment and word timestamps ------------------------------

function seconds(value) {
  return value.toFixed(2);
}

function playFrom(start) {
  const player = $("player");
  player.currentTime = start;
  player.play().catch(() => {}); // the browser may refuse to play without a gesture; seeking still shows where
}

function wordElement(word) {
  const span = document.createElement("span");
  span.className = "word";
  span.dataset.start = word.start;
  span.dataset.end = word.end;
  span.title = `${seconds(word.start)}–${seconds(word.end)} s`;
  span.append(word.word.trim(), Object.assign(document.createElement("small"), { textContent: seconds(word.start) }));
  return playable(span, word.start);
}

// Words are listed beside the segments (OpenAI's verbose_json): each goes to the segment its
// middle falls in.
function segmentRows(segments, words) {
  return segments.map((segment, index) => {
    const row = document.createElement("tr");
    const start = Object.assign(document.createElement("td"), { className: "time", textContent: seconds(segment.start) });
    const end = Object.assign(document.createElement("td"), { className: "time", textContent: seconds(segment.end) });
    playable(start, segment.start);
    const text = document.createElement("td");
    const last = index === segments.length - 1;
    const inside = words.filter((word) => {
      const middle = (word.start + word.end) / 2;
      return middle >= segment.start && (middle < segment.end || last);
    });
    // A space where the next word begins with one (lines wrap there); "self" "-substantial" stay joined.
    const spaced = (word, i) => (i + 1 < inside.length && inside[i + 1].word.startsWith(" ") ? [wordElement(word), " "] : [wordElement(word)]);
    if (inside.length > 0) text.append(...inside.flatMap(spaced));
    else text.textContent = segment.text;
    row.append(start, end, text);
    return row;
  });
}

async function transcribeFile() {
  const file = $("file").files[0];
  if (!file) {
    setStatus("upload-status", "choose a file first", true);
    return;
  }
  const form = new FormData();
  form.append("file", file);
  form.append("model", $("model").value);
  form.append("response_format", "verbose_json");
  form.append("timestamp_granularities[]", "segment");
  form.append("timestamp_granularities[]", "word");
  const language = $("language").value.trim();
  if (language) form.append("language", language);
  const prompt = $("prompt").value.trim();
  if (prompt) form.append("prompt", prompt);
  const endpoint = $("task").value === "translate" ? "v1/audio/translations" : "v1/audio/transcriptions";

  const player = $("player");
  if (player.src) URL.revokeObjectURL(player.src);
  player.src = URL.createObjectURL(file);
  player.hidden = false;
  $("upload-text").textContent = "";
  $("segments").hidden = true;
  $("transcribe").disabled = true;
  setStatus("upload-status", "transcribing…");
  const started = performance.now();
  try {
    const response = await fetch(endpoint, { method: "POST", headers: authHeaders(), body: form });
    if (!response.ok) {
      setStatus("upload-status", await errorMessage(response), true);
      return;
    }
    const result = await response.json();
    const elapsed = (performance.now() - started) / 1000;
    $("upload-text").textContent = result.text;
    $("segments").tBodies[0].replaceChildren(...segmentRows(result.segments || [], result.words || []));
    $("segments").hidden = false;
    setStatus("upload-status", `${result.duration.toFixed(1)} s of ${result.language} in ${elapsed.toFixed(2)} s`);
  } catch (error) {
    setStatus("upload-status", `failed: ${error.message}`, true);
  } finally {
    $("transcribe").disabled = false;
  }
}

// --- live: the microphone over WS /v1/realtime ----------------------------------------

let live = null; // the running session: {socket, stream, context, pending, stopping}

function base64(buffer) {
  const bytes = new Uint8Array(buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function liveItem(itemId) {
  let item = document.getElementById(`item-${itemId}`);
  if (!item) {
    item = document.createElement("li");
    item.id = `item-${itemId}`;
    item.append(Object.assign(document.createElement("span"), { className: "text" }));
    $("live-items").append(item);
  }
  return item;
}

function onLiveEvent(session, event) {
  const item = event.item_id ? liveItem(event.item_id) : null;
  switch (event.type) {
    case "session.created": // (a server without VAD refuses the page's server_vad: manual turns)
      session.vad = Boolean(event.session.audio.input.turn_detection);
      break;
    case "session.updated":
      session.vad = Boolean(event.session.audio.input.turn_detection);
      setStatus("live-status", "listening: speak");
      break;
    case "input_audio_buffer.speech_started":
      session.turnOpen = true;
      item.className = "speaking";
      item.dataset.startMs = event.audio_start_ms;
      break;
    case "input_audio_buffer.speech_stopped":
      item.dataset.endMs = event.audio_end_ms;
      item.dataset.stoppedAt = performance.now();
      break;
    case "input_audio_buffer.committed":
      session.pending.add(event.item_id);
      session.turnOpen = session.awaitingCommit = session.appended = false; // (Stop's, or server VAD's before it)
      break;
    case "conversation.item.input_audio_transcription.delta":
      item.querySelector(".text").textContent += event.delta;
      break;
    case "conversation.item.input_audio_transcription.completed": {
      item.className = "final";
      item.querySelector(".text").textContent = event.transcript; // equals the deltas joined
      if (item.dataset.stoppedAt) {
        // where server VAD heard the turn in the stream, and how long its transcript took after
        const span = `${seconds(item.dataset.startMs / 1000)}–${seconds(item.dataset.endMs / 1000)} s`;
        const latency = Math.round(performance.now() - Number(item.dataset.stoppedAt));
        item.append(Object.assign(document.createElement("small"), { textContent: `  ${span}, ${latency} ms` }));
      }
      session.pending.delete(event.item_id);
      break;
    }
    case "conversation.item.input_audio_transcription.failed":
      item.className = "failed";
      item.querySelector(".text").textContent = `failed: ${event.error.message}`;
      session.pending.delete(event.item_id);
      break;
    case "error":
      // Stopping commits the open turn; if it had just been committed, the server says so. Not news.
      if (session.stopping && event.error.code === "input_audio_buffer_commit_empty") session.awaitingCommit = false;
      else setStatus("live-status", event.error.message, true);
      // The model, language or prompt asked for was refused: transcribing on without them would
      // show text made with settings nobody chose (server VAD refused: turns are committed on Stop).
      if ((event.error.param || "").startsWith("session.audio.input.transcription")) {
        session.failed = session.stopping = true;
        stopCapture(session);
        session.socket.close(1000);
      }
      break;
  }
  closeWhenDone(session);
}

// A stopping session closes once its last turn is committed and every transcript is in: an
// event arriving between Stop and the commit's answer closed it, and that turn was lost.
function closeWhenDone(session) {
  if (session.stopping && !session.awaitingCommit && session.pending.size === 0) session.socket.close(1000);
}

// An 8th-order Butterworth low-pass as four biquads: their Q values, in decibels (the unit Web
// Audio's low-pass takes), of 1 / (2 cos((2k + 1) pi / 16)) for k = 0..3.
const BUTTERWORTH8_Q_DB = [0.5098, 0.6013, 0.9, 2.5629].map((q) => 20 * Math.log10(q));

// Connects `source` to the worklet that posts 16-bit PCM chunks at LIVE_RATE to onChunk. Where the
// context runs faster than that (the browser could not capture at LIVE_RATE itself), a low-pass
// at 0.45 x LIVE_RATE goes first: the worklet's interpolation alone folds what lies above the
// new Nyquist frequency (a 20 kHz hiss at 48 kHz) down into the speech band (to 4 kHz).
async function connectCapture(context, source, onChunk) {
  await context.audioWorklet.addModule("playground/pcm-worklet.js");
  const capture = new AudioWorkletNode(context, "pcm16-capture", { processorOptions: { targetRate: LIVE_RATE } });
  capture.port.onmessage = ({ data }) => onChunk(data);
  let last = source;
  if (context.sampleRate > LIVE_RATE) {
    for (const Q of BUTTERWORTH8_Q_DB) {
      const filter = new BiquadFilterNode(context, { type: "lowpass", frequency: 0.45 * LIVE_RATE, Q });
      last.connect(filter);
      last = filter;
    }
  }
  last.connect(capture);
  capture.connect(context.destination); // silent: it writes no output, but is pulled
}

async function startCapture(session) {
  session.stream = await navigator.mediaDevices.getUserMedia({
    // Whisper was trained on unprocessed audio: no echo cancelling, denoising or gain riding.
    audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
  });
  let source;
  try {
    session.context = new AudioContext({ sampleRate: LIVE_RATE }); // the browser resamples the microphone
    source = session.context.createMediaStreamSource(session.stream);
  } catch {
    // Browsers that cannot mix rates: capture at the microphone's own, the worklet resamples.
    if (session.context) session.context.close();
    session.context = new AudioContext();
    source = session.context.createMediaStreamSource(session.stream);
  }
  await connectCapture(session.context, source, (chunk) => {
    if (session.socket.readyState === WebSocket.OPEN && !session.stopping) {
      session.socket.send(JSON.stringify({ type: "input_audio_buffer.append", audio: base64(chunk) }));
      session.appended = true;
    }
  });
  await session.context.resume();
}

// Called on Stop, on close and after a capture that started too late: each part once.
function stopCapture(session) {
  if (session.stream) session.stream.getTracks().forEach((track) => track.stop());
  if (session.context && session.context.state !== "closed") session.context.close().catch(() => {});
  session.stream = session.context = null;
}

async function startLive() {
  if (!window.isSecureContext || !navigator.mediaDevices) {  // (checked before a session is opened)
    throw new Error("the microphone needs this page served over https, or from localhost: browsers give "
      + "no microphone to other plain-http pages");
  }
  const protocols = ["realtime"];
  if (apiKey()) protocols.push(`openai-insecure-api-key.${apiKey()}`);
  const url = new URL("v1/realtime?intent=transcription", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  let socket;
  try {
    socket = new WebSocket(url, protocols);
  } catch {
    // Its message would show the key. A subprotocol is a token: no slash, equals sign, comma or space.
    throw new Error("this API key cannot go in a WebSocket subprotocol (a browser's only way to send one): "
      + "live transcription needs a key of letters, digits and - _ . ~ + only");
  }
  const session = {
    socket, stream: null, context: null, pending: new Set(), stopping: false, opened: false, closed: false,
    vad: true, turnOpen: false, appended: false, awaitingCommit: false, failed: false,
  };
  live = session;
  $("live").textContent = "Stop";
  setStatus("live-status", "connecting…");
  socket.onmessage = (message) => onLiveEvent(session, JSON.parse(message.data));
  socket.onclose = (event) => {
    session.closed = true;
    stopCapture(session);
    for (const itemId of session.pending) {  // committed, but its transcript never came
      const item = liveItem(itemId);
      item.className = "failed";
      item.querySelector(".text").textContent += " [cut off: the connection closed before the transcript came]";
    }
    if (live === session) endLive();
    if (!session.stopping) {
      // A refused handshake shows as 1006 with no reason; the browser does not say why.
      const why = event.reason || (!session.opened
        ? "could not connect: the server is down, or refused the API key or this page's origin (--allowed-origins)"
        : event.code === 1012 ? "the server is restarting" : event.code === 1006 ? "connection lost" : `code ${event.code}`);
      setStatus("live-status", `connection closed: ${why}`, true);
    } else if (!session.failed) {  // (a microphone error stays shown)
      setStatus("live-status", "stopped");
    }
  };
  await new Promise((resolve, reject) => {
    socket.onopen = resolve;
    socket.onerror = () => reject(new Error("could not connect"));
  });
  session.opened = true;
  if (session.stopping) {  // Stop while it connected
    socket.close(1000);
    return;
  }
  const transcription = { model: $("model").value };
  const language = $("language").value.trim();
  if (language) transcription.language = language;
  const prompt = $("prompt").value.trim();
  if (prompt) transcription.prompt = prompt;
  socket.send(JSON.stringify({
    type: "session.update",
    session: {
      type: "transcription",
      audio: {
        input: {
          format: { type: "audio/pcm", rate: LIVE_RATE },
          transcription,
          turn_detection: { type: "server_vad" },
        },
      },
    },
  }));
  try {
    await startCapture(session);
  } catch (error) {
    // (A Stop or a close while the microphone opened is no microphone error.)
    if (!session.stopping && !session.closed) {
      session.failed = true;
      setStatus("live-status", `microphone: ${error.message}`, true);
    }
    session.stopping = true;
    socket.close(1000);
  }
  // The session may have ended while the microphone was being opened: release it then.
  if (session.closed || session.stopping) stopCapture(session);
}

// Stop: the microphone stops at once; what was said last is committed and its transcript
// still arrives before the socket closes.
function stopLive() {
  const session = live;
  session.stopping = true;
  stopCapture(session);
  if (session.socket.readyState !== WebSocket.OPEN) return;
  setStatus("live-status", "finishing…");
  // Not for ever; a long last turn's final decode takes seconds on a CPU (15 s cut one off).
  setTimeout(() => session.socket.close(1000), 120000);
  // Between server VAD's turns there is nothing to commit: the server would commit the silence
  // it keeps as a turn's prefix padding, and Whisper reads silence as "you".
  if (session.turnOpen || (!session.vad && session.appended)) {  // (without VAD, all of it is the turn)
    session.awaitingCommit = true;
    session.socket.send(JSON.stringify({ type: "input_audio_buffer.commit" }));
  }
  closeWhenDone(session);
}

function endLive() {
  live = null;
  $("live").textContent = "Live";
}

function toggleLive() {
  if (live) stopLive();
  else startLive().catch((error) => {
    setStatus("live-status", error.message, true);
    endLive();
  });
}

$("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem(KEY_STORAGE, apiKey());
  pollModels();
});
$("transcribe").addEventListener("click", transcribeFile);
$("live").addEventListener("click", toggleLive);
pollModels();
