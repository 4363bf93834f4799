// Chips computed ahead, in the idle time between keys (docs/keyboard.md "Lookahead"): after a keystroke's chips are
// shown, the chips after each of the likeliest next keys are computed on a fork of the typed context; a key that was
// guessed shows them at once. The chips are always those suggestWords gives for the text: only when they are computed
// changes. The next key stops the work ahead before its next graph call (a WASM call cannot be interrupted), so a key
// waits for at most the call in flight, and carries on from whichever context (the typed one or a fork) holds the
// longest start of its own: a window run again ahead (docs/keyboard.md step 2) serves a key that was not guessed too.
import { probabilities, suggestWords, typedIds } from "./suggest.mjs";

export const LOOKAHEAD_KEYS = 1; // next keys computed ahead: 1 (half the extra graph calls of 2; docs/keyboard.md "Lookahead")

export class Lookahead {
  constructor(context, tokenizer) {
    this.context = context; // the typed context (TypedContext): the fork a key carries on from replaces it
    this.tokenizer = tokenizer;
    this.forks = []; // the forks computed on since the last key, each {context, text, words (null: called off)}
    this.work = null; // the promise of the work ahead, while it runs
    this.stopping = false;
  }

  // The chips after `text` (the text before the cursor): {words, ms, ahead}, ahead true when they were computed in
  // the idle time before this key; ms from the call to the chips, the wait for the work ahead to stop included.
  async suggest(text, n = 3) {
    const t0 = performance.now();
    await this.stop();
    const done = this.forks.find((fork) => fork.text === text && fork.words);
    this.context = done ? done.context : this.closest(text);
    this.context.cancelled = false; // a fork called off carries on as the typed context
    this.forks = [];
    const words = done ? done.words : (await suggestWords(this.context, this.tokenizer, text, n)).words;
    return { words, ms: performance.now() - t0, ahead: Boolean(done) };
  }

  // Starts computing the chips after text + each of `keys` (likelyKeys), one after another, each on a fork of the
  // closest context; the next suggest() or stop() ends it. Returns its promise (resolved when it has ended).
  start(text, keys, n = 3) {
    const run = async () => {
      for (const key of keys) {
        if (this.stopping) return;
        try {
          const fork = { context: this.closest(text + key).fork(), text: text + key, words: null };
          this.forks.push(fork);
          fork.words = (await suggestWords(fork.context, this.tokenizer, fork.text, n)).words;
        } catch {
          return; // called off (Cancelled), or failed: the key, if it comes, computes its chips itself
        }
      }
    };
    this.work = run().finally(() => { this.work = null; });
    return this.work;
  }

  // Calls off the work ahead and waits for its graph call in flight.
  async stop() {
    if (!this.work) return;
    this.stopping = true;
    for (const fork of this.forks) fork.context.cancelled = true;
    try {
      await this.work;
    } finally {
      this.stopping = false;
    }
  }

  // Of the typed context and the forks, the one whose ids share the longest start with the context `text` needs (the
  // typed context on ties): the fewest tokens to run.
  closest(text) {
    const { ids, cut } = typedIds(this.tokenizer, text, this.context.model.maxSeqLen);
    const shared = (context) => {
      let i = 0;
      while (i < cut && i < context.ids.length && context.ids[i] === ids[i]) i++;
      return i === context.ids.length ? i : i - 0.5; // a context longer than the start is cut back: a little worse
    };
    let best = this.context;
    for (const { context } of this.forks) if (shared(context) > shared(best)) best = context;
    return best;
  }
}

// The `count` likeliest next characters after `text`, given the typed context after suggestWords(context, tokenizer,
// text) and its chips `words`: the first character of each chip's insert, in chip order, then those of the tokens
// that continue the taken-back text (healing), by their summed probability.
export function likelyKeys(context, tokenizer, text, words, count = LOOKAHEAD_KEYS) {
  const keys = [];
  const add = (ch) => { if (keys.length < count && !keys.includes(ch)) keys.push(ch); };
  for (const w of words) if (w.insert) add(String.fromCodePoint(w.insert.codePointAt(0)));
  if (keys.length >= count || !context.logits) return keys;
  const { ids, cut } = typedIds(tokenizer, text, context.model.maxSeqLen);
  if (ids.length === 0) return keys; // no text: the context's logits are those of an earlier one
  const prefix = cut < ids.length ? tokenizer.decode(ids.slice(cut)) : "";
  const texts = context.tokenTexts(tokenizer, context.logits.length), probability = probabilities(context.logits);
  const mass = new Map(); // next character -> summed probability of the tokens that continue with it
  texts.forEach((tokenText, t) => {
    if (tokenText.length <= prefix.length || !tokenText.startsWith(prefix)) return;
    const ch = String.fromCodePoint(tokenText.codePointAt(prefix.length));
    mass.set(ch, (mass.get(ch) ?? 0) + probability(t));
  });
  [...mass].sort((a, b) => b[1] - a[1]).forEach(([ch]) => add(ch));
  return keys;
}
