// The page: wires the text box, suggestion bar, Complete button and Self-test to the modules above.
// Everything runs in this browser; the server (hrm_edge/app/demo.py) only hands out files. /demo.json says
// which models, tokenizer and web parity bundle this export has.
import { generate, promptEnd } from "./generate.mjs";
import { healPrompt, textAfter } from "./healing.mjs";
import { AdaptiveModel, BranchModel, KvModel, fetchOk, loadTokenizer, runtimeInfo } from "./model.mjs";
import { loadWebBundle, selfTest } from "./selftest.mjs";
import { Lookahead, likelyKeys } from "./lookahead.mjs";
import { TypedContext } from "./suggest.mjs";

const $ = (id) => document.getElementById(id);
// A run starts this long after the last key (docs/keyboard-measurements.md): shorter than the gap between a
// phone typist's keys (~150-300 ms), so the chips follow every key with the run's time added; keys closer than
// this (auto-repeat, a paste) share one run.
const SUGGEST_DEBOUNCE_MS = 30;
const state = { config: null, tokenizer: null, model: null, draft: null, modelInfo: null, lookahead: null,
                bundle: null, busy: false, stop: false, suggestTimer: 0, suggesting: null, adaptive: null };
// read by tests/test_demo.py (and handy in the browser console)
window.hrmDemo = { lastCompletion: null, lastSelfTest: null, lastSuggestions: null, state };

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

function setBusy(busy) {
  state.busy = busy;
  if (busy) state.lookahead?.stop(); // the chips computed ahead wait: Complete and Self-test run the same sessions
  for (const id of ["complete", "selftest"]) $(id).disabled = busy || !state.model;
  $("model").disabled = busy || !state.config; // another program can be chosen after one failed to load
  $("text").readOnly = busy; // Complete writes the box while it runs: a key typed meanwhile would be overwritten
  $("stop").disabled = !busy;
}

// Hand the event loop a turn (so text and numbers repaint) without setTimeout's 4 ms clamp.
function yieldToBrowser() {
  return new Promise((resolve) => {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => resolve();
    channel.port2.postMessage(0);
  });
}

// The program `info` names, whole: its KV graph, the graph that extends the chips' words and the typed context over
// them, warmed up ({model, draft, lookahead}). A failure releases the sessions made so far.
async function loadProgram(info) {
  const maxSeqLen = state.config.max_seq_len, made = [];
  try {
    const model = await KvModel.load(info.url, maxSeqLen, info.weights);
    made.push(model.session);
    // the suggestion bar extends its words with the first outer cycle where the export has it: the branch graph (its
    // rows share the context's cache), else the draft graph (?draft=0: with the full depth, to compare)
    const useDraft = new URLSearchParams(location.search).get("draft") !== "0";
    const draft = !useDraft ? null
      : info.branch_url ? await BranchModel.load(info.branch_url, maxSeqLen, info.weights)
        : info.draft_url ? await KvModel.load(info.draft_url, maxSeqLen, info.weights) : null;
    if (draft) made.push(draft.session);
    const context = new TypedContext(model, draft);
    await context.warmUp(state.tokenizer); // the first keystroke then costs what the others do
    return { model, draft, lookahead: new Lookahead(context, state.tokenizer) }; // and the likeliest next keys' chips
  } catch (e) {
    await Promise.all(made.map((session) => session.release()));
    throw e;
  }
}

// The sessions of the program in use (its adaptive-depth graphs too, if Complete loaded them): onnxruntime-web frees
// a session's WASM memory only when it is released.
function programSessions() {
  return [state.model?.session, state.draft?.session, state.adaptive?.model.draft.session,
          state.adaptive?.model.verify].filter(Boolean);
}

async function selectModel(id) {
  const info = state.config.models.find((m) => m.id === id);
  setBusy(true);
  await state.lookahead?.stop(); // the graph calls in flight end before their sessions go
  await state.suggesting?.catch(() => {});
  $("status").dataset.ready = "";
  setStatus(`loading ${info.id}…`);
  const t = performance.now();
  const program = await loadProgram(info); // on a failure the program in use stays
  const old = programSessions();
  Object.assign(state, { ...program, modelInfo: info, adaptive: null });
  await Promise.all(old.map((session) => session.release()));
  const gate = info.passed ? "passed the export's parity gate" : "FAILED the export's parity gate";
  setStatus(`${info.id} loaded in ${Math.round(performance.now() - t)} ms (${gate})`, !info.passed);
  $("status").dataset.ready = "1";
  $("status").dataset.model = info.id;
  const rt = runtimeInfo();
  $("runtime").textContent = `onnxruntime-web ${rt.version}, WASM, ${rt.threads || "auto"} thread(s), ` +
    `cross-origin isolated: ${rt.isolated ? "yes" : "no (one thread)"}`;
  setBusy(false);
  scheduleSuggestions();
}

