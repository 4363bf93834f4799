// Next-word suggestions, the phone-keyboard use this model is sized for: docs/keyboard.md specifies the
// algorithm; hrm_edge/runtime/suggest.py (Python) and WordSuggester.java (Android core) implement the same, and
// tests/test_keyboard.py checks the three give identical words.
//
// In short: the last token, and earlier ones until HEAL_CHARS characters of the word being typed, are taken
// back (token healing); the CANDIDATES most likely first tokens that fit their text are each extended greedily
// (spelling the rest of it first), all of them as one batch per decode step, until the word they spell has ended
// (a non-word character follows it); a word still open after MAX_EXTRA_TOKENS is dropped, so the bar only shows
// whole words. Word probability: the product of its tokens' probabilities, summed over the chains that spell
// the same insert. Mid-word ("imp") the chip is the completed word ("import").
// Cost per keystroke: the changed tokens of the text (the cache of the unchanged prefix is reused) + at most
// MAX_EXTRA_TOKENS batched one-token decode steps (more while a chain spells the taken-back text), run by the
// branch or draft graph (the first outer cycle: half a full step's work) where the page has one; chains already
// computed for the same context are reused.
import { argmax } from "./generate.mjs";
import { row } from "./model.mjs";

export const CANDIDATES = 4; // first tokens tried (3, 4 and 6: within 0.6 points of top-3 on the calib split)
export const MAX_EXTRA_TOKENS = 4; // greedy decode steps after the first token
export const CONTEXT_TOKENS = 128; // the most context a suggestion reads (as accurate as 256, half the cost)
export const MAX_SPELLING_TOKENS = 3; // tokens after the first that may finish spelling the taken-back text
export const BRANCHES = 2; // where a chain's word has not started, it forks into this many chains
export const RECENT_CONTEXTS = 4; // earlier contexts whose logits and chains are kept, for a return to one
export const HEAL_CHARS = 2; // token healing takes back tokens until it holds this many characters of the word
export const TYPED_SHARE = 0.1; // the words already typed: their share of a chip's score (step 11; calib split)
export const TYPED_LINES = 200; // the words already typed are read from the text's last this many lines
export const FOLLOW_SHARE = 0.25; // the typed words that followed the same word and link as the cursor's (step 11)
const SPACES = " \t\n\r\f\v";
const WORD_CHAR = /^[\p{L}\p{N}_]/u;
const WORD_RUN = /[\p{L}\p{N}_]+/gu;

// Keeps the KV cache of the text typed so far, so a keystroke costs one or two tokens, not a prefill, and
// the greedy chains computed from it (typing on inside a word often asks for the same ones again).
export class TypedContext {
  // model: the KV graph; draft: the *.branch.onnx graph (BranchModel) or the *.draft.onnx graph (a KvModel): the
  // first outer cycle, which extends the chains from the first draft.T slots of the cache; or null (the KV graph
  // extends them)
  constructor(model, draft = null) {
    this.model = model;
    this.draft = draft;
    this.ids = [];
    this.past = model.emptyPast();
    this.logits = null; // of the last position
    this.chains = new Map(); // "firstToken textStillToSpell" -> {tokens, probs}, for this.ids
    // "ids" -> {logits, chains} of earlier contexts that are shorter prefixes of this.ids, newest last: after
    // healing takes back a token that typing had committed, a keystroke goes back to the context of two before
    this.recent = new Map();
    this.texts = null; // [tokenizer, text of every token id]
    this.cancelled = false; // set on a fork computing ahead (lookahead.mjs): its next graph call throws Cancelled
  }

  // A copy that computes on its own (the page's lookahead computes the chips of a guessed next key on one): it shares
  // the cache, logits and chains computed so far, which are never changed in place, and keeps its own maps of them.
  fork() {
    const copy = new TypedContext(this.model, this.draft);
    Object.assign(copy, { ids: this.ids, past: this.past, logits: this.logits, texts: this.texts,
                          chains: new Map(this.chains) });
    copy.recent = new Map([...this.recent].map(([key, { logits, chains }]) => [key,
                                                                            { logits, chains: new Map(chains) }]));
    return copy;
  }

