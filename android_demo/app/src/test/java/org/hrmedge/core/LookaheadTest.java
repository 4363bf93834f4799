package org.hrmedge.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;

import java.util.List;
import org.junit.Test;

public class LookaheadTest {
    static List<String> labels(List<WordSuggester.Suggestion> words) {
        return WordSuggesterTest.labels(words);
    }

    @Test
    public void aGuessedKeyShowsTheChipsComputedAheadWithNoModelCall() {
        WordSuggesterTest.FakeModel model = new WordSuggesterTest.FakeModel();
        Lookahead look = new Lookahead(model, null, TestTokenizer.load());
        int key = look.keyTyped();
        Lookahead.Result typed = look.suggest("c", 3);
        assertFalse(typed.ahead);
        assertEquals(1, look.ahead("c", List.of(" "), 3, key));
        model.calls.clear();
        look.keyTyped();
        Lookahead.Result guessed = look.suggest("c ", 3);
        assertTrue(guessed.ahead);
        assertEquals(List.of(), model.calls);
        List<String> want = labels(new WordSuggester(new WordSuggesterTest.FakeModel(), TestTokenizer.load())
                .suggest("c ", 3));
        assertEquals(List.of("a|a|(", "bb|bb|(", "c|c| "), want);
        assertEquals(want, labels(guessed.words));
        assertEquals(List.of("a"), guessed.nextKeys); // the first chip's first character
    }

    /** The fake model; a key comes while its `at`-th call (since `calls` was last set to 0) is in flight. */
    static final class KeyAtCall implements WordSuggester.StepModel {
        final WordSuggesterTest.FakeModel model = new WordSuggesterTest.FakeModel();
        Lookahead look;
        int at = -1, calls;

        @Override
        public float[] forward(int[] tokens, int start) {
            if (++calls == at) look.keyTyped();
            return model.forward(tokens, start);
        }

        @Override
        public int maxSeqLen() {
            return model.maxSeqLen();
        }
    }

    @Test
    public void aKeyStopsTheWorkAheadBeforeItsNextCall() {
        KeyAtCall model = new KeyAtCall();
        Lookahead look = new Lookahead(model, null, TestTokenizer.load());
        model.look = look;
        int key = look.keyTyped();
        look.suggest("c", 3);
        model.calls = 0;
        model.at = 2;
        assertEquals(0, look.ahead("c", List.of(" ", "a"), 3, key)); // none computed to its end
        assertEquals(2, model.calls); // the call in flight finished; none after it
        model.at = -1;
        look.keyTyped();
        Lookahead.Result later = look.suggest("c ", 3); // not computed ahead: the chains left cut short run again
        assertFalse(later.ahead);
        assertEquals(List.of("a|a|(", "bb|bb|(", "c|c| "), labels(later.words));
        model.calls = 0;
        assertEquals(0, look.ahead("c ", List.of("a"), 3, key)); // a key came since `key`: nothing runs
        assertEquals(0, model.calls);
    }

    @Test
    public void aFailedCallEndsTheWorkAheadQuietlyAndTheKeyComputesItsChips() {
        WordSuggesterTest.FakeModel model = new WordSuggesterTest.FakeModel();
        boolean[] failing = {false};
        Lookahead look = new Lookahead(new WordSuggester.StepModel() {
            @Override
            public float[] forward(int[] tokens, int start) {
                if (failing[0]) throw new IllegalStateException("the program failed");
                return model.forward(tokens, start);
            }

            @Override
            public int maxSeqLen() {
                return model.maxSeqLen();
            }
        }, null, TestTokenizer.load());
        int key = look.keyTyped();
        look.suggest("c", 3);
        failing[0] = true;
        assertEquals(0, look.ahead("c", List.of(" "), 3, key)); // no exception reaches the worker
        failing[0] = false;
        look.keyTyped();
        Lookahead.Result r = look.suggest("c ", 3);
        assertFalse(r.ahead);
        assertEquals(List.of("a|a|(", "bb|bb|(", "c|c| "), labels(r.words));
    }

    @Test
    public void afterForgetCacheTheWholeContextRunsAgain() {
        WordSuggesterTest.FakeModel model = new WordSuggesterTest.FakeModel();
        Lookahead look = new Lookahead(model, null, TestTokenizer.load());
        int key = look.keyTyped();
        List<String> want = labels(look.suggest("c a c", 3).words);
        look.ahead("c a c", List.of(" "), 3, key);
        look.forgetCache(); // (the app's self-test ran the same program from position 0)
        model.calls.clear();
        look.keyTyped();
        Lookahead.Result again = look.suggest("c a c", 3);
        assertFalse(again.ahead);
        assertEquals(want, labels(again.words));
        assertEquals("0:4", model.calls.get(0)); // <|eos|>, "c", " a", " " from position 0, not the cache
    }

    @Test
    public void likelyKeysAreTheChipsFirstCharactersThenTheLikeliestTokensFirstOnes() {
        WordSuggester suggester = new WordSuggester(new WordSuggesterTest.FakeModel(), TestTokenizer.load());
        List<WordSuggester.Suggestion> words = suggester.suggest("c ", 3);
        assertEquals(List.of("a", "b"), suggester.likelyKeys("c ", words, 2));
        // with no chips: the first characters of the tokens that go on from the taken-back " ", by summed probability
        // (" a" 2, " b" 1)
        assertEquals(List.of("a", "b"), suggester.likelyKeys("c ", List.of(), 3));
        // "c" is taken back after <|eos|> (step 1): the chains spell it again; no token goes on from "c"
        words = suggester.suggest("c", 3);
        assertEquals(List.of("cb|b|("), labels(words));
        assertEquals(List.of("b"), suggester.likelyKeys("c", words, 3));
        // an empty text: the context is <|eos|> and nothing is taken back, so every token's first character counts:
        // the chips' first ("c" and "b" at -20 after <|eos|>, each ending as the fake model goes on), then "(" 5
        words = suggester.suggest("", 3);
        assertEquals(List.of("c|c| a", "b|b|("), labels(words));
        assertEquals(List.of("c", "b", "("), suggester.likelyKeys("", words, 3));
        // no chips: "(" 5, then " " (thrice at -20: " ", " a", " b"), then "a" (ties in token order)
        assertEquals(List.of("(", " ", "a"), suggester.likelyKeys("", List.of(), 3));
    }
}
