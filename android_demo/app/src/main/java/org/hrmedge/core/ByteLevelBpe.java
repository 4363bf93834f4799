package org.hrmedge.core;

import java.io.ByteArrayOutputStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.PriorityQueue;
import java.util.concurrent.ConcurrentHashMap;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The project's tokenizer.json (HF tokenizers: byte-level BPE, ByteLevel pre-tokenizer without prefix
 * space, special tokens <|bos|> and <|eos|>) in plain Java, for the app's suggestions, which need token ids
 * and logits (ExecuTorch's LlmModule tokenizes internally but gives text only). Encodes like Python's
 * {@code tok.encode(text, add_special_tokens=False).ids} and decodes like {@code tok.decode(ids)} (special
 * tokens skipped); tests/test_android_core.py checks both against Python on real text.
 */
public final class ByteLevelBpe {
    // The GPT-2 split the ByteLevel pre-tokenizer applies (use_regex: true), with Unicode \s like Oniguruma's.
    private static final Pattern SPLIT = unicodePattern(
            "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
    private static final char[] BYTE_TO_CHAR = new char[256];
    private static final Map<Character, Integer> CHAR_TO_BYTE = new HashMap<>();

    static {
        // GPT-2's reversible byte -> printable character map: printable Latin-1 bytes map to themselves, the
        // others to 256, 257, ... in byte order.
        int next = 256;
        for (int b = 0; b < 256; b++) {
            boolean printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            BYTE_TO_CHAR[b] = (char) (printable ? b : next++);
            CHAR_TO_BYTE.put(BYTE_TO_CHAR[b], b);
        }
    }

    /** \\s, \\p{L}... with Unicode meaning: the JDK needs the flag; Android's regex always has it and may reject it. */
    static Pattern unicodePattern(String regex) {
        try {
            return Pattern.compile(regex, Pattern.UNICODE_CHARACTER_CLASS);
        } catch (IllegalArgumentException e) {
            return Pattern.compile(regex);
        }
    }

    private final Map<String, Integer> vocab = new HashMap<>();
    private final String[] idToToken;
    private final Map<String, Integer> mergeRank = new HashMap<>();
    private final Map<String, Integer> special = new HashMap<>(); // content -> id
    // word -> ids, bounded as HF tokenizers' BPE cache is: at most CACHE_WORDS words, none longer than CACHE_LENGTH
    // (a keyboard encodes every partial word of a long session); concurrent: the app encodes on its UI thread (a
    // completion's prompt) while its worker encodes the typed text
    static final int CACHE_WORDS = 10_000, CACHE_LENGTH = 256;
    private final Map<String, int[]> cache = new ConcurrentHashMap<>();

    public ByteLevelBpe(String tokenizerJson) {
        Map<String, Object> root = Json.object(Json.parse(tokenizerJson));
        Map<String, Object> model = Json.object(root.get("model"));
        if (!"BPE".equals(model.get("type"))) throw new IllegalArgumentException("not a BPE tokenizer");
        int size = 0;
        for (Map.Entry<String, Object> e : Json.object(model.get("vocab")).entrySet()) {
            int id = (int) Json.number(e.getValue());
            vocab.put(e.getKey(), id);
            size = Math.max(size, id + 1);
        }
        List<Object> merges = Json.array(model.get("merges"));
        for (int rank = 0; rank < merges.size(); rank++) {
            Object m = merges.get(rank); // "a b" (older files) or ["a", "b"]
            String key = m instanceof String ? (String) m : Json.array(m).get(0) + " " + Json.array(m).get(1);
            mergeRank.putIfAbsent(key, rank);
        }
        for (Object t : Json.array(root.get("added_tokens"))) {
            Map<String, Object> tok = Json.object(t);
            int id = (int) Json.number(tok.get("id"));
            special.put((String) tok.get("content"), id);
            size = Math.max(size, id + 1);
        }
        idToToken = new String[size];
        for (Map.Entry<String, Integer> e : vocab.entrySet()) idToToken[e.getValue()] = e.getKey();
        for (Map.Entry<String, Integer> e : special.entrySet()) idToToken[e.getValue()] = e.getKey();
    }

    int cachedWords() {
        return cache.size();
    }

    public int vocabSize() {
        return idToToken.length;
    }

    public Integer specialId(String content) {
        return special.get(content);
    }

    public int[] encode(String text) {
        List<Integer> ids = new ArrayList<>();
        int start = 0;
        while (start < text.length()) { // special tokens in the text are matched literally, like tokenizers does
            int at = text.length();
            String found = null;
            for (String s : special.keySet()) {
                int k = text.indexOf(s, start);
                if (k >= 0 && (k < at || (k == at && found != null && s.length() > found.length()))) { at = k; found = s; }
            }
            encodeOrdinary(text.substring(start, at), ids);
            if (found == null) break;
            ids.add(special.get(found));
            start = at + found.length();
        }
        return ids.stream().mapToInt(Integer::intValue).toArray();
    }

    private void encodeOrdinary(String text, List<Integer> out) {
        Matcher m = SPLIT.matcher(text);
        while (m.find()) {
            byte[] bytes = m.group().getBytes(StandardCharsets.UTF_8);
            StringBuilder word = new StringBuilder();
            for (byte b : bytes) word.append(BYTE_TO_CHAR[b & 0xFF]);
            int[] ids = cache.get(word.toString());
            if (ids == null) {
                ids = bpe(word.toString());
                if (cache.size() < CACHE_WORDS && word.length() <= CACHE_LENGTH) cache.put(word.toString(), ids);
            }
            for (int id : ids) out.add(id);
        }
    }

    /**
     * Merge the pair with the lowest rank (the leftmost of equal ones) until none is left: the BPE model with its
     * merges list. The pairs wait in a heap, so a word of n bytes takes O(n log n) steps, not the O(n^2) of
     * rescanning it after every merge (a pasted key or hash of letters is one word of thousands of bytes).
     */
    private int[] bpe(String word) {
        int n = word.length();
        String[] part = new String[n]; // part[i]: the symbol starting at byte i (null once merged into the left one)
        int[] next = new int[n], prev = new int[n];
        for (int i = 0; i < n; i++) {
            part[i] = String.valueOf(word.charAt(i));
            next[i] = i + 1 < n ? i + 1 : -1;
            prev[i] = i - 1;
        }
        PriorityQueue<int[]> pairs = new PriorityQueue<>( // {rank, left symbol's start}
                (a, b) -> a[0] != b[0] ? Integer.compare(a[0], b[0]) : Integer.compare(a[1], b[1]));
        for (int i = 0; i + 1 < n; i++) offer(pairs, part, next, i);
        while (!pairs.isEmpty()) {
            int[] top = pairs.poll();
            int left = top[1], right = next[left];
            // a pair whose symbols changed since it was queued is stale: its rank names the pair it was
            if (part[left] == null || right < 0 || !Integer.valueOf(top[0]).equals(rank(part, left, right))) continue;
            part[left] = part[left] + part[right];
            part[right] = null;
            next[left] = next[right];
            if (next[left] >= 0) prev[next[left]] = left;
            if (prev[left] >= 0) offer(pairs, part, next, prev[left]);
            offer(pairs, part, next, left);
        }
        List<String> parts = new ArrayList<>();
        for (int i = 0; i >= 0 && i < n; i = next[i]) parts.add(part[i]);
        int[] ids = new int[parts.size()];
        for (int i = 0; i < ids.length; i++) {
            Integer id = vocab.get(parts.get(i));
            if (id == null) throw new IllegalStateException("token not in vocabulary: " + parts.get(i));
            ids[i] = id;
        }
        return ids;
    }

    private Integer rank(String[] part, int left, int right) {
        return mergeRank.get(part[left] + " " + part[right]);
    }

    private void offer(PriorityQueue<int[]> pairs, String[] part, int[] next, int left) {
        Integer rank = next[left] < 0 ? null : rank(part, left, next[left]);
        if (rank != null) pairs.add(new int[] {rank, left});
    }

    /** The bytes token id spells (none for a special token or an unknown id): what token healing compares. */
    public byte[] tokenBytes(int id) {
        String token = id >= 0 && id < idToToken.length ? idToToken[id] : null;
        if (token == null || special.containsKey(token)) return new byte[0];
        byte[] out = new byte[token.length()];
        for (int i = 0; i < out.length; i++) out[i] = (byte) (int) CHAR_TO_BYTE.get(token.charAt(i));
        return out;
    }

    /** Text of ids, special tokens skipped; an incomplete UTF-8 sequence becomes U+FFFD, as in Python. */
    public String decode(int[] ids) {
        ByteArrayOutputStream bytes = new ByteArrayOutputStream();
        for (int id : ids) {
            String token = id >= 0 && id < idToToken.length ? idToToken[id] : null;
            if (token == null || special.containsKey(token)) continue;
            for (int i = 0; i < token.length(); i++) {
                Integer b = CHAR_TO_BYTE.get(token.charAt(i));
                if (b != null) bytes.write(b);
            }
        }
        byte[] all = bytes.toByteArray();
        return decodeUtf8(all, 0, all.length);
    }

    /**
     * UTF-8 with each maximal invalid subpart replaced by one U+FFFD, as Python's {@code errors="replace"}, Rust's
     * {@code from_utf8_lossy} (HF tokenizers) and the page's TextDecoder do. The JDK's decoder differs on some
     * invalid input (an encoded surrogate, ED A0 80, is one U+FFFD there and three in Python), and the chips'
     * character counts must be the same in every client.
     */
    public static String decodeUtf8(byte[] data, int offset, int length) {
        StringBuilder out = new StringBuilder(length);
        int needed = 0, seen = 0, codePoint = 0, lower = 0x80, upper = 0xBF;
        for (int i = offset; i < offset + length; i++) {
            int b = data[i] & 0xFF;
            if (needed == 0) {
                if (b < 0x80) out.append((char) b);
                else if (b >= 0xC2 && b <= 0xDF) { needed = 1; codePoint = b & 0x1F; }
                else if (b >= 0xE0 && b <= 0xEF) {
                    needed = 2; codePoint = b & 0x0F;
                    if (b == 0xE0) lower = 0xA0; // no overlong form
                    if (b == 0xED) upper = 0x9F; // no surrogate
                } else if (b >= 0xF0 && b <= 0xF4) {
                    needed = 3; codePoint = b & 0x07;
                    if (b == 0xF0) lower = 0x90;
                    if (b == 0xF4) upper = 0x8F; // nothing above U+10FFFF
                } else out.append('\ufffd');
                continue;
            }
            if (b < lower || b > upper) { // the character so far ends here; b is read again as a first byte
                out.append('\ufffd');
                needed = seen = 0; lower = 0x80; upper = 0xBF;
                i--;
                continue;
            }
            lower = 0x80; upper = 0xBF;
            codePoint = (codePoint << 6) | (b & 0x3F);
            if (++seen == needed) {
                out.appendCodePoint(codePoint);
                needed = seen = 0;
            }
        }
        if (needed != 0) out.append('\ufffd');
        return out.toString();
    }
}