  // Bring the cache to `ids` (reusing the longest common prefix); returns the last position's logits [V].
  async update(ids) {
    let common = 0;
    while (common < ids.length && common < this.ids.length && ids[common] === this.ids[common]) common++;
    if (common === ids.length && common === this.ids.length && this.logits) return this.logits;
    const key = ids.join(","), earlier = common === ids.length ? this.recent.get(key) : undefined;
    this.recent.delete(key);
    if (this.logits) this.recent.set(this.ids.join(","), { logits: this.logits, chains: this.chains });
    if (earlier) { // back to a recent context: its cache is the first positions of this one
      this.past = this.model.slicePast(this.past, ids.length);
      this.ids = ids.slice();
      ({ logits: this.logits, chains: this.chains } = earlier);
    } else {
      common = Math.min(common, ids.length - 1); // the last token runs again to give its logits
      if (this.cancelled) throw new Cancelled(); // a fork's work called off: no more graph calls
      const out = await this.model.run(ids.slice(common), this.model.slicePast(this.past, common));
      this.ids = ids.slice();
      this.past = out.past;
      this.logits = row(out.logits, out.vocab, ids.length - 1 - common);
      this.chains = new Map();
    }
    // only a shorter prefix of the context (whose ids are `key` now) can be gone back to
    const kept = [...this.recent.keys()].filter((k) => key.startsWith(k + ","));
    this.recent = new Map(kept.slice(Math.max(0, kept.length - RECENT_CONTEXTS)).map((k) => [k, this.recent.get(k)]));
    return this.logits;
  }

  // Runs each graph once and lists the token texts, leaving the context as it was: a session's first run prepares its
  // kernels (the page's first keystroke took some 300 ms without this, the next ones 10-30), so the page does it as
  // it loads a program.
  async warmUp(tokenizer) {
    const out = await this.model.run([0], this.model.emptyPast());
    this.tokenTexts(tokenizer, out.vocab);
    if (this.draft) await this.draft.run([0], this.draft.pastRows(out.past, [0]), 1);
  }

  // The decoded text of every token id ("" for special tokens), computed once per tokenizer.
  tokenTexts(tokenizer, vocab) {
    if (this.texts?.[0] !== tokenizer) {
      const texts = [];
      for (let i = 0; i < vocab; i++) texts.push(tokenizer.decode([i]));
      this.texts = [tokenizer, texts];
    }
    return this.texts[1];
  }
}

// Thrown by the graph calls of a fork whose work was called off (TypedContext.cancelled).
export class Cancelled extends Error {
  constructor() {
    super("cancelled");
  }
}

const isWordChar = (ch) => WORD_CHAR.test(ch);
const hasWordChar = (text) => [...text].some(isWordChar);

// The word characters at the end of `text` (the word being typed; "" after a space or a symbol).
export function trailingWord(text) {
  let i = text.length;
  while (i > 0) {
    const low = text.charCodeAt(i - 1);
    const size = i > 1 && low >= 0xdc00 && low <= 0xdfff ? 2 : 1; // a surrogate pair is one code point
    if (!isWordChar(text.slice(i - size, i))) break;
    i -= size;
  }
  return text.slice(i);
}

// What a continuation of the typed text says: null while the word may go on (open), "" when no word can come
// out of it (dead), else [insert, word, ending].
export function readWord(continuation, midWord) {
  const c = continuation.replace(/\ufffd+$/u, ""); // a trailing U+FFFD: a character whose bytes are still coming
  let i = 0;
  if (!midWord) while (i < c.length && SPACES.includes(c[i])) i++;
  let j = i;
  while (j < c.length) {
    const ch = String.fromCodePoint(c.codePointAt(j));
    if (!isWordChar(ch)) break;
    j += ch.length;
  }
  if (j === c.length) return null;
  if (j === i) return "";
  return [c.slice(0, j), c.slice(i, j), c.slice(j)];
}

// The end of a long text: when the ids leave no room for the extension within CONTEXT_TOKENS, whole blocks of
// a quarter of that are dropped from the start (so the window, and its cache, stays the same for many keys). Within
// maxSeqLen a chain's up to 1 + MAX_SPELLING_TOKENS + MAX_EXTRA_TOKENS tokens (the last never run) always fit after a
// context at least one id shorter than the window.
export function contextWindow(ids, maxSeqLen) {
  const span = Math.min(maxSeqLen, CONTEXT_TOKENS);
  const limit = Math.min(span - MAX_EXTRA_TOKENS, maxSeqLen - MAX_SPELLING_TOKENS - MAX_EXTRA_TOKENS + 1);
  if (ids.length <= limit) return ids;
  const block = Math.floor(span / 4);
  return ids.slice(Math.ceil((ids.length - limit) / block) * block);
}

