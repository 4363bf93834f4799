package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;

import java.nio.charset.StandardCharsets;
import org.junit.Test;

public class ByteLevelBpeTest {
    @Test
    public void mergesBySpaceWordSplitsAndRanks() {
        ByteLevelBpe tok = TestTokenizer.load();
        // "c a(b" splits into "c", " a", "(", "b"; " a" is merged by its rule
        assertArrayEquals(new int[] {5, 6, 8, 4}, tok.encode("c a(b"));
        assertArrayEquals(new int[] {2, 7}, tok.encode("  b")); // "\s+(?!\S)" keeps one space for the word
        assertEquals("c a(b", tok.decode(tok.encode("c a(b")));
    }

    @Test
    public void theWordCacheStaysBounded() {
        ByteLevelBpe tok = TestTokenizer.load();
        StringBuilder text = new StringBuilder();
        for (int i = 0; i < ByteLevelBpe.CACHE_WORDS + 500; i++) { // distinct words: " a", " b", " ba", ...
            text.append(' ').append(Integer.toBinaryString(i).replace('0', 'a').replace('1', 'b'));
        }
        int[] first = tok.encode(text.toString());
        assertEquals(ByteLevelBpe.CACHE_WORDS, tok.cachedWords());
        assertArrayEquals(first, tok.encode(text.toString())); // words past the bound are encoded, not cached
        ByteLevelBpe fresh = TestTokenizer.load();
        fresh.encode("a".repeat(ByteLevelBpe.CACHE_LENGTH + 1));
        assertEquals(0, fresh.cachedWords());
    }

    @Test
    public void specialTokensAreMatchedInTextAndSkippedInDecoding() {
        ByteLevelBpe tok = TestTokenizer.load();
        assertArrayEquals(new int[] {3, 1, 4}, tok.encode("a<|eos|>b"));
        assertEquals("ab", tok.decode(new int[] {3, 1, 4}));
        assertEquals(Integer.valueOf(1), tok.specialId("<|eos|>"));
    }

    @Test
    public void incompleteUtf8DecodesToTheReplacementCharacter() {
        // byte 0xC3 alone (the first half of "é") maps to the character U+00C3 in the byte-level alphabet
        String json = TestTokenizer.JSON.replace("\"(\":8", "\"(\":8,\"\\u00c3\":9");
        ByteLevelBpe tok = new ByteLevelBpe(json);
        assertEquals("a\ufffd", tok.decode(new int[] {3, 9}));
        assertEquals(new String(new byte[] {'a'}, StandardCharsets.UTF_8), tok.decode(new int[] {3}));
    }
}
