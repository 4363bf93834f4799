package org.hrmedge.core;

import static org.junit.Assert.assertEquals;

import java.util.ArrayList;
import java.util.List;
import org.junit.Test;

public class WordSuggesterTest {
    /** A fake KV program whose next-token logits depend on the last token only; records its calls. */
    static final class FakeModel implements WordSuggester.StepModel {
        final List<String> calls = new ArrayList<>();

        @Override
        public float[] forward(int[] tokens, int start) {
            calls.add(start + ":" + tokens.length);
            float[] logits = new float[9];
            java.util.Arrays.fill(logits, -20f);
            switch (tokens[tokens.length - 1]) {
                case 5: logits[6] = 2f; logits[7] = 1f; logits[2] = 0f; break; // after "c": " a" > " b" > " "
                case 6: logits[8] = 5f; break; // " a" -> "("
                case 7: logits[4] = 5f; break; // " b" -> "b"
                case 4: logits[8] = 5f; break; // "b" -> "("
                case 2: logits[5] = 5f; break; // " " -> "c"
                default: logits[8] = 5f;
            }
            return logits;
        }

        @Override
        public int maxSeqLen() {
            return 64;
        }
    }

    @Test
    public void ranksWordsByJointProbabilityAfterHealingTheTrailingSpace() {
        FakeModel model = new FakeModel();
        WordSuggester s = new WordSuggester(model, TestTokenizer.load());
        List<WordSuggester.Suggestion> words = s.suggest("c ", 3);
        List<String> inserts = new ArrayList<>();
        for (WordSuggester.Suggestion w : words) inserts.add(w.insert);
        // the text's trailing " " is taken back: candidates " a", " b", " " follow "c"
        assertEquals(List.of("a", "bb", "c"), inserts);
        double z = Math.exp(2) + Math.exp(1) + Math.exp(0) + 6 * Math.exp(-20);
        assertEquals(Math.exp(2) / z * pNext(), words.get(0).probability, 1e-9); // " a" then "(" ends it
        assertEquals(Math.exp(1) / z * pNext() * pNext(), words.get(1).probability, 1e-9); // " b", "b", "("
        assertEquals("0:1", model.calls.get(0)); // the context "c" at position 0
    }

    @Test
    public void reusesTheCachedPrefixWhenTyping() {
        FakeModel model = new FakeModel();
        WordSuggester s = new WordSuggester(model, TestTokenizer.load());
        s.suggest("c a c ", 3); // "c", " a", " ", "c", " ": context = the first 4 tokens
        model.calls.clear();
        s.suggest("c a c b", 3); // "c", " a", " ", "c", " b": the same context, a different healed token
        assertEquals("3:1", model.calls.get(0)); // only the last context token runs again, at position 3
    }

    /** Probability of the preferred token when its logit is 5 and the other 8 are -20. */
    static double pNext() {
        return Math.exp(5) / (Math.exp(5) + 8 * Math.exp(-20));
    }
}