// (t) -> exp(logits[t] - max) / sum_j exp(logits[j] - max), in float64 (the same sum order in every language); the
// sum is taken once per logits row (4,096 Math.exp calls, the largest part of the page's own time)
export function probabilities(logits) {
  const n = logits.length;
  let max = -Infinity, sum = 0;
  for (let i = 0; i < n; i++) if (logits[i] > max) max = logits[i];
  for (let i = 0; i < n; i++) sum += Math.exp(logits[i] - max);
  return (t) => Math.exp(logits[t] - max) / sum;
}

// Token healing: the index of the first id taken back. The last id, and earlier ones until the taken-back text
// holds HEAL_CHARS characters (code points, as Python and Java count) of the partial word (a context ending in a
// 1-character piece of a word is one the model rarely saw), and earlier ones while it would start inside a
// character (with U+FFFD, which any bytes match: a token whose first byte is a UTF-8 continuation byte); at least
// one id stays.
export function healedStart(tokenizer, ids, partial) {
  const chars = Math.min(codePoints(partial), HEAL_CHARS);
  let j = ids.length - 1;
  while (j > 1 && codePoints(tokenizer.decode(ids.slice(j))) < chars) j--;
  // a run of whitespace at the end is taken back whole ("\n\n    " typed is "\n" "\n    ", which training never shows
  // before a word)
  if (isSpaces(tokenizer.decode(ids.slice(j)))) while (j > 1 && isSpaces(tokenizer.decode(ids.slice(j - 1, j)))) j--;
  while (j > 1 && (tokenizer.bytes[ids[j]][0] & 0xc0) === 0x80) j--;
  return j;
}

// Whether text is non-empty and only SPACES.
const isSpaces = (text) => text !== "" && [...text].every((c) => SPACES.includes(c));

const codePoints = (text) => [...text].length;

// The text of tokens without trailing U+FFFD: only the characters they complete (the bytes of the last one may still
// be coming: its U+FFFD would count as a character already spelled).
function wholeCharacters(tokenizer, tokens) {
  return tokenizer.decode(tokens).replace(/\ufffd+$/u, "");
}

// Insert t into best (at most count ids, highest logit first; ties: the lower id, which comes first).
function rank(best, t, logits, count) {
  if (best.length === count && !(logits[t] > logits[best[best.length - 1]])) return;
  let k = best.length === count ? best.length - 1 : best.length;
  while (k > 0 && logits[t] > logits[best[k - 1]]) { best[k] = best[k - 1]; k--; }
  best[k] = t;
}

// The `count` highest-logit tokens whose text starts with `prefix`; in the slots left, the highest-logit tokens
// whose text is a (non-empty) proper prefix of it (the following tokens then spell the rest); ties: lower id. At a
// word start (midWord false) both kinds rank together by logit ("\n       " " self" spells "\n        self").
// midWord (true/false): skip the covering tokens from which no word can come (readWord is dead: " =" where a word
// should start).
function firstTokens(logits, texts, prefix, count = CANDIDATES, midWord = null) {
  const covering = [], shorter = [];
  const room = (best, t) => best.length < count || logits[t] > logits[best[count - 1]];
  for (let t = 0; t < logits.length; t++) {
    const text = texts[t];
    if (!text || !(room(covering, t) || room(shorter, t))) continue; // the string tests only for a possible rank
    if (text.startsWith(prefix)) {
      if (midWord === null || readWord(text.slice(prefix.length), midWord) !== "") rank(covering, t, logits, count);
    } else if (prefix.startsWith(text)) rank(shorter, t, logits, count);
  }
  if (midWord === false) return covering.concat(shorter).sort((a, b) => logits[b] - logits[a] || a - b).slice(0, count);
  return covering.concat(shorter).slice(0, count);
}

