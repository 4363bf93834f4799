// node keyboard_fixture.mjs JOB.json: the page's own suggestWords (hrm_edge/app/web/js/suggest.mjs) on the hash
// fixture model of tests/test_keyboard.py, with the page's tokenizer package. test_keyboard.py copies this file
// and the page's js/ folder next to a node_modules with the page's pinned packages, runs it, and compares the
// printed JSON with Python's and Java's words.
import { readFileSync } from "node:fs";
import { Tokenizer } from "@huggingface/tokenizers";

globalThis.location = { search: "" }; // model.mjs reads the page's URL
const { TypedContext, suggestWords } = await import("./js/suggest.mjs");
const { Lookahead, likelyKeys } = await import("./js/lookahead.mjs");
const { documentStart, keptStartEncoder } = await import("./js/model.mjs");
const { tokenBytes } = await import("./js/healing.mjs");

// lowbias32: a 32-bit integer hash, the same uint32 arithmetic in Python, JS and Java
function mix(x) {
  x = (x ^ (x >>> 16)) >>> 0;
  x = Math.imul(x, 0x7feb352d) >>> 0;
  x = (x ^ (x >>> 15)) >>> 0;
  x = Math.imul(x, 0x846ca68b) >>> 0;
  return (x ^ (x >>> 16)) >>> 0;
}

// Logits that are a hash of (the token ids so far, position): logit[v] = (mix(h ^ v * 0x85ebca6b) >>> 24) / 16
// for allowed ids, -16 for the others. The past holds each row's token ids, so a wrong cache shows.
class HashModel {
  constructor(vocab, allowed, maxSeqLen, seed = 0x12345678) {
    this.vocab = vocab;
    this.seed = seed; // a draft fixture: another seed, the same past
    this.allowed = new Uint8Array(vocab);
    for (const id of allowed) this.allowed[id] = 1;
    this.maxSeqLen = maxSeqLen;
    this.calls = [];
  }

  emptyPast() { return { rows: [[]], length: 0 }; }

  slicePast(past, n) { return { rows: past.rows.map((r) => r.slice(0, n)), length: n }; }

  pastRows(past, rows) { return { rows: rows.map((r) => past.rows[r].slice()), length: past.length }; }

  async run(tokens, past, batch = 1) {
    const seq = tokens.length / batch, V = this.vocab;
    this.calls.push([batch, seq]);
    this.onCall?.();
    const logits = new Float32Array(batch * seq * V), rows = [];
    for (let b = 0; b < batch; b++) {
      const ids = past.rows[b].concat(tokens.slice(b * seq, (b + 1) * seq));
      let h = this.seed;
      for (let i = 0; i < ids.length; i++) {
        h = mix((h ^ ((Math.imul(ids[i], 0x9e3779b1) + i) >>> 0)) >>> 0);
        if (i < past.length) continue;
        const at = (b * seq + i - past.length) * V;
        for (let v = 0; v < V; v++) {
          logits[at + v] = this.allowed[v] ? (mix((h ^ Math.imul(v, 0x85ebca6b)) >>> 0) >>> 24) / 16 : -16;
        }
      }
      rows.push(ids);
    }
    return { logits, vocab: V, past: { rows, length: past.length + seq } };
  }
}

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
const tokenizerJson = JSON.parse(readFileSync(job.tokenizer, "utf8"));
const hf = new Tokenizer(tokenizerJson, { clean_up_tokenization_spaces: false });
const bytes = tokenBytes(tokenizerJson);
const encodeAll = (text) => hf.encode(text, { add_special_tokens: false }).ids;
const out = [];
for (const texts of job.sequences) { // one typing session (one cache) per sequence
  const tokenizer = { // what the page's loadTokenizer returns
    encode: keptStartEncoder(encodeAll),
    decode: (ids) => hf.decode(ids, { skip_special_tokens: true }),
    bytes,
    documentStart: documentStart(tokenizerJson),
  };
  const model = new HashModel(job.vocab, job.allowed, job.max_seq_len);
  const draft = job.draft_seed === null ? null : new HashModel(job.vocab, job.allowed, job.max_seq_len, job.draft_seed);
  const context = new TypedContext(model, draft);
  await context.warmUp(tokenizer); // as the page does when it loads a program: the words and calls stay the same
  const steps = [], look = new Lookahead(context, tokenizer);
  for (const [i, text] of texts.entries()) {
    model.calls = [];
    if (draft) draft.calls = [];
    const { words, ahead } = job.lookahead ? await look.suggest(text, 3)
      : await suggestWords(context, tokenizer, text, 3);
    // (copies: the work ahead calls the same models next)
    steps.push({ words: words.map((w) => [w.label, w.insert, w.probability, w.ending]), calls: model.calls.slice(),
                 draftCalls: draft ? draft.calls.slice() : [], keptChars: tokenizer.encode.keptChars(),
                 sameIds: JSON.stringify(tokenizer.encode(text)) === JSON.stringify(encodeAll(text)), ahead,
                 likely: job.lookahead ? null : likelyKeys(context, tokenizer, text, words, 3) });
    if (job.lookahead) { // guess the next key (where it is one more character) and a wrong one, in either order
      const next = texts[i + 1] ?? "", key = next.startsWith(text) ? next.slice(text.length) : "";
      const keys = [key.length === 1 ? key : "#", key === "x" ? "y" : "x"];
      // at every other key the work ahead is called off at its k-th graph call, as a key coming in the middle does;
      // with job.callOffAt, at every key at that call
      let calls = 0;
      const k = job.callOffAt ?? 1 + (i % 7);
      model.onCall = () => { if ((job.callOffAt || i % 2 === 1) && ++calls === k) look.stop(); };
      if (draft) draft.onCall = model.onCall;
      await look.start(text, i % 3 === 2 ? keys.reverse() : keys);
      model.onCall = null; // the next key's own calls are not counted
      if (draft) draft.onCall = null;
    }
  }
  out.push(steps);
}
console.log(JSON.stringify(out));
