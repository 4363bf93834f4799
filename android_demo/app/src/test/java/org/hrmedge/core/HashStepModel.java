package org.hrmedge.core;

/**
 * tests/test_keyboard.py's fixture step model in Java: logits that are integer arithmetic on (token ids, position),
 * logit[v] = (mix(h ^ v * 0x85ebca6b) >>> 24) / 16 for allowed ids and -16 for the others, h a hash of the ids so
 * far and the position (seeded with `seed`); the same floats as the Python and JS fixtures. Holds one sequence's ids,
 * like a KV cache; a draft fixture shares them with its model (another seed: other logits, the same cache).
 */
final class HashStepModel implements WordSuggester.StepModel {
    private final boolean[] allowed;
    private final int maxSeqLen;
    private final int[] ids;
    private final int seed;
    /** forward() calls so far. */
    int calls;
    /** Run at each call, before its logits are computed (a key that comes while the call is in flight). */
    Runnable onCall;

    HashStepModel(int vocab, int[] allowedIds, int maxSeqLen) {
        allowed = new boolean[vocab];
        for (int id : allowedIds) allowed[id] = true;
        this.maxSeqLen = maxSeqLen;
        ids = new int[maxSeqLen];
        seed = 0x12345678;
    }

    /** A draft of `model`: its cache (ids), hashed from another seed. */
    HashStepModel(HashStepModel model, int seed) {
        allowed = model.allowed;
        maxSeqLen = model.maxSeqLen;
        ids = model.ids;
        this.seed = seed;
    }

    /** lowbias32 */
    static int mix(int x) {
        x ^= x >>> 16;
        x *= 0x7feb352d;
        x ^= x >>> 15;
        x *= 0x846ca68b;
        return x ^ (x >>> 16);
    }

    @Override
    public float[] forward(int[] tokens, int start) {
        if (start + tokens.length > maxSeqLen) throw new IllegalArgumentException("context full");
        calls++;
        if (onCall != null) onCall.run();
        System.arraycopy(tokens, 0, ids, start, tokens.length);
        int h = seed;
        for (int i = 0; i < start + tokens.length; i++) h = mix(h ^ (ids[i] * 0x9e3779b1 + i));
        float[] logits = new float[allowed.length];
        for (int v = 0; v < logits.length; v++) logits[v] = allowed[v] ? (mix(h ^ (v * 0x85ebca6b)) >>> 24) / 16f : -16f;
        return logits;
    }

    @Override
    public int maxSeqLen() {
        return maxSeqLen;
    }
}