// The `count` highest-logit tokens (ties: lower id) after which a word can still come from a chain whose text past
// the taken-back one is c (no word character in it yet): readWord(c + text) is not dead.
function wordTokens(logits, texts, c, midWord, count) {
  const best = [];
  for (let t = 0; t < logits.length; t++) {
    const text = texts[t];
    if (!text || !(best.length < count || logits[t] > logits[best[count - 1]])) continue;
    if (readWord(c + text, midWord) !== "") rank(best, t, logits, count);
  }
  return best;
}

// null while the word of a chain's tokens is open, "" if no word comes out (dead), else
// [insert, word, ending, probability].
function decide(tokens, probs, tokenizer, texts, prefix, midWord) {
  if (!texts[tokens[tokens.length - 1]]) return ""; // a special token (end of text): no word follows
  const text = tokenizer.decode(tokens);
  if (text.length < prefix.length && prefix.startsWith(text)) return null; // still spelling the taken-back text
  if (!text.startsWith(prefix)) return "";
  const read = readWord(text.slice(prefix.length), midWord);
  if (!read) return read;
  const [insert, word, ending] = read;
  const end = prefix.length + insert.length;
  let p = probs[0];
  for (let i = 1; i < tokens.length; i++) { // the tokens that spell part of the word (not those of the ending alone)
    if (wholeCharacters(tokenizer, tokens.slice(0, i)).length >= end) break;
    p *= probs[i];
  }
  return [insert, word, ending, p];
}

// decide() on the chain's shortest prefix that decides; null if the whole chain is still open.
function firstDecision(chain, decideTokens) {
  for (let k = 1; k <= chain.tokens.length; k++) {
    const found = decideTokens(chain.tokens.slice(0, k), chain.probs.slice(0, k));
    if (found !== null) return found;
  }
  return null;
}

// Grow every chain whose word is still open by greedy tokens (nextTokens(chain, logits) -> ids: one, or several
// where it forks, each fork a new chain in chain.forks), all of them as one batch per decode step, until each has
// ended or is out of budget (stillOpen false), or until settled(open chains) says no end of them can change the
// words shown (those are then cut short). The draft model runs the steps where there is one (pastRows keeps its
// slots): a branch graph's rows share the context's past, a draft or KV graph's get it tiled along the batch axis.
async function extend(context, chains, stillOpen, nextTokens, settled) {
  const model = context.draft ?? context.model;
  let rows = chains.filter(stillOpen); // the chain of each batch row
  if (rows.length === 0 || cutShort(rows, settled)) return;
  let past = model.pastRows(context.past, rows.map(() => 0));
  for (;;) {
    if (context.cancelled) { // the open chains are computed again by whoever reuses the fork's chains
      for (const chain of rows) chain.cutShort = true;
      throw new Cancelled();
    }
    const out = await model.run(rows.map((chain) => chain.tokens[chain.tokens.length - 1]), past, rows.length);
    const grown = [], parents = []; // the chains after this step (forks after their chain), the row each came from
    rows.forEach((chain, b) => {
      const logits = row(out.logits, out.vocab, b);
      const tokens = chain.tokens.slice(), probs = chain.probs.slice(); // before this step
      const probability = probabilities(logits);
      nextTokens(chain, logits).forEach((t, k) => {
        let target = chain;
        if (k > 0) { // a fork: a copy of the chain that takes the k-th token instead
          target = { tokens: tokens.slice(), probs: probs.slice(), forks: [], forked: true };
          chain.forks.push(target);
        }
        target.tokens.push(t);
        target.probs.push(probability(t));
        grown.push(target);
        parents.push(b);
      });
    });
    const keep = [];
    grown.forEach((chain, j) => { if (stillOpen(chain)) keep.push(j); });
    if (keep.length === 0 || cutShort(keep.map((j) => grown[j]), settled)) return;
    const pick = keep.map((j) => parents[j]);
    // rows left or forked: their pasts follow
    if (pick.length !== rows.length || pick.some((b, j) => b !== j)) past = model.pastRows(out.past, pick);
    else past = out.past;
    rows = keep.map((j) => grown[j]);
  }
}

// Marks the open chains cut short and returns true if settled(openChains) (no end of them changes the words shown).
function cutShort(openChains, settled) {
  if (!settled(openChains)) return false;
  for (const chain of openChains) chain.cutShort = true;
  return true;
}

