package org.hrmedge.core;

import java.util.Random;

/**
 * Greedy / temperature / top-k sampling with hrm_edge/runtime/decoders.py's semantics (temperature 0 = argmax), and
 * the repetition penalty of hrm_edge/runtime/healing.py (applied to the logits before sampling).
 */
public final class Sampling {
    /** hrm_edge/runtime/healing.py's DEFAULT_REPETITION_PENALTY (measured in docs/demo.md; tests check they agree). */
    public static final double DEFAULT_REPETITION_PENALTY = 1.2;

    private Sampling() {}

    /** First maximum on ties, like numpy's argmax. */
    public static int argmax(double[] values) {
        int best = 0;
        for (int i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
        return best;
    }

    public static double[] softmax(float[] logits) {
        double[] z = new double[logits.length];
        for (int i = 0; i < z.length; i++) z[i] = logits[i];
        return softmax(z);
    }

    public static double[] softmax(double[] z) {
        double max = Double.NEGATIVE_INFINITY, sum = 0;
        for (double x : z) max = Math.max(max, x);
        double[] p = new double[z.length];
        for (int i = 0; i < z.length; i++) sum += (p[i] = Math.exp(z[i] - max));
        for (int i = 0; i < z.length; i++) p[i] /= sum;
        return p;
    }

    /**
     * Hugging Face's repetition penalty in doubles (the same numbers as Python and the page): for every token id in
     * context (the prefilled prompt and the tokens generated so far), a positive logit is divided by penalty, a
     * negative one multiplied by it. penalty 1 = off.
     */
    public static double[] penalizeRepetition(float[] logits, int[] context, double penalty) {
        double[] z = new double[logits.length];
        for (int i = 0; i < z.length; i++) z[i] = logits[i];
        if (penalty == 1.0) return z;
        boolean[] seen = new boolean[z.length];
        for (int id : context) {
            if (seen[id]) continue;
            seen[id] = true;
            z[id] = z[id] > 0 ? z[id] / penalty : z[id] * penalty;
        }
        return z;
    }

    public static int sample(float[] logits, double temperature, int topK, Random random) {
        double[] z = new double[logits.length];
        for (int i = 0; i < z.length; i++) z[i] = logits[i];
        return sample(z, temperature, topK, random);
    }

    /** Samples from logits z [V] (penalised and masked, -infinity allowed); z is not changed. */
    public static int sample(double[] logits, double temperature, int topK, Random random) {
        double[] z = logits.clone();
        if (!(temperature > 0)) return argmax(z);
        for (int i = 0; i < z.length; i++) z[i] /= temperature;
        if (topK > 0 && topK < z.length) {
            double[] sorted = z.clone();
            java.util.Arrays.sort(sorted);
            double kth = sorted[z.length - topK]; // ties with the k-th largest are kept
            for (int i = 0; i < z.length; i++) if (z[i] < kth) z[i] = Double.NEGATIVE_INFINITY;
        }
        double[] p = softmax(z);
        double u = random.nextDouble();
        int last = 0;
        for (int i = 0; i < p.length; i++) {
            if (p[i] == 0) continue;
            last = i;
            u -= p[i];
            if (u < 0) return i;
        }
        return last;
    }
}
