// The tokenizer and the ONNX KV-cache graph in the browser (onnxruntime-web, WASM backend).
//
// The graph (hrm_edge/export/onnx.py, "kv_cache" program):
//   inputs  tokens int64 [B, S], past_k / past_v float32 [T, B, H, P, hd]
//   outputs logits float32 [B, S, V], present_k / present_v [T, B, H, P + S, hd]
// The "draft" graph (the first outer cycle) has the same contract over the first L + 1 slots (and a `state`
// output, for the verify graph): Complete's adaptive depth runs it; the suggestion bar extends its chains with its
// "branch" twin (BranchModel below) or, in an export without one, with it.
// A call's presents are the next call's pasts. Pasts are immutable values, so branching (trying several
// next tokens for suggestions) is calling again with the same past, or once with it tiled along the batch axis
// (pastRows). Python twin: hrm_edge/runtime/decoders.py OnnxDecoder.
import * as ort from "onnxruntime-web";
import { Tokenizer } from "@huggingface/tokenizers";
import { tokenBytes } from "./healing.mjs";

// The WASM runtime files are served next to ort.wasm.min.mjs (hrm_edge/app/demo.py VENDOR_FILES).
ort.env.wasm.wasmPaths = "/vendor/ort/";
const threads = new URLSearchParams(location.search).get("threads");
if (threads !== null) ort.env.wasm.numThreads = Number(threads);

export async function loadTokenizer(url) {
  const json = await fetchOk(url).then((r) => r.json());
  // no clean-up of spaces before punctuation (" ." -> "."), which the package does by default and Python's
  // tokenizers does not: decoded text must be the bytes of the tokens
  const tokenizer = new Tokenizer(json, { clean_up_tokenization_spaces: false });
  return {
    // add_special_tokens false and skip_special_tokens true: what hrm_edge.app.complete does in Python
    encode: keptStartEncoder((text) => tokenizer.encode(text, { add_special_tokens: false }).ids),
    decode: (ids) => tokenizer.decode(ids, { skip_special_tokens: true }),
    bytes: tokenBytes(json), // of every token id, for token healing
    documentStart: documentStart(json), // the id the suggestions' context starts with (docs/keyboard.md step 1)
  };
}

// The id of <|eos|>, which training puts after every file, so before the next one; null if the tokenizer lacks it.
export function documentStart(json) {
  return json.added_tokens.find((t) => t.content === "<|eos|>")?.id ?? null;
}

// encodeAll (text -> ids) for a text typed a key at a time, without encoding all of it at every keystroke: the ids
// of a start of the text that ends at a line break after a visible ASCII character do not depend on what follows
// (the ByteLevel pre-tokenizer's regex, which looks only forward, begins a new piece at that line break, and BPE
// and the added tokens <|bos|> <|eos|> stay within pieces), so the ids of the latest such start at least
// KEEP_BACK_CHARS before the end are kept and a keystroke encodes the rest. A text that does not go on from the
// kept start with its line break (an edit before it, or text typed where the line break was) starts over. The same
// ids as encodeAll(text) (tests/test_keyboard.py).
const KEEP_BACK_CHARS = 64;
export function keptStartEncoder(encodeAll) {
  let kept = { text: "", ids: [] };
  const encode = (text) => {
    const next = text.charAt(kept.text.length); // "" at the end of the text
    if (!text.startsWith(kept.text) || (next !== "" && next !== "\n")) kept = { text: "", ids: [] };
    const cut = pieceStart(text, text.length - KEEP_BACK_CHARS);
    if (cut > kept.text.length) {
      kept = { text: text.slice(0, cut), ids: kept.ids.concat(encodeAll(text.slice(kept.text.length, cut))) };
    }
    return kept.ids.concat(encodeAll(text.slice(kept.text.length)));
  };
  encode.keptChars = () => kept.text.length;
  return encode;
}

// The last index i <= at where text[i] is a line break after a visible ASCII character; 0 if none.
function pieceStart(text, at) {
  for (let i = Math.min(at, text.length - 1); i > 0; i--) {
    const before = text.charCodeAt(i - 1);
    if (text[i] === "\n" && before > 0x20 && before < 0x7f) return i;
  }
  return 0;
}

