package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

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
                case 6: logits[8] = 1f; logits[3] = 0f; break; // " a" -> "(" (p 0.73: not part of the word)
                case 7: logits[4] = 5f; break; // " b" -> "b"
                case 4: logits[8] = 5f; break; // "b" -> "("
                case 2: logits[5] = 5f; break; // " " -> "c"
                case 3: logits[3] = 5f; break; // "a" -> "a" -> "a"...: a word that never ends
                default: logits[8] = 5f;
            }
            return logits;
        }

        @Override
        public int maxSeqLen() {
            return 64;
        }
    }

    static List<String> labels(List<WordSuggester.Suggestion> words) {
        List<String> out = new ArrayList<>();
        for (WordSuggester.Suggestion w : words) out.add(w.label + "|" + w.insert + "|" + w.ending);
        return out;
    }

    @Test
    public void ranksWholeWordsByTheProbabilityOfTheirOwnTokens() {
        FakeModel model = new FakeModel();
        List<WordSuggester.Suggestion> words = new WordSuggester(model, TestTokenizer.load()).suggest("c ", 3);
        // the text's trailing " " is taken back: chains " a" "(", " b" "b" "(", " " "c" " a" follow "c"; the word of
        // " " has not started, so it forks: " " " " "c" " a" (the best token after " " that may start a word, then
        // the next, " ") is the same chip "c", its probability added. The word typed before, "c" (all the words
        // typed), adds TYPED_SHARE to it (step 11), more than the model's part: the chip inserts it as typed, its
        // ending the " " after it
        assertEquals(List.of("a|a|(", "bb|bb|(", "c|c| "), labels(words));
        double z = Math.exp(2) + Math.exp(1) + Math.exp(0) + 6 * Math.exp(-20), keep = 1 - WordSuggester.TYPED_SHARE;
        // at a word start the model's words are divided by the probability of the tokens that fit the taken-back " "
        // (" ", " a" and " b"; step 11)
        double given = (Math.exp(2) + Math.exp(1) + Math.exp(0)) / z;
        assertEquals(given, WordSuggester.prefixProbability(Sampling.softmax(new FakeModel().forward(new int[] {5}, 0)),
                new String[] {"", "", " ", "a", "b", "c", " a", " b", "("}, " "), 1e-15);
        assertEquals(keep * Math.exp(2) / z / given, words.get(0).probability, 1e-12); // the ending "(" does not count
        assertEquals(keep * Math.exp(1) / z * pNext() / given, words.get(1).probability, 1e-12); // " b", "b"
        double pSpace = Math.exp(-20) / (Math.exp(5) + 8 * Math.exp(-20)); // " " after " "
        double fromModel = Math.exp(0) / z * pNext() * (1 + pSpace) / given; // " ", ("  "), "c"
        assertTrue(keep * fromModel < WordSuggester.TYPED_SHARE);
        assertEquals(keep * fromModel + WordSuggester.TYPED_SHARE, words.get(2).probability, 1e-15);
        assertEquals("0:2", model.calls.get(0)); // the context <|eos|> "c" at position 0 (step 1)
        assertTrue(model.calls.subList(1, model.calls.size()).stream().allMatch(c -> c.matches("[234]:1")));
    }

    @Test
    public void reusesTheCacheAndTheChainsWhileTheContextIsUnchanged() {
        FakeModel model = new FakeModel();
        WordSuggester s = new WordSuggester(model, TestTokenizer.load());
        // <|eos|>, "c", " a", " ", "c", " b": " b" is taken back (context: the first 5 tokens); its chain, which has
        // not started a word after the typed "b", forks ("b" "(" and "a" "a"...), and " " spells "b" first
        assertEquals(List.of("bb|b|("), labels(s.suggest("c a c b", 3))); // mid-word: the completed word
        assertEquals("0:5", model.calls.get(0));
        model.calls.clear();
        assertEquals(List.of("bb|b|("), labels(s.suggest("c a c b", 3)));
        assertEquals(List.of(), model.calls); // the same context and chains (forks included): nothing runs
    }

    @Test
    public void dropsAWordThatDoesNotEndWithinTheExtension() {
        List<Integer> starts = new ArrayList<>();
        WordSuggester.StepModel onlyA = new WordSuggester.StepModel() { // "a" after everything: words never end
            @Override
            public float[] forward(int[] tokens, int start) {
                starts.add(start);
                float[] logits = new float[9];
                java.util.Arrays.fill(logits, -20f);
                logits[3] = 5f;
                return logits;
            }

            @Override
            public int maxSeqLen() {
                return 64;
            }
        };
        // candidates " ", " a", " b" (ties: lower id first), each extended by MAX_EXTRA_TOKENS "a" and still open;
        // " " forks at its first step (" " "a" and " " " "), and its fork runs right after it, from position 3
        // (position 0: <|eos|>, step 1)
        // no word of the model's: the one chip is the word typed before (step 11)
        assertEquals(List.of("c|c| "), labels(new WordSuggester(onlyA, TestTokenizer.load()).suggest("c ", 3)));
        assertEquals(List.of(0, 2, 3, 4, 5, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5), starts);
    }

    @Test
    public void contextWindowDropsWholeBlocks() {
        // at most 64 - MAX_SPELLING_TOKENS - MAX_EXTRA_TOKENS + 1 = 58 ids (the longest chain fits), blocks of 16
        int[] ids = new int[75];
        for (int i = 0; i < ids.length; i++) ids[i] = i;
        assertEquals(58, WordSuggester.contextWindow(java.util.Arrays.copyOf(ids, 58), 64).length);
        assertArrayEquals(java.util.Arrays.copyOfRange(ids, 16, 59),
                WordSuggester.contextWindow(java.util.Arrays.copyOf(ids, 59), 64));
        assertEquals(32, WordSuggester.contextWindow(ids, 64)[0]);
    }

    @Test
    public void wordCharactersAreLettersNumbersAndUnderscore() {
        assertEquals("foo_1", WordSuggester.trailingWord("x = foo_1"));
        assertEquals("", WordSuggester.trailingWord("x = "));
        assertEquals("é²", WordSuggester.trailingWord("(é²"));
        assertTrue(!WordSuggester.isWordChar('-'));
    }

    /** Probability of the preferred token when its logit is 5 and the other 8 are -20. */
    static double pNext() {
        return Math.exp(5) / (Math.exp(5) + 8 * Math.exp(-20));
    }
}
