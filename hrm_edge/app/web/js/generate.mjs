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

// Prefill the prompt, then sample up to maxNewTokens (stopping at EOS, the context length or when
// shouldStop() says so). onToken(token) is awaited after each token (the page streams text there). With
// settings.heal (healPrompt's; prompt is then the healed one) the first token is constrained.
// Returns {tokens, prefillMs, decodeMs, prefillTokensPerS, decodeTokensPerS, stoppedAt}.
export async function generate(model, prompt, settings, onToken, shouldStop = () => false) {
  const { maxNewTokens = 64, temperature = 0, topK = 0, seed = 0, eosId = null, repetitionPenalty = 1,
          heal = null } = settings;
  const random = seededRandom(seed);
  const tokens = [];
  let t = performance.now();
  let out = await model.run(prompt, model.emptyPast());
  let logits = row(out.logits, out.vocab, prompt.length - 1);
  const prefillMs = performance.now() - t;
  t = performance.now();
  const budget = Math.min(maxNewTokens, model.maxSeqLen - prompt.length);
  let stoppedAt = "max length";
  for (let i = 0; i < budget; i++) {
    const z = shapeLogits(logits, prompt.concat(tokens), repetitionPenalty, i === 0 ? heal : null);
    const token = sample(z, { temperature, topK }, random);
    tokens.push(token);
    await onToken(token);
    if (eosId !== null && token === eosId) { stoppedAt = "EOS"; break; }
    if (shouldStop()) { stoppedAt = "stop"; break; }
    if (i + 1 < budget) {
      out = await model.run([token], out.past);
      logits = row(out.logits, out.vocab, 0);
    }
  }
  const decodeMs = performance.now() - t;
  // the first new token comes from the prefill logits; each later one costs one decode step
  const steps = Math.max(tokens.length - 1, 0);
  return { tokens, prefillMs, decodeMs, stoppedAt,
           prefillTokensPerS: prefillMs ? prompt.length / (prefillMs / 1000) : 0,
           decodeTokensPerS: decodeMs ? steps / (decodeMs / 1000) : 0 };
}