function textBeforeCursor() {
  const box = $("text");
  return box.value.slice(0, box.selectionStart);
}

function scheduleSuggestions() {
  clearTimeout(state.suggestTimer);
  state.suggestTimer = setTimeout(showSuggestions, SUGGEST_DEBOUNCE_MS);
}

async function showSuggestions() {
  if (state.busy || !state.model) return;
  if (state.suggesting) { scheduleSuggestions(); return; } // one run at a time; retry after it
  const text = textBeforeCursor();
  state.suggesting = state.lookahead.suggest(text);
  try {
    const { words, ms } = await state.suggesting;
    // typed on meanwhile (a newer run is scheduled), or Complete / Self-test began: no chips, no work ahead
    if (state.busy || text !== textBeforeCursor()) return;
    state.lookahead.start(text, likelyKeys(state.lookahead.context, state.tokenizer, text, words));
    const chips = words.map((w) => {
      const chip = document.createElement("button");
      chip.className = "suggestion";
      chip.textContent = w.label;
      chip.title = `p = ${w.probability.toFixed(3)}`;
      // a chip is for the text it was computed for: after a key typed since, its insert would land in a new word
      chip.onclick = () => (textBeforeCursor() === text ? insertAtCursor(w.insert) : scheduleSuggestions());
      return chip;
    });
    $("suggestions").replaceChildren(...chips);
    $("suggest-time").textContent = `${Math.round(ms)} ms`;
    window.hrmDemo.lastSuggestions = { text, words, ms };
  } finally {
    state.suggesting = null;
  }
}

function insertAtCursor(insert) {
  const box = $("text");
  box.setRangeText(insert, box.selectionStart, box.selectionEnd, "end");
  box.focus();
  scheduleSuggestions();
}

function completionSettings() {
  return { maxNewTokens: Math.max(1, parseInt($("max-new").value, 10) || 64),
           temperature: Math.max(0, parseFloat($("temperature").value) || 0),
           topK: Math.max(0, parseInt($("top-k").value, 10) || 0), seed: 0, eosId: state.config.tokenizer.eos_id,
           repetitionPenalty: Math.min(10, Math.max(1, parseFloat($("repetition").value) || 1)),
           lookupLen: Math.min(64, Math.max(0, parseInt($("lookup").value, 10) || 0)),
           draftLen: Math.min(8, Math.max(0, parseInt($("draft").value, 10) || 0)),
           exitThreshold: $("exit").value === "" ? null : Math.min(1, Math.max(0, parseFloat($("exit").value) || 0)) };
}

// The current program's draft + verify graphs for adaptive depth and draft rounds, loaded on first use (null if it
// has none).
async function adaptiveModel() {
  const info = state.modelInfo;
  if (!info.draft_url || !info.verify_url) return null;
  if (state.adaptive?.id !== info.id) {
    state.adaptive = { id: info.id, model: await AdaptiveModel.load(info.draft_url, info.verify_url,
                                                                    state.config.max_seq_len, info.weights) };
  }
  return state.adaptive.model;
}

async function complete() {
  const box = $("text");
  const before = textBeforeCursor(), after = box.value.slice(box.selectionStart);
  let prompt = state.tokenizer.encode(before);
  if (prompt.length === 0) { setStatus("type something to complete first", true); return; }
  const truncated = prompt.length > state.model.maxSeqLen - 1; // no room for one new token: its end is kept
  const asked = completionSettings();
  prompt = promptEnd(prompt, state.model.maxSeqLen, asked.maxNewTokens);
  // token healing: the healed first token re-spells the prompt's last token, so its bytes are not shown
  const { context, heal } = healPrompt(prompt, state.tokenizer.bytes);
  const skip = heal ? heal.prefix.length : 0;
  setBusy(true);
  state.stop = false;
  $("suggestions").replaceChildren();
  const newIds = [];
  let shown = "", lastPaint = performance.now();
  const onToken = async (token) => {
    newIds.push(token);
    const text = textAfter(newIds, state.tokenizer.bytes, skip);
    if (!text.endsWith("\ufffd")) shown = text; // wait until a multi-byte character is complete
    if (performance.now() - lastPaint > 40) {
      box.value = before + shown + after;
      lastPaint = performance.now();
      await yieldToBrowser();
    }
  };
  try {
    const settings = { ...asked, heal };
    if (settings.exitThreshold !== null) {
      settings.adaptive = await adaptiveModel();
      if (!settings.adaptive) throw new Error(`${state.modelInfo.id} has no draft and verify graphs (adaptive depth)`);
    } else if (settings.draftLen > 0 && settings.temperature === 0) {
      settings.speculative = await adaptiveModel();
      if (!settings.speculative) throw new Error(`${state.modelInfo.id} has no draft and verify graphs (draft rounds)`);
    }
    const g = await generate(state.model, context, settings, onToken, () => state.stop);
    shown = textAfter(newIds, state.tokenizer.bytes, skip);
    box.value = before + shown + after;
    box.setSelectionRange(before.length + shown.length, before.length + shown.length);
    const how = g.rounds ? ` (${g.rounds} verify calls; ${g.accepted} of ${g.proposed} proposals kept, ` +
      `${g.fromContext} of them from the text)` :
      g.fromContext ? ` (${g.calls} calls, ${g.fromContext} tokens verified from the text)` :
      settings.adaptive ? ` (${g.exited} of ${g.calls} tokens exited after the first cycle)` : "";
    $("stats").textContent = `${g.tokens.length} tokens, decode ${g.decodeTokensPerS.toFixed(0)} tokens/s${how}, ` +
      `prefill ${context.length} tokens at ${g.prefillTokensPerS.toFixed(0)} tokens/s (stopped at ${g.stoppedAt}` +
      `${truncated ? "; prompt cut to the context" : ""})`;
    window.hrmDemo.lastCompletion = { prompt: before, ids: g.tokens, text: shown, ...g };
  } catch (e) {
    setStatus(`completion failed: ${e.message}`, true);
  } finally {
    setBusy(false);
    scheduleSuggestions(); // the next words after the completed text
  }
}