// [start, bound] of an open chain: the label of any word it may still end in starts with `start` (its text past the
// taken-back one, c, without leading spaces, after the partial word; "" while it still spells the taken-back text),
// with a probability of at most bound, the product over its tokens that spell part of c (they count in the word's
// product; a later token's probability is at most 1).
function reach(chain, tokenizer, prefix, partial) {
  const text = tokenizer.decode(chain.tokens);
  const c = text.length >= prefix.length ? text.slice(prefix.length).replace(/\ufffd+$/u, "") : "";
  const end = prefix.length + c.length;
  let bound = chain.probs[0];
  for (let i = 1; i < chain.tokens.length; i++) {
    if (wholeCharacters(tokenizer, chain.tokens.slice(0, i)).length >= end) break;
    bound *= chain.probs[i];
  }
  return [partial + c.replace(/^[ \t\n\r\f\v]+/u, ""), bound];
}

// Whether the first n of `words` (the decided chains' words, merged, in candidate order) stay the words shown, in
// the same order with the same probabilities and inserts, however the open chains (reaches: their [start, bound])
// end: n words are there, no open chain can end in one of them, and the n-th is more likely than the next one and
// every open chain together could be.
export function wordsSettled(words, reaches, n) {
  const ranked = [...words].sort((a, b) => b.probability - a.probability);
  const joins = (w) => reaches.some(([start]) => w.label.startsWith(start)); // an open chain may end in w
  if (ranked.length < n || ranked.slice(0, n).some(joins)) return false;
  let spare = 0;
  for (const [, bound] of reaches) spare += bound;
  spare += ranked.length > n ? ranked[n].probability : 0;
  return ranked[n - 1].probability > spare * (1 + 1e-9); // margin: float sums in another order
}

// The words of the decided chains, in candidate order (each chain, then its forks); chains with the same label are
// one word, their probabilities added up, inserting what the most probable of them inserts.
function merge(chains, decideTokens, partial) {
  const merged = new Map(); // label -> [word, the probability of its most probable chain]
  for (const chain of chains.flatMap((c) => [c, ...c.forks])) {
    const found = firstDecision(chain, decideTokens);
    if (!found) continue; // open, dead, or no word ended within MAX_EXTRA_TOKENS
    const [insert, word, ending, p] = found;
    const label = partial ? partial + word : word;
    const known = merged.get(label);
    if (!known) {
      merged.set(label, [{ label, insert, probability: p, ending }, p]);
      continue;
    }
    known[0].probability += p;
    if (p > known[1]) {
      Object.assign(known[0], { insert, ending });
      known[1] = p;
    }
  }
  return [...merged.values()].map(([word]) => word);
}

// tokenizer.decode, memoized (for one suggestion: the texts of a few chains' prefixes).
function memoDecoder(tokenizer) {
  const known = new Map();
  return {
    decode(ids) {
      const key = ids.join();
      let text = known.get(key);
      if (text === undefined) known.set(key, text = tokenizer.decode(ids));
      return text;
    },
  };
}

// The ids of `text` in the context window, the index of the first one token healing takes back (the context is
// ids[:cut], the chains spell the rest) and the partial word.
export function typedIds(tokenizer, text, maxSeqLen) {
  // step 1: the document start first (training puts it after every file, so the text is read as a file from its
  // start); null where the tokenizer has none
  const start = tokenizer.documentStart ?? null;
  const ids = contextWindow(start === null ? tokenizer.encode(text) : [start, ...tokenizer.encode(text)], maxSeqLen);
  const partial = trailingWord(text);
  // token healing: the last token, and earlier ones until HEAL_CHARS characters of the partial word, are
  // taken back; the chains spell their text again
  const cut = ids.length > 1 ? healedStart(tokenizer, ids, partial) : ids.length;
  return { ids, cut, partial };
}

