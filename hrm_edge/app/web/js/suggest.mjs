// Next-word suggestions, the phone-keyboard use this model is sized for.
//
// A word is usually 1-3 tokens, so the next token's distribution alone is not a word list. For the few
// most likely next tokens, each is extended greedily until the text holds a whole word followed by
// something else (the word has ended); the word's probability is the product of its tokens'
// probabilities, summed over the token paths that spell the same word. The 3 most probable words win.
// Mid-word ("imp"), the word being typed is completed ("ort", shown as "import"); after a space, the
// next word is suggested.
// Cost per keystroke: the typed tokens (the cache of the unchanged prefix is reused) + at most
// CANDIDATES x MAX_EXTRA_TOKENS one-token decode steps, a few ms each.
import { argmax, softmax } from "./generate.mjs";
import { row } from "./model.mjs";

const CANDIDATES = 6; // first tokens tried
const MAX_EXTRA_TOKENS = 3; // greedy tokens after the first one, to finish a word and see it end
// optional leading spaces, then a run of word characters or a run of other visible characters
const WORD = /^(\s*)([\p{L}\p{N}_]+|[^\s\p{L}\p{N}_]+)/u;

// Keeps the KV cache of the text typed so far, so a keystroke costs one or two tokens, not a prefill.
export class TypedContext {
  constructor(model) {
    this.model = model;
    this.ids = [];
    this.past = model.emptyPast();
    this.logits = null; // of the last position
  }

  // Bring the cache to `ids` (reusing the longest common prefix); returns the last position's logits [V].
  async update(ids) {
    let common = 0;
    while (common < ids.length && common < this.ids.length && ids[common] === this.ids[common]) common++;
    if (common === ids.length && common === this.ids.length && this.logits) return this.logits;
    if (common === ids.length) common -= 1; // the last token must run again to give its logits
    const out = await this.model.run(ids.slice(common), this.model.slicePast(this.past, common));
    this.ids = ids.slice();
    this.past = out.past;
    this.logits = row(out.logits, out.vocab, ids.length - 1 - common);
    return this.logits;
  }
}

// Follow one candidate first token greedily until the first word after `prefix` is complete.
// Returns {insert, probability} or null when no word comes out (e.g. only whitespace).
async function extendToWord(model, tokenizer, past, firstToken, firstProbability, prefix) {
  const ids = [firstToken], probs = [firstProbability];
  let text = tokenizer.decode(ids);
  for (let step = 0; step < MAX_EXTRA_TOKENS; step++) {
    const m = WORD.exec(text.slice(prefix.length));
    if (m && prefix.length + m[0].length < text.length) break; // something follows the word: it has ended
    if (past.length + 1 > model.maxSeqLen) break;
    const out = await model.run([ids[ids.length - 1]], past);
    past = out.past;
    const p = softmax(row(out.logits, out.vocab, 0));
    const next = argmax(p);
    ids.push(next);
    probs.push(p[next]);
    text = tokenizer.decode(ids);
  }
  const m = WORD.exec(text.slice(prefix.length));
  if (!m) return null;
  // the word's probability: the tokens whose text starts inside prefix + word
  let probability = 1;
  for (let i = 0; i < ids.length; i++) {
    if (i > 0 && tokenizer.decode(ids.slice(0, i)).length >= prefix.length + m[0].length) break;
    probability *= probs[i];
  }
  return { insert: m[0], probability };
}

// Token healing: a text that ends in the middle of what is usually one token ("def " is "def" + " ",
// where the model was trained on "def" + " name") gives poor next-token guesses. So the last token is
// taken back, and the first token must start with its text (`prefix`).
function healLastToken(ids, tokenizer) {
  if (ids.length < 2) return { context: ids, prefix: "" };
  return { context: ids.slice(0, -1), prefix: tokenizer.decode(ids.slice(-1)) };
}

// The decoded text of every token id (for token healing), computed once per tokenizer.
const tokenTexts = new WeakMap();
function tokenText(tokenizer, vocab) {
  if (!tokenTexts.has(tokenizer)) tokenTexts.set(tokenizer, Array.from({ length: vocab }, (_, i) => tokenizer.decode([i])));
  return tokenTexts.get(tokenizer);
}

// The n most likely next words after `text`. Returns {words: [{insert, label, probability}], ms}.
export async function suggestWords(context, tokenizer, text, n = 3) {
  const t = performance.now();
  const model = context.model;
  let ids = tokenizer.encode(text);
  const room = model.maxSeqLen - MAX_EXTRA_TOKENS - 2;
  if (ids.length > room) ids = ids.slice(ids.length - room); // keep the end of a long text
  if (ids.length === 0) return { words: [], ms: 0 };
  const { context: contextIds, prefix } = healLastToken(ids, tokenizer);
  const p = softmax(await context.update(contextIds));
  const texts = tokenText(tokenizer, p.length);
  const order = Array.from(p.keys()).filter((i) => texts[i].startsWith(prefix))
    .sort((a, b) => p[b] - p[a]).slice(0, CANDIDATES);
  const byWord = new Map();
  for (const token of order) {
    const word = await extendToWord(model, tokenizer, context.past, token, p[token], prefix);
    if (word) byWord.set(word.insert, (byWord.get(word.insert) ?? 0) + word.probability);
  }
  // mid-word ("imp" -> "ort"), show the whole word the tap completes ("import")
  const partial = /[\p{L}\p{N}_]+$/u.exec(text)?.[0] ?? "";
  const words = [...byWord].sort((a, b) => b[1] - a[1]).slice(0, n).map(([insert, probability]) => ({
    insert, probability,
    label: /^[\p{L}\p{N}_]/u.test(insert) ? partial + insert : insert.replace(/^\s+/, ""),
  }));
  return { words, ms: performance.now() - t };
}
