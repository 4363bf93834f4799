// Self-test: run the web parity bundle (hrm_edge/verify/web_bundle.py) through the model on this device and
// compare with the fp32 eager logits the export computed, exactly as hrm_edge.verify.parity.compare does:
// max |logits - ref| <= rel_max_abs x (ref max - ref min), top-1 agreement >= min_top1, perplexity ratio
// <= max_ppl_ratio, with the tolerances the export wrote into the bundle (from its manifest).
import { fetchOk, row } from "./model.mjs";

const MAGIC = "HRMWEB01";

// ArrayBuffer -> {header, windows: int[][], logits: Float32Array [N * S * V]}
export function parseWebBundle(buffer) {
  const bytes = new Uint8Array(buffer);
  if (new TextDecoder().decode(bytes.subarray(0, 8)) !== MAGIC) throw new Error("not a web parity bundle");
  const headerLength = new DataView(buffer).getUint32(8, true);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(12, 12 + headerLength)));
  if (header.format_version !== 1) throw new Error(`unsupported web bundle format ${header.format_version}`);
  const { samples: n, seq_len: s, vocab_size: v, logits_offset: offset } = header;
  // little-endian float32, 4-byte aligned by the writer (every phone CPU is little-endian)
  const logits = new Float32Array(buffer, offset, n * s * v);
  return { header, windows: header.windows, logits };
}

export async function loadWebBundle(url) {
  return parseWebBundle(await fetchOk(url).then((r) => r.arrayBuffer()));
}

// Logits of every position of every window [N * S * V]: prefill prefill_len tokens, then one decode step
// per remaining token (hrm_edge.runtime.decoders.decode_logits).
export async function runBundle(model, bundle, onProgress = () => {}) {
  const { samples: n, seq_len: s, vocab_size: v, prefill_len: prefill } = bundle.header;
  const logits = new Float32Array(n * s * v);
  for (let w = 0; w < n; w++) {
    const inputs = bundle.windows[w].slice(0, s);
    let out = await model.run(inputs.slice(0, prefill), model.emptyPast());
    logits.set(out.logits, w * s * v);
    for (let i = prefill; i < s; i++) {
      out = await model.run([inputs[i]], out.past);
      logits.set(out.logits, (w * s + i) * v);
    }
    onProgress(w + 1, n);
  }
  return logits;
}

function perplexity(logits, bundle) {
  const { samples: n, seq_len: s, vocab_size: v } = bundle.header;
  let nll = 0;
  for (let w = 0; w < n; w++) {
    for (let i = 0; i < s; i++) {
      const r = row(logits, v, w * s + i);
      let max = -Infinity, sum = 0;
      for (const x of r) if (x > max) max = x;
      for (const x of r) sum += Math.exp(x - max);
      nll -= r[bundle.windows[w][i + 1]] - max - Math.log(sum);
    }
  }
  return Math.exp(nll / (n * s));
}

// The numbers and verdict of hrm_edge.verify.parity.compare for logits vs the bundle's reference.
export function compare(logits, bundle, tolerance) {
  const ref = bundle.logits, v = bundle.header.vocab_size;
  let maxAbs = 0, refMin = Infinity, refMax = -Infinity, agree = 0, finite = true;
  for (let i = 0; i < ref.length; i++) {
    if (!Number.isFinite(logits[i])) finite = false;
    maxAbs = Math.max(maxAbs, Math.abs(logits[i] - ref[i]));
    refMin = Math.min(refMin, ref[i]);
    refMax = Math.max(refMax, ref[i]);
  }
  const positions = ref.length / v;
  for (let p = 0; p < positions; p++) if (argmaxRow(logits, v, p) === argmaxRow(ref, v, p)) agree++;
  const top1 = agree / positions;
  const ppl = perplexity(logits, bundle), refPpl = perplexity(ref, bundle);
  const absLimit = tolerance.rel_max_abs * (refMax - refMin);
  const reasons = [];
  if (!finite) reasons.push("non-finite logits");
  if (maxAbs > absLimit) reasons.push(`max abs logit error ${maxAbs.toPrecision(3)} > ${absLimit.toPrecision(3)}`);
  if (top1 < tolerance.min_top1) reasons.push(`top-1 agreement ${top1.toFixed(4)} < ${tolerance.min_top1}`);
  if (ppl / refPpl > tolerance.max_ppl_ratio) {
    reasons.push(`perplexity ratio ${(ppl / refPpl).toFixed(5)} > ${tolerance.max_ppl_ratio}`);
  }
  return { max_abs_logit_error: maxAbs, logit_range: refMax - refMin, abs_limit: absLimit, top1_agreement: top1,
           perplexity: ppl, reference_perplexity: refPpl, positions, tolerance,
           passed: reasons.length === 0, reason: reasons.join("; ") };
}

function argmaxRow(values, v, p) {
  let best = p * v;
  for (let i = p * v + 1; i < (p + 1) * v; i++) if (values[i] > values[best]) best = i;
  return best - p * v;
}

// fp32 programs are held to the fp32 gate; quantized ones to what their quantization may cost vs fp32 (int4 to the
// int4 bounds; a bundle written before it carried them: the int8 ones). Python twin: web_bundle.WebBundle.tolerance.
export function toleranceFor(bundle, precision) {
  const t = bundle.header.tolerances;
  return t[`${precision}_vs_fp32_eager`] ?? t.int8_vs_fp32_eager;
}

export async function selfTest(model, bundle, precision, onProgress) {
  const t = performance.now();
  const logits = await runBundle(model, bundle, onProgress);
  return { ...compare(logits, bundle, toleranceFor(bundle, precision)), ms: performance.now() - t };
}
