package org.hrmedge.core;

import java.util.Arrays;

/**
 * Token healing with hrm_edge/runtime/healing.py's semantics (tests/test_android_core.py compares the two on the
 * shipped tokenizer): the prompt's last token is taken back, and the first new token must be one whose bytes
 * start with its bytes (a prompt ending in "\n" may go on with "\n    ", which the tokenizer merges after a
 * colon). Bytes, not text: a byte-level token can be part of a UTF-8 character.
 */
public final class TokenHealing {
    /** The prompt to prefill: less its last token when healed. */
    public final int[] context;
    /** The removed token's bytes; empty when nothing was healed. */
    public final byte[] prefix;
    /** [V]: the tokens the first new token may be; null when nothing was healed. */
    public final boolean[] allowed;

    private TokenHealing(int[] context, byte[] prefix, boolean[] allowed) {
        this.context = context;
        this.prefix = prefix;
        this.allowed = allowed;
    }

    /** The bytes of every token id of tok. */
    public static byte[][] vocabBytes(ByteLevelBpe tok) {
        byte[][] out = new byte[tok.vocabSize()][];
        for (int i = 0; i < out.length; i++) out[i] = tok.tokenBytes(i);
        return out;
    }

    /** Heals ids unless they are fewer than 2 or end in a special token (then context is ids, allowed null). */
    public static TokenHealing heal(int[] ids, byte[][] vocabBytes) {
        if (ids.length < 2 || vocabBytes[ids[ids.length - 1]].length == 0) {
            return new TokenHealing(ids.clone(), new byte[0], null);
        }
        byte[] prefix = vocabBytes[ids[ids.length - 1]];
        boolean[] allowed = new boolean[vocabBytes.length];
        for (int i = 0; i < allowed.length; i++) allowed[i] = startsWith(vocabBytes[i], prefix);
        return new TokenHealing(Arrays.copyOf(ids, ids.length - 1), prefix, allowed);
    }

    static boolean startsWith(byte[] bytes, byte[] prefix) {
        if (bytes.length < prefix.length) return false;
        for (int i = 0; i < prefix.length; i++) if (bytes[i] != prefix[i]) return false;
        return true;
    }

    /** The first new token's logits: those of tokens not allowed become -infinity (in place; z when not healed). */
    public double[] mask(double[] z) {
        if (allowed != null) for (int i = 0; i < z.length; i++) if (!allowed[i]) z[i] = Double.NEGATIVE_INFINITY;
        return z;
    }

    /** The text of the new tokens after the removed bytes (the healed first token re-spells them); an incomplete
     *  character becomes U+FFFD, as in Python. */
    public String textAfter(int[] newIds, byte[][] vocabBytes) {
        int n = 0;
        for (int id : newIds) n += vocabBytes[id].length;
        byte[] all = new byte[n];
        int at = 0;
        for (int id : newIds) {
            System.arraycopy(vocabBytes[id], 0, all, at, vocabBytes[id].length);
            at += vocabBytes[id].length;
        }
        int skip = Math.min(prefix.length, n);
        return ByteLevelBpe.decodeUtf8(all, skip, n - skip);
    }
}