// An onnxruntime-web session (WASM) of the graph at url. weights ({url, path}, a program's entry in /demo.json): the
// file the graph's weights are in (hrm_edge/app/shared_weights.py), fetched once for all the program's graphs.
async function loadSession(url, weights = null) {
  const bytes = new Uint8Array(await fetchOk(url).then((r) => r.arrayBuffer()));
  const options = { executionProviders: ["wasm"] };
  if (weights) options.externalData = [{ path: weights.path, data: await weightsBytes(weights.url) }];
  return ort.InferenceSession.create(bytes, options);
}

const fetchedWeights = new Map(); // url -> Promise of its bytes
function weightsBytes(url) {
  if (!fetchedWeights.has(url)) {
    const bytes = fetchOk(url).then((r) => r.arrayBuffer()).then((b) => new Uint8Array(b));
    bytes.catch(() => fetchedWeights.delete(url)); // a failed download is tried again by the next session
    fetchedWeights.set(url, bytes);
  }
  return fetchedWeights.get(url);
}

export async function fetchOk(url) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) { // a network error ("Failed to fetch") names no file
    throw new Error(`${url}: ${e.message}`);
  }
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response;
}

export class KvModel {
  // Use KvModel.load(url, maxSeqLen, weights).
  constructor(session, maxSeqLen) {
    this.session = session;
    this.maxSeqLen = maxSeqLen;
    const meta = session.inputMetadata.find((m) => m.name === "past_k");
    // [T, 1, H, P, hd]: T, H and hd are fixed numbers in the graph, P is symbolic
    [this.T, , this.H, , this.hd] = meta.shape;
    this.queue = Promise.resolve(); // one run at a time: a session cannot run twice concurrently
  }

  static async load(url, maxSeqLen, weights = null) {
    return new KvModel(await loadSession(url, weights), maxSeqLen);
  }

  emptyPast() {
    const dims = [this.T, 1, this.H, 0, this.hd];
    return { k: new ort.Tensor("float32", new Float32Array(0), dims),
             v: new ort.Tensor("float32", new Float32Array(0), dims), length: 0 };
  }

  // tokens: int[] [batch * S] (row-major), each row at positions past.length ...; the past has `batch` rows.
  // Returns {logits: Float32Array [batch * S * V], vocab, past}.
  run(tokens, past, batch = 1) {
    const seq = tokens.length / batch;
    return queuedRun(this, past.length, seq, async () => {
      const out = await this.session.run({ tokens: tokenTensor(tokens, batch), past_k: past.k, past_v: past.v });
      return { logits: out.logits.data, vocab: out.logits.dims[2], state: out.state ?? null, // the draft graph's
               past: { k: out.present_k, v: out.present_v, length: past.length + seq } };
    });
  }

  // A past made of the given batch rows of `past` (repeats allowed: [0, 0, 0] tiles a one-row past 3 times), and
  // of its first this.T slots (a draft graph reads the first L + 1 of the full graph's cache).
  pastRows(past, rows) {
    return { k: pickRows(past.k, rows, this.T), v: pickRows(past.v, rows, this.T), length: past.length };
  }

  // The first n positions of a past (to reuse the cache of a common prefix of an edited text).
  slicePast(past, n) {
    return slicePositions(past, n);
  }
}

// job() after the model's earlier runs (a session cannot run twice at once); refused when a past of `pastLength`
// positions and `seq` new ones would not fit the model's context.
function queuedRun(model, pastLength, seq, job) {
  if (pastLength + seq > model.maxSeqLen) {
    return Promise.reject(new Error(`context full: ${pastLength} + ${seq} > ${model.maxSeqLen}`));
  }
  const run = model.queue.then(job);
  model.queue = run.catch(() => {});
  return run;
}

// tokens: int[] [batch * S] (row-major) -> int64 [batch, S].
function tokenTensor(tokens, batch) {
  return new ort.Tensor("int64", BigInt64Array.from(tokens, BigInt), [batch, tokens.length / batch]);
}

// The first n positions of a one-row past {k, v [T, 1, H, P, hd], length}.
function slicePositions(past, n) {
  if (n === past.length) return past;
  const slice = (tensor) => {
    const [T, , H, P, hd] = tensor.dims, src = tensor.data, block = P * hd, keep = n * hd;
    const dst = new Float32Array(T * H * keep);
    for (let b = 0; b < T * H; b++) dst.set(src.subarray(b * block, b * block + keep), b * keep);
    return new ort.Tensor("float32", dst, [T, 1, H, n, hd]);
  };
  return { k: slice(past.k), v: slice(past.v), length: n };
}