// The n most likely whole next words after `text` (the text before the cursor).
// Returns {words: [{label, insert, probability, ending}], ms}.
export async function suggestWords(context, tokenizer, text, n = 3) {
  const t0 = performance.now();
  const { ids, cut, partial } = typedIds(tokenizer, text, context.model.maxSeqLen);
  if (ids.length === 0) return { words: [], ms: 0 };
  const logits = await context.update(ids.slice(0, cut));
  const texts = context.tokenTexts(tokenizer, logits.length);
  const prefix = cut < ids.length ? tokenizer.decode(ids.slice(cut)) : "";
  const chainText = memoDecoder(tokenizer); // the chains' prefixes are read again at every step
  const decideTokens = (tokens, probs) => decide(tokens, probs, chainText, texts, prefix, partial !== "");
  const nextTokens = (chain, logits) => { // greedy; where the word has not started, viable tokens, forking once
    const spelled = chainText.decode(chain.tokens);
    if (spelled.length < prefix.length) { // among the tokens that fit the taken-back text still unspelled
      return [firstTokens(logits, texts, prefix.slice(spelled.length), 1)[0] ?? argmax(logits)];
    }
    const c = spelled.slice(prefix.length).replace(/\ufffd+$/u, "");
    if (hasWordChar(c)) return [argmax(logits)];
    const count = chain.forked ? 1 : BRANCHES;
    chain.forked = true;
    const found = wordTokens(logits, texts, c, partial !== "", count);
    return found.length > 0 ? found : [argmax(logits)];
  };
  const chains = [], fresh = [];
  let norm = null; // the first tokens' softmax, taken only if a chain is new
  const probability = (t) => (norm ??= probabilities(logits))(t);
  // a chain of an earlier keystroke is computed again if it or a fork was cut short or is too short to decide
  const stale = (member) => member.cutShort || (firstDecision(member, decideTokens) === null
                                                && member.tokens.length <= MAX_EXTRA_TOKENS);
  for (const t of firstTokens(logits, texts, prefix, CANDIDATES, partial !== "")) {
    // a chain depends on its first token, the text it must spell and whether its word has started (where it forks)
    const key = `${t} ${hasWordChar(texts[t].slice(prefix.length))} ${prefix.slice(texts[t].length)}`;
    let chain = context.chains.get(key);
    if (!chain || [chain, ...chain.forks].some(stale)) {
      chain = { tokens: [t], probs: [probability(t)], forks: [], forked: false }; // new, or too short to decide
      context.chains.set(key, chain);
      fresh.push(chain);
    }
    chains.push(chain);
  }
  const stillOpen = (chain) => { // MAX_EXTRA_TOKENS after the token that completes the taken-back text
    let spelling = 1;
    const short = (k) => chainText.decode(chain.tokens.slice(0, k)).length < prefix.length;
    while (spelling < chain.tokens.length && short(spelling)) spelling++;
    // not spelled within MAX_SPELLING_TOKENS after the first: dropped
    if (chain.tokens.length > MAX_SPELLING_TOKENS && short(chain.tokens.length)) return false;
    return chain.tokens.length - spelling < MAX_EXTRA_TOKENS && decideTokens(chain.tokens, chain.probs) === null;
  };
  const settled = (openChains) => // the words shown can no longer change: stop extending (docs/keyboard.md step 6)
    wordsSettled(merge(chains, decideTokens, partial), openChains.map((c) => reach(c, chainText, prefix, partial)), n);
  await extend(context, fresh, stillOpen, nextTokens, settled);
  // Array.prototype.sort is stable: ties keep candidate order
  let words = merge(chains, decideTokens, partial).sort((a, b) => b.probability - a.probability).slice(0, n);
  if (partial === "" && words.length > 0) { // at a word start: the model's chance of each word given the typed text
    const z = prefixProbability(probability, texts, prefix);
    if (z > 0) words = words.map((w) => ({ ...w, probability: w.probability / z }));
  }
  return { words: withTypedWords(words, text, partial, n), ms: performance.now() - t0 };
}

// Step 11's Z: the probability that the next token fits the taken-back text (its non-empty text starts with prefix
// or is a proper prefix of it), summed in id order; 1 with no taken-back text.
export function prefixProbability(probability, texts, prefix) {
  if (prefix === "") return 1;
  let z = 0;
  for (let t = 0; t < texts.length; t++) {
    const s = texts[t];
    if (s !== "" && (s.startsWith(prefix) || prefix.startsWith(s))) z += probability(t);
  }
  return z;
}

