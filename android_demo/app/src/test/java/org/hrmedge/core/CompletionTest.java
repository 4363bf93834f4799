package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;

import java.util.ArrayList;
import java.util.List;
import org.junit.Test;

public class CompletionTest {
    /** Logits from a function of the call number; records each call as "start:length". */
    static final class ScriptedModel implements WordSuggester.StepModel {
        interface Script {
            void fill(int call, float[] logits);
        }

        final List<String> calls = new ArrayList<>();
        final int vocab, maxSeqLen;
        final Script script;

        ScriptedModel(int vocab, int maxSeqLen, Script script) {
            this.vocab = vocab;
            this.maxSeqLen = maxSeqLen;
            this.script = script;
        }

        @Override
        public float[] forward(int[] tokens, int start) {
            float[] logits = new float[vocab];
            java.util.Arrays.fill(logits, -20f);
            script.fill(calls.size(), logits);
            calls.add(start + ":" + tokens.length);
            return logits;
        }

        @Override
        public int maxSeqLen() {
            return maxSeqLen;
        }
    }

    static final byte[][] BYTES = TokenHealing.vocabBytes(TestTokenizer.load()); // 0 bos, 1 eos; " " a b c " a" " b" (

    static Completion.Settings greedy(double penalty, int maxNewTokens) {
        Completion.Settings s = new Completion.Settings();
        s.repetitionPenalty = penalty;
        s.maxNewTokens = maxNewTokens;
        return s;
    }

    @Test
    public void healsThePromptsLastTokenAndPenalisesRepeats() {
        // " a" 2.1, "a" 2 and "b" 1.9 at every step. Healed, the first token must start with " " (the prompt's last
        // token, taken back): " a". With the penalty 1.2 a seen token's logit is divided by it: " a" 1.75 < "a" 2,
        // then "a" 1.67 < "b" 1.9, then " a" 1.75 is the best of the three seen ones; without it " a" every time
        ScriptedModel.Script script = (call, z) -> { z[6] = 2.1f; z[3] = 2f; z[4] = 1.9f; };
        ScriptedModel model = new ScriptedModel(9, 64, script);
        Completion.Result r = new Completion(model, BYTES, 1).run(new int[] {5, 2}, greedy(1.2, 5), null, null);
        assertArrayEquals(new int[] {6, 3, 4, 6, 6}, r.tokens);
        assertEquals("aab a a", r.text); // after the healed " "
        assertEquals(List.of("0:1", "1:1", "2:1", "3:1", "4:1"), model.calls); // the context "c", then a step a token
        assertEquals("max length", r.stoppedAt);
        Completion.Result plain = new Completion(new ScriptedModel(9, 64, script), BYTES, 1)
                .run(new int[] {5, 2}, greedy(1.0, 5), null, null);
        assertArrayEquals(new int[] {6, 6, 6, 6, 6}, plain.tokens);
        // the prompt's tokens count as seen: after "b" (one token, nothing healed), "b" 2/1.2 < "a" 1.9
        Completion.Result afterB = new Completion(new ScriptedModel(9, 64, (call, z) -> { z[4] = 2f; z[3] = 1.9f; }),
                BYTES, 1).run(new int[] {4}, greedy(1.2, 1), null, null);
        assertArrayEquals(new int[] {3}, afterB.tokens);
    }

    @Test
    public void stopsAtEndOfText() {
        ScriptedModel model = new ScriptedModel(9, 64, (call, z) -> z[call < 2 ? 5 : 1] = 5f); // "c" "c" EOS
        Completion.Result r = new Completion(model, BYTES, 1).run(new int[] {5}, greedy(1.0, 10), null, null);
        assertArrayEquals(new int[] {5, 5, 1}, r.tokens);
        assertEquals("EOS", r.stoppedAt);
        assertEquals("cc", r.text);
        assertEquals(3, model.calls.size()); // no step after EOS
    }

    @Test
    public void holdsBackACharacterWhoseBytesAreStillToCome() {
        byte[][] bytes = {{}, {}, {(byte) 0xC3}, {(byte) 0xA9}, {'x'}}; // "é" is two tokens
        ScriptedModel model = new ScriptedModel(5, 64, (call, z) -> z[new int[] {2, 3, 4}[Math.min(call, 2)]] = 5f);
        List<String> shown = new ArrayList<>();
        Completion.Result r = new Completion(model, bytes, 1).run(new int[] {4}, greedy(1.0, 3), shown::add, null);
        assertEquals(List.of("\u00e9", "\u00e9x"), shown); // never a U+FFFD
        assertEquals("\u00e9x", r.text);
    }

    @Test
    public void cutsALongPromptToTheContextAndStopsAtItsEndOrWhenAsked() {
        ScriptedModel model = new ScriptedModel(9, 8, (call, z) -> z[3] = 5f);
        // 10 tokens: as complete --truncate, the last 8 - min(64, 8 / 2) = 4 kept (it kept 7, which left room for 2
        // new tokens of the 64 asked for), then "a" taken back (healing)
        int[] prompt = {5, 3, 3, 3, 3, 3, 3, 3, 3, 3};
        Completion.Result r = new Completion(model, BYTES, 1).run(prompt, greedy(1.0, 64), null, null);
        assertTrue(r.truncated);
        assertEquals(3, r.promptTokens);
        assertArrayEquals(new int[] {3, 3, 3, 3, 3}, r.tokens); // the 8 positions full
        assertEquals(List.of("0:3", "3:1", "4:1", "5:1", "6:1"), model.calls);
        Completion.Result two = new Completion(new ScriptedModel(9, 8, (call, z) -> z[3] = 5f), BYTES, 1)
                .run(prompt, greedy(1.0, 2), null, null); // 2 asked for: 6 kept, 5 after healing
        assertEquals(5, two.promptTokens);
        assertArrayEquals(new int[] {3, 3}, two.tokens);
        assertTrue(r.summary().contains("(stopped at max length; prompt cut to the context)"));
        int[] asked = {0};
        Completion.Result stopped = new Completion(new ScriptedModel(9, 64, (call, z) -> z[3] = 5f), BYTES, 1)
                .run(new int[] {5}, greedy(1.0, 64), null, () -> ++asked[0] > 1);
        assertArrayEquals(new int[] {3, 3}, stopped.tokens);
        assertEquals("stop", stopped.stoppedAt);
        assertFalse(stopped.truncated);
    }

    @Test
    public void refusesATemperatureOutsideItsRange() {
        // as complete: 0 (greedy) or [1e-4, 1e4]; an app's field parsed 40 digits as Infinity, and every step drew
        // the last id, the healing mask ignored
        for (double t : new double[] {Double.POSITIVE_INFINITY, Double.NaN, 1e-5, -1, 2e4}) {
            Completion.Settings s = greedy(1.0, 2);
            s.temperature = t;
            try {
                new Completion(new ScriptedModel(9, 64, (call, z) -> z[3] = 5f), BYTES, 1).run(new int[] {5}, s, null,
                        null);
                org.junit.Assert.fail("temperature " + t + " was taken");
            } catch (IllegalArgumentException e) {
                assertTrue(e.getMessage(), e.getMessage().startsWith("temperature must be 0 (greedy) or in"));
            }
        }
        for (double t : new double[] {0, 1e-4, 1e4}) {
            Completion.Settings s = greedy(1.0, 2);
            s.temperature = t;
            assertEquals(2, new Completion(new ScriptedModel(9, 64, (call, z) -> z[3] = 5f), BYTES, 1)
                    .run(new int[] {5}, s, null, null).tokens.length);
        }
    }
}