// States [2, 1, n_i, D] (ort.Tensor) concatenated along the position axis -> [2, 1, sum n_i, D].
function concatStates(states) {
  const D = states[0].dims[3], n = states.reduce((sum, s) => sum + s.dims[2], 0);
  const out = new Float32Array(2 * n * D);
  for (let level = 0, at = 0; level < 2; level++) {
    for (const s of states) {
      const size = s.dims[2] * D;
      out.set(s.data.subarray(level * size, (level + 1) * size), at);
      at += size;
    }
  }
  return new ort.Tensor("float32", out, [2, 1, n, D]);
}

// Rows `rows` (repeats allowed) of the first T slots of a past tensor [T', B, H, P, hd] -> [T, rows.length, H, P, hd].
function pickRows(tensor, rows, T) {
  const [, B, H, P, hd] = tensor.dims, block = H * P * hd, src = tensor.data;
  const dst = new Float32Array(T * rows.length * block);
  for (let t = 0; t < T; t++) {
    rows.forEach((r, b) => dst.set(src.subarray((t * B + r) * block, (t * B + r + 1) * block),
                                   (t * rows.length + b) * block));
  }
  return new ort.Tensor("float32", dst, [T, rows.length, H, P, hd]);
}

// The suggestion bar's branch graph (*.branch.onnx; hrm_edge/model/lm.py BranchForm): the draft graph's first outer
// cycle for rows that share one context, so the chains never tile the context's cache along the batch axis:
//   inputs  tokens int64 [B, S], context_k / context_v [T, 1, H, P, hd] (read by every row), past_k / past_v
//           [T, B, H, Q, hd] (each row's own positions since the context)
//   outputs logits [B, S, V], present_k / present_v [T, B, H, Q + S, hd] (the rows' own part only)
// Its pasts are {context: {k, v}, k, v, length}; run and pastRows as KvModel's (suggest.mjs uses either).
// Python twin: hrm_edge/runtime/decoders.py OnnxBranchModel.
export class BranchModel {
  constructor(session, maxSeqLen) {
    this.session = session;
    this.maxSeqLen = maxSeqLen;
    [this.T, , this.H, , this.hd] = session.inputMetadata.find((m) => m.name === "past_k").shape;
    this.queue = Promise.resolve();
  }

  static async load(url, maxSeqLen, weights = null) {
    return new BranchModel(await loadSession(url, weights), maxSeqLen);
  }

  // Rows of a past. Of a KV graph's past (one row, the context): its first T slots become the shared context (a
  // view, no copy) and the rows start with no positions of their own; of a branch past: its own rows `rows`.
  pastRows(past, rows) {
    if (past.context) {
      return { context: past.context, k: pickRows(past.k, rows, this.T), v: pickRows(past.v, rows, this.T),
               length: past.length };
    }
    const first = (tensor) => {
      const [, , H, P, hd] = tensor.dims;
      return new ort.Tensor("float32", tensor.data.subarray(0, this.T * H * P * hd), [this.T, 1, H, P, hd]);
    };
    const none = new ort.Tensor("float32", new Float32Array(0), [this.T, rows.length, this.H, 0, this.hd]);
    return { context: { k: first(past.k), v: first(past.v) }, k: none, v: none, length: past.length };
  }

  // tokens: int[] [batch * S]; past: pastRows'. Returns {logits: Float32Array [batch * S * V], vocab, past}.
  run(tokens, past, batch = 1) {
    const seq = tokens.length / batch;
    return queuedRun(this, past.length, seq, async () => {
      const out = await this.session.run({ tokens: tokenTensor(tokens, batch), context_k: past.context.k,
                                           context_v: past.context.v, past_k: past.k, past_v: past.v });
      return { logits: out.logits.data, vocab: out.logits.dims[2],
               past: { context: past.context, k: out.present_k, v: out.present_v, length: past.length + seq } };
    });
  }
}

// Adaptive depth (hrm_edge/runtime/adaptive.py on runtime/speculative.py's OnnxSpeculativeDecoder): a decoded token
// runs the draft graph (the first outer cycle, cache slots 0..L); when its top probability reaches the threshold it
// exits with that readout, and the slots of the applications it skipped get the same role's first-cycle keys and
// values (slot t <- slot t mod (L + 1)); otherwise the verify graph runs the rest of the depth (slots L + 1..T - 1)
// from the draft's state. The cache is kept as those two halves: {first, rest}, pasts as KvModel's.
export class AdaptiveModel {
  constructor(draft, verify) {
    this.draft = draft; // a KvModel over slots 0..L
    this.verify = verify; // the verify graph's session
  }