function renderSelfTest(r) {
  const t = r.tolerance;
  const rows = [
    ["max abs logit error", `${r.max_abs_logit_error.toExponential(2)} (≤ ${r.abs_limit.toExponential(2)})`],
    ["top-1 agreement", `${r.top1_agreement.toFixed(4)} (≥ ${t.min_top1})`],
    ["perplexity / reference", `${r.perplexity.toFixed(3)} / ${r.reference_perplexity.toFixed(3)} ` +
      `(ratio ≤ ${t.max_ppl_ratio})`],
    ["positions, time", `${r.positions}, ${Math.round(r.ms)} ms`],
  ];
  const table = document.createElement("table");
  for (const [name, value] of rows) table.insertRow().append(...[name, value].map(cell));
  const verdict = document.createElement("div");
  verdict.className = `verdict ${r.passed ? "passed" : "failed"}`;
  verdict.textContent = r.passed ? `PASSED (${state.modelInfo.id})` : `FAILED (${state.modelInfo.id}): ${r.reason}`;
  $("selftest-result").replaceChildren(table, verdict);
  $("selftest-result").dataset.passed = r.passed ? "1" : "0";
}

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

async function runSelfTest() {
  setBusy(true);
  $("selftest-result").dataset.passed = "";
  try {
    state.bundle ??= await loadWebBundle(state.config.web_bundle.url);
    const progress = (done, total) => { $("selftest-progress").textContent = `window ${done}/${total}`; };
    const r = await selfTest(state.model, state.bundle, state.modelInfo.precision, progress);
    window.hrmDemo.lastSelfTest = { model: state.modelInfo.id, ...r };
    renderSelfTest(r);
  } catch (e) {
    $("selftest-result").textContent = `self-test could not run: ${e.message}`;
    $("selftest-result").dataset.passed = "0";
  } finally {
    $("selftest-progress").textContent = "";
    setBusy(false);
  }
}

async function main() {
  state.config = await fetchOk("/demo.json").then((r) => r.json());
  state.tokenizer = await loadTokenizer(state.config.tokenizer.url);
  const select = $("model");
  for (const m of state.config.models) {
    select.add(new Option(m.passed ? m.label : `${m.label}, failed parity gate`, m.id));
  }
  // ?model=ID (an artifact id of /demo.json) loads that program first, else the export's default
  const wanted = new URLSearchParams(location.search).get("model");
  select.value = state.config.models.some((m) => m.id === wanted) ? wanted : state.config.default_model;
  select.onchange = () => selectModel(select.value).catch((e) => {
    select.value = state.modelInfo?.id ?? select.value; // the program still in use
    fail(e);
  });
  $("text").disabled = false;
  $("text").addEventListener("input", scheduleSuggestions);
  // the chips are for the text before the cursor: a caret moved by a tap, the arrow keys or a selection asks again
  document.addEventListener("selectionchange", () => {
    if (document.activeElement === $("text")) scheduleSuggestions();
  });
  $("complete").onclick = complete;
  $("stop").onclick = () => { state.stop = true; };
  $("selftest").onclick = runSelfTest;
  await selectModel(select.value);
}

function fail(e) {
  setStatus(`error: ${e.message}`, true);
  setBusy(false);
}

main().catch(fail);
