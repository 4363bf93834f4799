// node lookup_fixture.mjs JOB.json: the page's generate() (hrm_edge/app/web/js/generate.mjs) with and without
// context lookup on a fixture model, its contextGuess on the job's cases and its promptEnd on the job's cuts. tests/test_speculative.py copies this
// file and the page's js/ folder next to a node_modules with the page's pinned packages and compares the printed
// JSON with Python's context_guess and with plain greedy decoding.
import { readFileSync } from "node:fs";

globalThis.location = { search: "" }; // model.mjs reads the page's URL
const { contextGuess, generate, promptEnd } = await import("./js/generate.mjs");

// A KvModel stand-in whose greedy choice after token t is next[t] (a fixed permutation cycle over a few tokens, so
// the text repeats and lookups find it), with small position-dependent values elsewhere so that the repetition
// penalty can change the argmax. Its past holds the ids, as the page's past holds keys and values.
class CycleModel {
  constructor(vocab, next, maxSeqLen) {
    this.vocab = vocab; this.next = next; this.maxSeqLen = maxSeqLen; this.calls = 0;
  }
  emptyPast() { return { ids: [], length: 0 }; }
  slicePast(past, n) { return { ids: past.ids.slice(0, n), length: n }; }
  async run(tokens, past) {
    if (past.length + tokens.length > this.maxSeqLen) throw new Error("context full");
    this.calls += 1;
    const ids = past.ids.concat(tokens), V = this.vocab;
    const logits = new Float32Array(tokens.length * V);
    tokens.forEach((t, s) => {
      const position = past.length + s;
      for (let v = 0; v < V; v++) logits[s * V + v] = ((v * 7 + position * 3) % 11) / 10; // 0 .. 1
      logits[s * V + this.next[t]] = 1.15; // ahead, unless a penalty of 1.2 puts it below the runner-up
    });
    return { logits, vocab: V, past: { ids, length: ids.length } };
  }
}

// The draft and verify graphs of the same fixture (AdaptiveModel's split / draftRun / verifyRun / commit): the verify
// graph gives CycleModel's logits, the draft graph CycleModel's except at every fifth position, where its favourite
// is another token (so some proposals are rejected). Each half's past holds its ids; the calls check that the
// halves and the draft states line up as the page's graphs need them to.
class CycleSet {
  constructor(full) { this.full = full; this.calls = 0; }
  split(past) { return { first: past, rest: past }; }
  async draftRun(tokens, first) {
    this.calls += 1;
    const out = await this.full.run(tokens, first), V = this.full.vocab;
    tokens.forEach((t, s) => {
      if ((first.length + s) % 5 === 0) out.logits[s * V + ((this.full.next[t] + 1) % V)] = 1.3;
    });
    const state = { dims: [2, 1, tokens.length, 1], positions: tokens.map((_, s) => first.length + s) };
    return { logits: out.logits, vocab: V, state, first: out.past };
  }
  async verifyRun(tokens, states, rest) {
    this.calls += 1;
    const positions = states.flatMap((s) => s.positions);
    if (positions.join() !== tokens.map((_, s) => rest.length + s).join()) throw new Error(`states ${positions}`);
    const out = await this.full.run(tokens, rest);
    return { logits: out.logits, vocab: out.vocab, rest: out.past };
  }
  commit(halves, n) { return { first: this.full.slicePast(halves.first, n), rest: this.full.slicePast(halves.rest, n) }; }
}

const job = JSON.parse(readFileSync(process.argv[2], "utf8"));
const guesses = job.guesses.map(([context, maxLen]) => contextGuess(context, maxLen));
const runs = [];
for (const { prompt, penalty, maxNew } of job.generations) {
  const out = {};
  for (const lookupLen of [0, 8]) {
    const model = new CycleModel(job.vocab, job.next, job.max_seq_len);
    const g = await generate(model, prompt, { maxNewTokens: maxNew, repetitionPenalty: penalty, lookupLen,
                                              eosId: job.eos }, async () => {});
    out[lookupLen] = { tokens: g.tokens, calls: g.calls, fromContext: g.fromContext, modelCalls: model.calls,
                       stoppedAt: g.stoppedAt };
    // self-speculative rounds: the prefill on the KV model, then the draft and verify graphs only
    const kv = new CycleModel(job.vocab, job.next, job.max_seq_len), set = new CycleSet(new CycleModel(job.vocab,
      job.next, job.max_seq_len));
    const r = await generate(kv, prompt, { maxNewTokens: maxNew, repetitionPenalty: penalty, lookupLen, eosId: job.eos,
                                           speculative: set, draftLen: 4 }, async () => {});
    out[`draft${lookupLen}`] = { tokens: r.tokens, calls: r.calls, fromContext: r.fromContext, rounds: r.rounds,
                                 proposed: r.proposed, accepted: r.accepted, kvCalls: kv.calls, setCalls: set.calls };
  }
  runs.push(out);
}
const cuts = (job.cuts ?? []).map(([n, maxLen, maxNew]) => promptEnd([...Array(n).keys()], maxLen, maxNew));
console.log(JSON.stringify({ guesses, runs, cuts }));