// Step 11: the model's words (its n best) and the words already typed that go on from the partial word, each scored
// (1 - TYPED_SHARE - f) p + TYPED_SHARE c / C + f a / A (p: the model's probability, 0 for a word it did not show; c:
// the word's occurrences among the C words typed; a: those right after the word and link before the cursor, among A;
// f: FOLLOW_SHARE, 0 if A is 0); the n best, ties in that order (the model's, then by first occurrence). A chip
// inserts what the larger of its two parts inserts: the model's word, or the typed word (typedInsert; its ending:
// what followed it). A counts every follower, whether it goes on from the partial word or not.
export function withTypedWords(words, text, partial, n) {
  const before = text.slice(0, text.length - partial.length);
  const seen = typedWords(before), follows = typedFollowers(before);
  let total = 0, afterTotal = 0;
  for (const [count] of seen.values()) total += count;
  for (const count of follows.values()) afterTotal += count;
  const followShare = afterTotal > 0 ? FOLLOW_SHARE : 0;
  const keep = 1 - TYPED_SHARE - followShare;
  const out = new Map(words.map((w) => [w.label, { ...w, probability: keep * w.probability }]));
  for (const [word, [count, after]] of seen) {
    if (word.length <= partial.length || !word.startsWith(partial)) continue;
    const share = TYPED_SHARE * count / total + (follows.has(word) ? followShare * follows.get(word) / afterTotal : 0);
    if (!out.has(word)) out.set(word, { label: word, insert: "", probability: 0, ending: "" });
    const known = out.get(word);
    if (share > known.probability) { // a tap inserts what the larger part of the score inserts (as in step 9)
      Object.assign(known, { insert: typedInsert(word, partial, text, words), ending: after });
    }
    known.probability += share;
  }
  return [...out.values()].sort((a, b) => b.probability - a.probability).slice(0, n); // stable
}

// What a tap on a typed word inserts: the rest of it; at a word start after a symbol ("x =", "):") first the spaces
// the model's chip of that word, else its first chip, puts before its word (" y", "\n    return").
function typedInsert(word, partial, text, modelWords) {
  if (partial !== "" || text === "" || SPACES.includes(text[text.length - 1])) return word.slice(partial.length);
  const same = modelWords.find((w) => w.label === word) ?? modelWords[0];
  return (same ? same.insert.slice(0, same.insert.length - same.label.length) : "") + word;
}

// Where the words already typed are read from: after the text's TYPED_LINES-th last line break (0 if fewer).
function typedWindow(text) {
  let start = text.length;
  for (let k = 0; k < TYPED_LINES; k++) {
    start = start > 0 ? text.lastIndexOf("\n", start - 1) : -1;
    if (start < 0) break;
  }
  return start + 1;
}

// Map word -> [times it occurs, the character after its last occurrence] in the text's window (typedWindow), in
// order of first occurrence; text ends before the word being typed.
export function typedWords(text) {
  const seen = new Map();
  WORD_RUN.lastIndex = typedWindow(text);
  for (let m; (m = WORD_RUN.exec(text)) !== null;) {
    const end = m.index + m[0].length;
    const after = end < text.length ? String.fromCodePoint(text.codePointAt(end)) : "";
    seen.set(m[0], [(seen.get(m[0])?.[0] ?? 0) + 1, after]);
  }
  return seen;
}

// The symbols between two words, each run of spaces as one " " (one "\n" if it holds a line break).
export function link(between) {
  return between.replace(/[ \t\n\r\f\v]+/g, (run) => (run.includes("\n") ? "\n" : " "));
}

// Map word -> times it was typed right after the word and link that end text, in the text's window (its first word:
// after "" and the link from the window's start): after "self." the attributes typed after "self." before.
export function typedFollowers(text) {
  const pairs = [];
  let before = "", end = typedWindow(text);
  WORD_RUN.lastIndex = end;
  for (let m; (m = WORD_RUN.exec(text)) !== null;) {
    pairs.push([before, link(text.slice(end, m.index)), m[0]]);
    before = m[0];
    end = m.index + m[0].length;
  }
  const now = link(text.slice(end)), seen = new Map();
  for (const [wordBefore, between, word] of pairs) {
    if (wordBefore === before && between === now) seen.set(word, (seen.get(word) ?? 0) + 1);
  }
  return seen;
}
