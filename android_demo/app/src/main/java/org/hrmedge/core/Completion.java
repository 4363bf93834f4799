package org.hrmedge.core;

import java.util.Arrays;
import java.util.Locale;
import java.util.Random;
import java.util.function.BooleanSupplier;

/**
 * A streamed completion over a KV-cache program, with hrm_edge/runtime/decoders.py's generate() semantics, as the
 * page's Complete (generate.mjs): the prompt's end cut to the context (room for the tokens asked for), token healing (the
 * prompt's last token taken back; the first new token must start with its bytes), the repetition penalty before
 * sampling, temperature 0 greedy (argmax), else temperature and top-k; it stops at EOS, at the context's end, after
 * maxNewTokens, or when the caller says so. A greedy completion equals Python's token for token
 * (tests/test_android_core.py); sampled ones draw from java.util.Random, reproducible here but not numpy's draws.
 */
public final class Completion {
    /** What a completion is sampled with; the defaults are `python -m hrm_edge.complete`'s. */
    public static final class Settings {
        public double temperature = 0, repetitionPenalty = Sampling.DEFAULT_REPETITION_PENALTY;
        public int topK = 0, maxNewTokens = 64;
        public long seed = 0;
    }

    /** Receives the completion's text so far, each time it has grown by whole characters. */
    public interface Listener {
        void onText(String text);
    }

    /** What one completion made: the new tokens, their text (after the healed bytes) and its timings. */
    public static final class Result {
        public final int[] tokens;
        public final String text, stoppedAt;
        public final int promptTokens;
        public final boolean truncated;
        public final double prefillMs, decodeMs;

        Result(int[] tokens, String text, String stoppedAt, int promptTokens, boolean truncated, double prefillMs,
               double decodeMs) {
            this.tokens = tokens;
            this.text = text;
            this.stoppedAt = stoppedAt;
            this.promptTokens = promptTokens;
            this.truncated = truncated;
            this.prefillMs = prefillMs;
            this.decodeMs = decodeMs;
        }

        /** As `complete` prints it: the first new token comes from the prefill, each later one costs a decode step. */
        public String summary() {
            double decode = tokens.length > 1 && decodeMs > 0 ? (tokens.length - 1) / (decodeMs / 1000) : 0;
            double prefill = prefillMs > 0 ? promptTokens / (prefillMs / 1000) : 0;
            return String.format(Locale.ROOT, "%d tokens, decode %.0f tokens/s, prefill %d tokens at %.0f tokens/s"
                    + " (stopped at %s%s)", tokens.length, decode, promptTokens, prefill, stoppedAt,
                    truncated ? "; prompt cut to the context" : "");
        }
    }

    private final WordSuggester.StepModel model;
    private final byte[][] vocabBytes;
    private final int eosId;

    /** model: writes the rows of positions start.. and returns the last one's logits (WordSuggester's contract). */
    public Completion(WordSuggester.StepModel model, byte[][] vocabBytes, int eosId) {
        this.model = model;
        this.vocabBytes = vocabBytes;
        this.eosId = eosId;
    }

    /** Completes prompt (its token ids, at least one), streaming the text to listener (may be null); stop is asked
     *  before each decode step. */
    public Result run(int[] prompt, Settings s, Listener listener, BooleanSupplier stop) {
        if (prompt.length == 0) throw new IllegalArgumentException("empty prompt");
        // as complete: a positive temperature below 1e-4 overflows the scaled logits (written so that NaN fails too)
        if (!(s.temperature == 0 || (s.temperature >= 1e-4 && s.temperature <= 1e4))) {
            throw new IllegalArgumentException("temperature must be 0 (greedy) or in [1e-4, 1e4], got " + s.temperature);
        }
        int max = model.maxSeqLen();
        boolean truncated = prompt.length > max - 1; // no room for one new token
        // as complete --truncate: the end of the prompt, with room for the tokens asked for (half the context kept)
        int keep = max - Math.min(Math.max(s.maxNewTokens, 1), max / 2);
        TokenHealing heal = TokenHealing.heal(truncated ? Arrays.copyOfRange(prompt, prompt.length - keep,
                prompt.length) : prompt, vocabBytes);
        int[] context = Arrays.copyOf(heal.context, model.maxSeqLen()); // the context, then the new tokens
        int length = heal.context.length, budget = Math.min(s.maxNewTokens, model.maxSeqLen() - length);
        Random random = new Random(s.seed);
        long t0 = System.nanoTime();
        float[] logits = model.forward(heal.context, 0);
        long t1 = System.nanoTime();
        String stoppedAt = "max length", shown = "";
        for (int i = 0; i < budget; i++) {
            double[] z = Sampling.penalizeRepetition(logits, Arrays.copyOf(context, length), s.repetitionPenalty);
            int token = Sampling.sample(i == 0 ? heal.mask(z) : z, s.temperature, s.topK, random);
            context[length++] = token;
            String text = textAfter(heal, context, heal.context.length, length);
            if (!text.endsWith("\ufffd") && !text.equals(shown)) { // a character whose bytes are to come waits
                shown = text;
                if (listener != null) listener.onText(text);
            }
            if (token == eosId) {
                stoppedAt = "EOS";
                break;
            }
            if (i + 1 == budget) break;
            if (stop != null && stop.getAsBoolean()) {
                stoppedAt = "stop";
                break;
            }
            logits = model.forward(new int[] {token}, length - 1);
        }
        int[] tokens = Arrays.copyOfRange(context, heal.context.length, length);
        return new Result(tokens, textAfter(heal, context, heal.context.length, length), stoppedAt,
                heal.context.length, truncated, (t1 - t0) / 1e6, (System.nanoTime() - t1) / 1e6);
    }

    private String textAfter(TokenHealing heal, int[] ids, int from, int to) {
        return heal.textAfter(Arrays.copyOfRange(ids, from, to), vocabBytes);
    }
}
