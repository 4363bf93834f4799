package org.hrmedge.core;

import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Chips computed ahead, in the idle time between keys (docs/keyboard.md "Lookahead"), as the page's lookahead.mjs:
 * after a key's chips are shown, the chips after each of the likeliest next keys are computed; a key that was guessed
 * shows them at once, with no model call. The chips are always those WordSuggester gives for the text: only when they
 * are computed changes.
 *
 * <p>The page computes ahead on forks of its context (an ONNX graph's cache is an input, kept by reference); an
 * ExecuTorch program holds one cache in its buffers, so here the work ahead moves the one WordSuggester on to the
 * guessed text, and a key that was not guessed goes back from there: the program's rows of the common start stay
 * valid (they do not depend on what follows), and the typed context's logits and chains are one of the suggester's
 * recent contexts.
 *
 * <p>Threads: keyTyped() may be called from any thread (the UI's, at each key); suggest() and ahead() run on one
 * worker thread, which makes every model call. A key stops the work ahead before its next model call: the call in
 * flight finishes (an ExecuTorch call cannot be interrupted), so a key waits for at most one.
 */
public final class Lookahead {
    /** Next keys computed ahead: 1, as the page (docs/keyboard-measurements.md "Lookahead at a typist's pace"). */
    public static final int KEYS = 1;

    /** What a model call of work ahead throws once a key has come. */
    static final class CalledOff extends RuntimeException {
        private static final long serialVersionUID = 1L;

        CalledOff() {
            super("work ahead called off by a key", null, false, false);
        }
    }

    /** A key's chips; ahead: computed before the key came; nextKeys: the likeliest keys after it (likelyKeys). */
    public static final class Result {
        public final List<WordSuggester.Suggestion> words;
        public final boolean ahead;
        public final List<String> nextKeys;

        Result(List<WordSuggester.Suggestion> words, boolean ahead, List<String> nextKeys) {
            this.words = words;
            this.ahead = ahead;
            this.nextKeys = nextKeys;
        }
    }

    private final WordSuggester suggester;
    private final AtomicInteger keys = new AtomicInteger(); // keys typed so far
    private int aheadFor = -1; // while work ahead runs: the number of the key it runs after (worker thread only)
    private final Map<String, Result> computed = new HashMap<>(); // text -> its chips computed ahead since the last key

    /** draft: as WordSuggester's (null: the model extends the chains). */
    public Lookahead(WordSuggester.StepModel model, WordSuggester.StepModel draft, ByteLevelBpe tokenizer) {
        suggester = new WordSuggester(stoppable(model), draft == null ? null : stoppable(draft), tokenizer);
    }

    /** A key came (any thread): the work ahead stops before its next model call. Returns the key's number. */
    public int keyTyped() {
        return keys.incrementAndGet();
    }

    /** The number of keys typed so far (any thread): read with the text a suggestion is for, and given to ahead(). */
    public int keysTyped() {
        return keys.get();
    }

    /** Another caller of the same program overwrote its cache rows (worker thread): start again from nothing. */
    public void forgetCache() {
        computed.clear();
        suggester.forgetCache();
    }

    /** The n chips after `text` (the text before the cursor): computed ahead, or now. */
    public Result suggest(String text, int n) {
        Result done = computed.get(text);
        computed.clear();
        if (done != null) return done;
        List<WordSuggester.Suggestion> words = suggester.suggest(text, n);
        return new Result(words, false, suggester.likelyKeys(text, words, KEYS));
    }

    /** Computes the chips after text + each of `next` (a Result's nextKeys), one after another, until a key after
     *  key number `key` comes. Returns how many were computed to their end. */
    public int ahead(String text, List<String> next, int n, int key) {
        aheadFor = key;
        int done = 0;
        try {
            for (String k : next) {
                if (keys.get() != key) break;
                String guessed = text + k;
                List<WordSuggester.Suggestion> words = suggester.suggest(guessed, n);
                computed.put(guessed, new Result(words, true, suggester.likelyKeys(guessed, words, KEYS)));
                done++;
            }
        } catch (RuntimeException e) { // called off (CalledOff), or failed: the key, when it comes, computes its
            // chips itself (and sees a failure that lasts); the suggester left the chains it was extending cut short
        } finally {
            aheadFor = -1;
        }
        return done;
    }

    /** The model, with each call of work ahead first checking that no key has come since. */
    private WordSuggester.StepModel stoppable(WordSuggester.StepModel model) {
        return new WordSuggester.StepModel() {
            @Override
            public float[] forward(int[] tokens, int start) {
                if (aheadFor >= 0 && keys.get() != aheadFor) throw new CalledOff();
                return model.forward(tokens, start);
            }

            @Override
            public int maxSeqLen() {
                return model.maxSeqLen();
            }
        };
    }
}
