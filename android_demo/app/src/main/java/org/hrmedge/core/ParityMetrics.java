package org.hrmedge.core;

import java.util.ArrayList;
import java.util.List;
import java.util.Locale;

/**
 * The parity numbers of hrm_edge.verify.parity.compare, computed the same way: max |logits - ref| against
 * rel_max_abs x (ref max - ref min), top-1 agreement (first maximum on ties, like numpy's argmax) and the
 * perplexity ratio, with log-softmax in double precision.
 */
public final class ParityMetrics {
    public static final class Tolerance {
        public final double relMaxAbs, minTop1, maxPplRatio;

        public Tolerance(double relMaxAbs, double minTop1, double maxPplRatio) {
            this.relMaxAbs = relMaxAbs;
            this.minTop1 = minTop1;
            this.maxPplRatio = maxPplRatio;
        }
    }

    public static final class Result {
        public double maxAbsLogitError, logitRange, absLimit, top1Agreement, perplexity, referencePerplexity;
        public int positions;
        public boolean passed;
        public String reason = "";

        public String toJson() {
            return String.format(Locale.ROOT, "{\"max_abs_logit_error\":%.17g,\"logit_range\":%.17g,\"top1_agreement\":%.17g,"
                            + "\"perplexity\":%.17g,\"reference_perplexity\":%.17g,\"positions\":%d,\"passed\":%b,\"reason\":\"%s\"}",
                    maxAbsLogitError, logitRange, top1Agreement, perplexity, referencePerplexity, positions, passed,
                    reason.replace("\"", "'"));
        }
    }

    private ParityMetrics() {}

    /** logits and reference: [positions * vocab]; targets: [positions] next tokens. */
    public static Result compare(float[] logits, float[] reference, int[] targets, int vocab, Tolerance tol) {
        if (logits.length != reference.length || reference.length != targets.length * vocab) {
            throw new IllegalArgumentException("shape mismatch: " + logits.length + " vs " + reference.length);
        }
        Result r = new Result();
        double refMin = Double.POSITIVE_INFINITY, refMax = Double.NEGATIVE_INFINITY;
        boolean finite = true;
        for (int i = 0; i < reference.length; i++) {
            if (!Float.isFinite(logits[i])) finite = false;
            r.maxAbsLogitError = Math.max(r.maxAbsLogitError, Math.abs((double) logits[i] - reference[i]));
            refMin = Math.min(refMin, reference[i]);
            refMax = Math.max(refMax, reference[i]);
        }
        r.positions = targets.length;
        int agree = 0;
        for (int p = 0; p < r.positions; p++) if (argmax(logits, p, vocab) == argmax(reference, p, vocab)) agree++;
        r.top1Agreement = (double) agree / r.positions;
        r.perplexity = perplexity(logits, targets, vocab);
        r.referencePerplexity = perplexity(reference, targets, vocab);
        r.logitRange = refMax - refMin;
        r.absLimit = tol.relMaxAbs * r.logitRange;
        List<String> reasons = new ArrayList<>();
        if (!finite) reasons.add("non-finite logits");
        if (r.maxAbsLogitError > r.absLimit) {
            reasons.add(String.format(Locale.ROOT, "max abs logit error %.3g > %.3g", r.maxAbsLogitError, r.absLimit));
        }
        if (r.top1Agreement < tol.minTop1) {
            reasons.add(String.format(Locale.ROOT, "top-1 agreement %.4f < %s", r.top1Agreement, tol.minTop1));
        }
        double ratio = r.perplexity / r.referencePerplexity;
        if (ratio > tol.maxPplRatio) reasons.add(String.format(Locale.ROOT, "perplexity ratio %.5f > %s", ratio, tol.maxPplRatio));
        r.passed = reasons.isEmpty();
        r.reason = String.join("; ", reasons);
        return r;
    }

    /** A bundle's whole check: logits [samples * seqLen * vocab] of the artifact vs the bundle's reference. */
    public static Result check(float[] logits, WebBundle bundle, String precision) {
        int[] targets = new int[bundle.samples * bundle.seqLen];
        int[][] t = bundle.targets();
        for (int w = 0; w < bundle.samples; w++) System.arraycopy(t[w], 0, targets, w * bundle.seqLen, bundle.seqLen);
        return compare(logits, bundle.logits, targets, bundle.vocab, bundle.tolerance(precision));
    }

    static int argmax(float[] values, int row, int vocab) {
        int best = row * vocab;
        for (int i = best + 1; i < (row + 1) * vocab; i++) if (values[i] > values[best]) best = i;
        return best - row * vocab;
    }

    static double perplexity(float[] logits, int[] targets, int vocab) {
        double nll = 0;
        for (int p = 0; p < targets.length; p++) {
            double max = Double.NEGATIVE_INFINITY, sum = 0;
            for (int i = p * vocab; i < (p + 1) * vocab; i++) max = Math.max(max, logits[i]);
            for (int i = p * vocab; i < (p + 1) * vocab; i++) sum += Math.exp(logits[i] - max);
            nll -= logits[p * vocab + targets[p]] - max - Math.log(sum);
        }
        return Math.exp(nll / targets.length);
    }
}
