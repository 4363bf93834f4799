// Sampling and the prefill + decode loop, with the semantics of hrm_edge/runtime/decoders.py (sample, generate):
// temperature 0 is greedy (argmax, the first maximum on ties, like numpy), so a greedy completion here
// equals `python -m hrm_edge.complete --runtime onnx` token for token. Sampled completions use this page's
// own seeded generator, so they are reproducible here but not the same draws as numpy's. Token healing and the
// repetition penalty shape the logits first (healing.mjs, hrm_edge/runtime/healing.py).
import { shapeLogits } from "./healing.mjs";
import { row } from "./model.mjs";

export function argmax(values) {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

// Small seeded PRNG (mulberry32): uniform floats in [0, 1).
export function seededRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// logits: Float32Array or Float64Array [V]; {temperature, topK}; random: () => [0, 1). Returns a token id.
export function sample(logits, { temperature = 0, topK = 0 }, random) {
  if (!(temperature > 0)) return argmax(logits);
  const z = Float64Array.from(logits, (x) => x / temperature);
  if (topK > 0 && topK < z.length) {
    const kth = Float64Array.from(z).sort()[z.length - topK]; // the k-th largest; ties with it are kept
    for (let i = 0; i < z.length; i++) if (z[i] < kth) z[i] = -Infinity;
  }
  const p = softmax(z);
  let u = random(), last = 0;
  for (let i = 0; i < p.length; i++) {
    if (p[i] === 0) continue;
    last = i;
    u -= p[i];
    if (u < 0) return i;
  }
  return last; // u left over from rounding: the last token with mass
}

export function softmax(values) {
  let max = -Infinity;
  for (const x of values) if (x > max) max = x;
  const p = new Float64Array(values.length);
  let sum = 0;
  for (let i = 0; i < values.length; i++) sum += (p[i] = Math.exp(values[i] - max));
  for (let i = 0; i < p.length; i++) p[i] /= sum;
  return p;
}

const LOOKUP_NGRAMS = [3, 2]; // as hrm_edge/runtime/speculative.py (the page's lookup length: index.html, 8)

// Prompt lookup, as hrm_edge.runtime.speculative.context_guess: the (at most maxLen) tokens that followed the
// latest earlier occurrence of the context's last n tokens, for the first n of ngrams that occurs; [] if none.
export function contextGuess(context, maxLen, ngrams = LOOKUP_NGRAMS) {
  if (maxLen < 1) return [];
  for (const n of ngrams) {
    const tail = context.length - n; // the last n tokens start here
    for (let j = tail - 1; j >= 0; j--) { // an earlier window, the latest first (its continuation is in context)
      let k = 0;
      while (k < n && context[j + k] === context[tail + k]) k++;
      if (k === n) return context.slice(j + n, j + n + maxLen);
    }
  }
  return [];
}

// Prefill the prompt, then sample up to maxNewTokens (stopping at EOS, the context length or when
// shouldStop() says so). onToken(token) is awaited after each token (the page streams text there). With
// settings.heal (healPrompt's; prompt is then the healed one) the first token is constrained.
// settings.lookupLen > 0 with temperature 0: each decode call also runs the tokens that followed the same n-gram
// earlier in the context (contextGuess) and keeps those the model would have chosen anyway, so the tokens are the
// greedy ones exactly, in fewer calls (exact speculative decoding with the context as the draft).
// settings.speculative (an AdaptiveModel: the draft and verify graphs) with settings.draftLen > 0, greedy:
// self-speculative rounds instead (draftRounds), as `complete --speculative --draft-len --lookup-len`.
// settings.adaptive (an AdaptiveModel) with settings.exitThreshold: adaptive depth instead (each decoded token may
// exit after the first outer cycle; lossy, opt-in), as `complete --exit-threshold`.
// Returns {tokens, prefillMs, decodeMs, prefillTokensPerS, decodeTokensPerS, stoppedAt, calls, fromContext,
// exited, rounds, proposed, accepted}.
// The prompt, or where it leaves no room for one new token, its end: room for maxNewTokens (at least one), half the
// context kept at least (healing.py prompt_end: complete --truncate and the Android core cut alike).
export function promptEnd(ids, maxSeqLen, maxNewTokens) {
  if (ids.length <= maxSeqLen - 1) return ids;
  return ids.slice(ids.length - (maxSeqLen - Math.min(Math.max(maxNewTokens, 1), Math.floor(maxSeqLen / 2))));
}

export async function generate(model, prompt, settings, onToken, shouldStop = () => false) {
  const { maxNewTokens = 64, temperature = 0, topK = 0, seed = 0, eosId = null, repetitionPenalty = 1,
          heal = null, lookupLen = 0, adaptive = null, exitThreshold = 1.01, speculative = null,
          draftLen = 0 } = settings;
  // as complete: a positive temperature below 1e-4 overflows the scaled logits (written so that NaN fails too)
  if (!(temperature === 0 || (temperature >= 1e-4 && temperature <= 1e4))) {
    throw new Error(`temperature must be 0 (greedy) or in [1e-4, 1e4], got ${temperature}`);
  }
  const random = seededRandom(seed);
  // a guess is checked against the argmax: greedy only, and not with adaptive depth (whose logits depend on depth)
  const lookup = temperature > 0 || adaptive ? 0 : lookupLen;
  const rounds = speculative && draftLen > 0 && !(temperature > 0) && !adaptive;
  const tokens = [];
  let t = performance.now();
  const out = await model.run(prompt, model.emptyPast());
  const prefillMs = performance.now() - t;
  t = performance.now();
  const budget = Math.min(maxNewTokens, model.maxSeqLen - prompt.length);
  const pick = (logits) => sample(shapeLogits(logits, prompt.concat(tokens), repetitionPenalty,
                                              tokens.length === 0 ? heal : null), { temperature, topK }, random);
  let stoppedAt = null; // set by emit when the completion ends
  const emit = async (token) => {
    tokens.push(token);
    await onToken(token);
    if (eosId !== null && token === eosId) stoppedAt = "EOS";
    else if (shouldStop()) stoppedAt = "stop";
    else if (tokens.length >= budget) stoppedAt = "max length";
  };
  let logits = row(out.logits, out.vocab, prompt.length - 1), past = out.past, calls = 0, fromContext = 0, exited = 0;
  let halves = adaptive ? adaptive.split(past) : null; // the prefill ran the full depth
  if (budget < 1) stoppedAt = "max length";
  let spec = { rounds: 0, proposed: 0, accepted: 0 };
  if (rounds && stoppedAt === null) {
    await emit(pick(logits));
    const decoding = { emit, pick, stopped: () => stoppedAt !== null, context: () => prompt.concat(tokens),
                       room: () => budget - tokens.length, draftLen, lookupLen: lookup, repetitionPenalty };
    spec = await draftRounds(speculative, speculative.split(past), decoding);
    [calls, fromContext] = [spec.calls, spec.fromContext];
  }
  while (stoppedAt === null) {
    const token = pick(logits);
    await emit(token);
    if (stoppedAt !== null) break;
    if (adaptive) {
      const s = await adaptive.step(token, halves, exitThreshold);
      [logits, halves, calls, exited] = [s.logits, s.halves, calls + 1, exited + s.exited];
      continue;
    }
    const guess = contextGuess(prompt.concat(tokens), Math.min(lookup, budget - tokens.length - 1));
    const step = await model.run([token, ...guess], past); // logits [1 + guess, V]
    calls += 1;
    let kept = 0; // guessed tokens the model chose too
    while (kept < guess.length && stoppedAt === null && pick(row(step.logits, step.vocab, kept)) === guess[kept]) {
      await emit(guess[kept]);
      kept += 1;
    }
    fromContext += kept;
    logits = row(step.logits, step.vocab, kept);
    past = kept === guess.length ? step.past : model.slicePast(step.past, past.length + 1 + kept);
  }
  const decodeMs = performance.now() - t;
  // the first new token comes from the prefill logits; the others from `calls` decode calls
  const steps = Math.max(tokens.length - 1, 0);
  return { tokens, prefillMs, decodeMs, stoppedAt, calls, fromContext, exited, rounds: spec.rounds,
           proposed: spec.proposed, accepted: spec.accepted,
           prefillTokensPerS: prefillMs ? prompt.length / (prefillMs / 1000) : 0,
           decodeTokensPerS: decodeMs ? steps / (decodeMs / 1000) : 0 };
}

// Greedy self-speculative rounds (hrm_edge.runtime.speculative.generate_speculative), after the first new token: a
// round's inputs are the last token and its proposals; the proposals are the tokens that followed the same n-gram
// earlier in the context (contextGuess, at most lookupLen: one draft-graph call for all) or else draftLen argmaxes
// of the draft graph (the first outer cycle, one call each, its logits shaped by the repetition penalty); one
// verify-graph call gives the full depth's logits at every input, whose picks are kept up to the first that differs
// from a proposal. So the tokens are the full depth's greedy ones, in fewer full-depth calls. spec: an
// AdaptiveModel (split, draftRun, verifyRun, commit); d: the generation (emit, pick, stopped, context, room, ...).
// Returns {calls, fromContext, rounds, proposed, accepted}.
async function draftRounds(spec, halves, d) {
  const stats = { calls: 0, fromContext: 0, rounds: 0, proposed: 0, accepted: 0 };
  while (!d.stopped()) {
    const context = d.context(), start = halves.first.length;
    const inputs = [context[context.length - 1]], states = [];
    const guess = contextGuess(context, Math.min(d.lookupLen, d.room() - 1));
    let first = halves.first;
    const draft = async (tokens) => {
      const r = await spec.draftRun(tokens, first);
      [first, stats.calls] = [r.first, stats.calls + 1];
      states.push(r.state);
      return row(r.logits, r.vocab, tokens.length - 1);
    };
    if (guess.length) {
      inputs.push(...guess);
      await draft(inputs);
    } else {
      const n = Math.min(d.draftLen + 1, d.room()); // the last draft's state only: its proposal would go unverified
      for (let i = 0; i < n; i++) {
        const logits = await draft([inputs[i]]);
        if (i < n - 1) inputs.push(argmax(shapeLogits(logits, context.concat(inputs.slice(1)), d.repetitionPenalty)));
      }
    }
    const verified = await spec.verifyRun(inputs, states, halves.rest);
    stats.calls += 1;
    let kept = 0; // inputs whose position is committed: the last token and the proposals the full depth chose too
    while (!d.stopped() && kept < inputs.length) {
      const token = d.pick(row(verified.logits, verified.vocab, kept));
      await d.emit(token);
      kept += 1;
      if (kept === inputs.length || token !== inputs[kept]) break;
      if (guess.length) stats.fromContext += 1;
    }
    halves = spec.commit({ first, rest: verified.rest }, start + kept);
    Object.assign(stats, { rounds: stats.rounds + 1, proposed: stats.proposed + inputs.length - 1,
                           accepted: stats.accepted + kept - 1 });
  }
  return stats;
}