  static async load(draftUrl, verifyUrl, maxSeqLen, weights = null) {
    return new AdaptiveModel(await KvModel.load(draftUrl, maxSeqLen, weights), await loadSession(verifyUrl, weights));
  }

  // The two halves of a KV graph's past [T, 1, H, P, hd].
  split(past) {
    const part = (tensor, from, to) => {
      const [, , H, P, hd] = tensor.dims, block = H * P * hd;
      return new ort.Tensor("float32", tensor.data.slice(from * block, to * block), [to - from, 1, H, P, hd]);
    };
    const T = past.k.dims[0], L1 = this.draft.T;
    return { first: { k: part(past.k, 0, L1), v: part(past.v, 0, L1), length: past.length },
             rest: { k: part(past.k, L1, T), v: part(past.v, L1, T), length: past.length } };
  }

  // One decoded token at adaptive depth -> {logits [V] (the readout it exits with, or the full depth's), halves,
  // exited}.
  async step(token, halves, threshold) {
    const d = await this.draft.run([token], halves.first);
    if (topProbability(d.logits) >= threshold) {
      return { logits: d.logits, halves: { first: d.past, rest: this.skipped(halves.rest, d.past) }, exited: true };
    }
    const out = await this.verify.run({ tokens: tokenTensor([token], 1), state: d.state, past_k: halves.rest.k,
                                        past_v: halves.rest.v });
    const rest = { k: out.present_k, v: out.present_v, length: halves.rest.length + 1 };
    return { logits: out.logits.data, halves: { first: d.past, rest }, exited: false };
  }

  // Self-speculative decoding's calls (hrm_edge/runtime/speculative.py OnnxSpeculativeDecoder) on the halves of
  // split(): the draft graph on `tokens` after the first half -> {logits, vocab, state [2, 1, n, D], first};
  async draftRun(tokens, first) {
    const d = await this.draft.run(tokens, first);
    return { logits: d.logits, vocab: d.vocab, state: d.state, first: d.past };
  }

  // the verify graph on the drafted positions `tokens` from their draft states (a list of [2, 1, n_i, D]) after the
  // second half -> {logits [n * V], vocab, rest};
  async verifyRun(tokens, states, rest) {
    const out = await this.verify.run({ tokens: tokenTensor(tokens, 1), state: concatStates(states), past_k: rest.k,
                                        past_v: rest.v });
    return { logits: out.logits.data, vocab: out.logits.dims[2],
             rest: { k: out.present_k, v: out.present_v, length: rest.length + tokens.length } };
  }

  // and both halves cut back to their first n positions (the kept ones).
  commit(halves, n) {
    return { first: slicePositions(halves.first, n), rest: slicePositions(halves.rest, n) };
  }

  // rest extended by one position: its slot i gets first-cycle slot i mod (L + 1)'s newest position.
  skipped(rest, first) {
    const grow = (r, f) => {
      const [R, , H, P, hd] = r.dims, L1 = f.dims[0], dst = new Float32Array(R * H * (P + 1) * hd);
      for (let i = 0; i < R; i++) {
        for (let h = 0; h < H; h++) {
          const to = (i * H + h) * (P + 1) * hd;
          dst.set(r.data.subarray((i * H + h) * P * hd, (i * H + h + 1) * P * hd), to);
          const from = ((i % L1) * H + h) * (P + 1) * hd + P * hd; // f holds P + 1 positions
          dst.set(f.data.subarray(from, from + hd), to + P * hd);
        }
      }
      return new ort.Tensor("float32", dst, [R, 1, H, P + 1, hd]);
    };
    return { k: grow(rest.k, first.k), v: grow(rest.v, first.v), length: rest.length + 1 };
  }
}

// The largest softmax probability of logits [V] (float64, as hrm_edge.runtime.adaptive.top_prob).
export function topProbability(logits) {
  let max = -Infinity, sum = 0;
  for (const x of logits) if (x > max) max = x;
  for (const x of logits) sum += Math.exp(x - max);
  return 1 / sum;
}

// Row i of a [S * V] logits array.
export function row(logits, vocab, i) {
  return logits.subarray(i * vocab, (i + 1) * vocab);
}

export function runtimeInfo() {
  return { isolated: globalThis.crossOriginIsolated === true, threads: ort.env.wasm.numThreads,
           version: ort.env.versions?.web ?? "?" };
}
