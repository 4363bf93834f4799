// Token healing and the repetition penalty of the Complete button, with hrm_edge/runtime/healing.py's semantics
// (tests/test_healing.py runs both on the same prompt and logits and expects the same numbers):
//   healing   the prompt's last token is taken back; the first new token must be one whose bytes start with its
//             bytes (a prompt ending in "\n" may go on with "\n    ", which the tokenizer merges after a colon)
//   penalty   Hugging Face's repetition penalty over the context (the healed prompt and the new tokens): a
//             positive logit is divided by it, a negative one multiplied; before sampling and greedy argmax.
// Both work on float64 numbers, as Python does, so greedy output matches `python -m hrm_edge.complete`.

// GPT-2's byte-level alphabet, reversed: printable Latin-1 bytes are themselves, the others U+0100... in order.
function byteDecoder() {
  const decode = new Map();
  let next = 256;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    decode.set(String.fromCharCode(printable ? b : next++), b);
  }
  return decode;
}

// tokenizer.json (parsed) -> the bytes of every token id (Uint8Array); special tokens have none.
export function tokenBytes(json) {
  const decode = byteDecoder();
  const special = new Set(json.added_tokens.map((t) => t.content));
  let size = 0;
  for (const id of Object.values(json.model.vocab)) size = Math.max(size, id + 1);
  for (const t of json.added_tokens) size = Math.max(size, t.id + 1);
  const out = Array.from({ length: size }, () => new Uint8Array(0));
  for (const [text, id] of Object.entries(json.model.vocab)) {
    if (!special.has(text)) out[id] = Uint8Array.from(text, (c) => decode.get(c));
  }
  return out;
}

function startsWith(bytes, prefix) {
  if (bytes.length < prefix.length) return false;
  for (let i = 0; i < prefix.length; i++) if (bytes[i] !== prefix[i]) return false;
  return true;
}

// ids -> {context, heal}: the prompt less its last token and {prefix, allowed: Uint8Array [V] of 0/1}; the prompt
// and null for fewer than 2 tokens or a special last token.
export function healPrompt(ids, vocabBytes) {
  if (ids.length < 2 || vocabBytes[ids[ids.length - 1]].length === 0) return { context: ids.slice(), heal: null };
  const prefix = vocabBytes[ids[ids.length - 1]];
  const allowed = Uint8Array.from(vocabBytes, (b) => (startsWith(b, prefix) ? 1 : 0));
  return { context: ids.slice(0, -1), heal: { prefix, allowed } };
}

// logits [V] -> Float64Array [V]: every id in context made less likely by penalty (1 = off).
export function penalizeRepetition(logits, context, penalty) {
  const z = Float64Array.from(logits);
  if (penalty !== 1) {
    for (const id of new Set(context)) z[id] = z[id] > 0 ? z[id] / penalty : z[id] * penalty;
  }
  return z;
}

// The logits a token is sampled from: the penalty, then (first new token only) the healing mask.
export function shapeLogits(logits, context, penalty, heal = null) {
  const z = penalizeRepetition(logits, context, penalty);
  if (heal) for (let i = 0; i < z.length; i++) if (!heal.allowed[i]) z[i] = -Infinity;
  return z;
}

// The text of new tokens after the first `skip` bytes (a healed first token re-spells the prompt's last token);
// an incomplete character at the end decodes to U+FFFD, like Python's errors="replace".
export function textAfter(ids, vocabBytes, skip) {
  let n = 0;
  for (const id of ids) n += vocabBytes[id].length;
  const all = new Uint8Array(n);
  let at = 0;
  for (const id of ids) { all.set(vocabBytes[id], at); at += vocabBytes[id].length; }
  return new TextDecoder().decode(all.subarray(Math.min(skip, n)));
}
