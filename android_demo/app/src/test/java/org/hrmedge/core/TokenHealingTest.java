package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;

import java.util.Random;
import org.junit.Test;

public class TokenHealingTest {
    private static final ByteLevelBpe TOK = TestTokenizer.load();
    private static final byte[][] BYTES = TokenHealing.vocabBytes(TOK);

    @Test
    public void aTrailingSpaceAllowsTheTokensThatStartWithASpace() {
        int[] ids = TOK.encode("a "); // a, " "
        assertArrayEquals(new int[] {3, 2}, ids);
        TokenHealing h = TokenHealing.heal(ids, BYTES);
        assertArrayEquals(new int[] {3}, h.context);
        assertArrayEquals(new byte[] {' '}, h.prefix);
        boolean[] want = new boolean[9];
        want[2] = want[6] = want[7] = true; // " ", " a", " b"; not the specials, not "a"
        assertArrayEquals(want, h.allowed);
    }

    @Test
    public void oneTokenOrASpecialLastTokenIsNotHealed() {
        assertNull(TokenHealing.heal(new int[] {3}, BYTES).allowed);
        TokenHealing h = TokenHealing.heal(new int[] {3, 1}, BYTES);
        assertNull(h.allowed);
        assertArrayEquals(new int[] {3, 1}, h.context);
    }

    @Test
    public void theMaskedFirstTokenIsTheBestAllowedOneAndItsTextIsStripped() {
        TokenHealing h = TokenHealing.heal(new int[] {3, 2}, BYTES);
        float[] logits = {0f, 9f, 1f, 8f, 0f, 0f, 2f, 3f, 7f}; // EOS and "a" and "(" lead, but are not allowed
        int first = Sampling.sample(h.mask(Sampling.penalizeRepetition(logits, h.context, 1.0)), 0, 0, new Random(0));
        assertEquals(7, first); // " b"
        assertEquals("bab", h.textAfter(new int[] {7, 3, 4}, BYTES));
        assertEquals(" bab", TokenHealing.heal(new int[] {3}, BYTES).textAfter(new int[] {7, 3, 4}, BYTES));
    }

    @Test
    public void tokenBytesSpellTheDecodedText() {
        assertArrayEquals(new byte[] {' ', 'a'}, TOK.tokenBytes(6));
        assertEquals(0, TOK.tokenBytes(1).length);
        assertEquals(0, TOK.tokenBytes(99).length);
    }
}
