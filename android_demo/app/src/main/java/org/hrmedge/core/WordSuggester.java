package org.hrmedge.core;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The most likely whole next words, by the algorithm of docs/keyboard.md, as the browser demo
 * (hrm_edge/app/web/js/suggest.mjs) and Python (hrm_edge/runtime/suggest.py) compute them; tests/test_keyboard.py
 * checks the three give identical words. The last token, and earlier ones until HEAL_CHARS characters of the
 * word being typed, are taken back (token healing); the {@link #CANDIDATES} most likely first tokens that fit
 * their text are each extended greedily (spelling the rest of it first, and forking once where the word has not
 * started yet) until the word they spell has ended (a non-word character follows it); a word still open after
 * {@link #MAX_EXTRA_TOKENS} is dropped. The page extends
 * all chains as one batch per step; this StepModel runs one sequence at a time
 * (chain after chain, each overwriting the cache rows after the context), which gives the same words. The chains
 * after their first token run on the draft model where there is one (the first outer cycle, which reads and writes
 * the first L + 1 slots of the same cache: a program's second method sharing its buffers).
 */
public final class WordSuggester {
    /** A KV-cache program: forward(tokens at positions start..) -> logits of the last token [vocab]; the
     *  rows of positions below start are those of the previous calls. */
    public interface StepModel {
        float[] forward(int[] tokens, int start);

        int maxSeqLen();
    }

    public static final class Suggestion {
        /** label: the chip (the whole word); insert: what a tap inserts; ending: what followed the word in its
         *  extension (the evidence that it ended). */
        public final String label, insert, ending;
        public double probability;

        Suggestion(String label, String insert, double probability, String ending) {
            this.label = label;
            this.insert = insert;
            this.probability = probability;
            this.ending = ending;
        }

        @Override
        public String toString() {
            return label + " (" + probability + ")";
        }
    }

    /** A first token and its greedy continuation, with each token's probability under its step's softmax. */
    private static final class Chain {
        final List<Integer> tokens = new ArrayList<>();
        final List<Double> probs = new ArrayList<>();
        /** Left open once the shown words no longer depended on it: computed again if asked for. */
        boolean cutShort;
        /** Its copies that took the 2nd.. best token where its word had not started (docs/keyboard.md step 6). */
        final List<Chain> forks = new ArrayList<>();
        /** It has chosen a token where its word had not started (a chain forks once, a fork never). */
        boolean forked;

        List<Chain> family() {
            List<Chain> out = new ArrayList<>();
            out.add(this);
            out.addAll(forks);
            return out;
        }
    }

    /** What a chain says: open (null), dead (DEAD) or a word. */
    private static final class Decision {
        final String insert, word, ending;
        final double probability;

        Decision(String insert, String word, String ending, double probability) {
            this.insert = insert;
            this.word = word;
            this.ending = ending;
            this.probability = probability;
        }
    }

    private static final Decision DEAD = new Decision("", "", "", 0);
    static final int CANDIDATES = 4, MAX_EXTRA_TOKENS = 4;
    /** Tokens after the first that may finish spelling the taken-back text (bounds a keystroke's steps). */
    static final int MAX_SPELLING_TOKENS = 3;
    /** Where a chain's word has not started, it forks into this many chains. */
    static final int BRANCHES = 2;
    /** The most context a suggestion reads: as accurate as 256 tokens on held-out code, at half the cost. */
    static final int CONTEXT_TOKENS = 128;
    /** Earlier contexts whose logits and chains are kept, for a keystroke that goes back to one. */
    static final int RECENT_CONTEXTS = 4;
    /** Token healing takes back tokens until it holds this many characters of the partial word. */
    static final int HEAL_CHARS = 2;
    /** The words already typed: their share of a chip's score (step 11), chosen on the calib split. */
    static final double TYPED_SHARE = 0.1;
    /** The words already typed are read from the text's last this many lines (bounds a keystroke's cost). */
    static final int TYPED_LINES = 200;
    /** The typed words that followed the same word and link as the cursor's: their share (step 11). */
    static final double FOLLOW_SHARE = 0.25;
    private static final String SPACES = " \t\n\r\f\013"; // \013: vertical tab
    private static final String DOCUMENT_START = "<|eos|>";

    private final StepModel model, extender; // extender: the draft model, or the model itself
    private final ByteLevelBpe tokenizer;
    private final KeptStartEncoder typed; // the text typed so far, encoded a keystroke at a time
    private String[] tokenText;
    private int[] cached = new int[0]; // the context ids whose KV rows the program holds
    private float[] cachedLogits;
    private Map<String, Chain> chains = new HashMap<>(); // "firstToken textStillToSpell" -> chain, for `cached`
    // "ids" -> the logits and chains of earlier contexts that are shorter prefixes of `cached`, newest last: after
    // healing takes back a token that typing had committed, a keystroke goes back to the context of two before
    private final LinkedHashMap<String, Recent> recent = new LinkedHashMap<>();

    private static final class Recent {
        final float[] logits;
        final Map<String, Chain> chains;

        Recent(float[] logits, Map<String, Chain> chains) {
            this.logits = logits;
            this.chains = chains;
        }
    }

    public WordSuggester(StepModel model, ByteLevelBpe tokenizer) {
        this(model, null, tokenizer);
    }

    /** draft: the first outer cycle over the same cache (its rows below `start` are the context's), which extends
     *  the chains; null: the model extends them. */
    public WordSuggester(StepModel model, StepModel draft, ByteLevelBpe tokenizer) {
        this.model = model;
        this.extender = draft != null ? draft : model;
        this.tokenizer = tokenizer;
        this.typed = new KeptStartEncoder(tokenizer);
    }

    /** tokenizer.encode(text) for a text typed a key at a time, without encoding all of it at every keystroke (the
     *  page's keptStartEncoder, model.mjs): the ids of a start of the text that ends at a line break after a visible
     *  ASCII character do not depend on what follows (the ByteLevel pre-tokenizer's regex looks only forward and
     *  begins a new piece there; BPE and the added tokens stay within pieces), so the ids of the latest such start
     *  at least KEEP_BACK_CHARS before the end are kept and a keystroke encodes the rest. A text that does not go on
     *  from the kept start (an edit before it) starts over. */
    static final class KeptStartEncoder {
        static final int KEEP_BACK_CHARS = 64;
        private final ByteLevelBpe tokenizer;
        private String keptText = "";
        private int[] keptIds = new int[0];

        KeptStartEncoder(ByteLevelBpe tokenizer) {
            this.tokenizer = tokenizer;
        }

        int[] encode(String text) {
            // the kept ids hold only while the text goes on from the kept start with its line break
            boolean goesOn = text.startsWith(keptText)
                    && (text.length() == keptText.length() || text.charAt(keptText.length()) == '\n');
            if (!goesOn) {
                keptText = "";
                keptIds = new int[0];
            }
            int cut = pieceStart(text, text.length() - KEEP_BACK_CHARS);
            if (cut > keptText.length()) {
                keptIds = concat(keptIds, tokenizer.encode(text.substring(keptText.length(), cut)));
                keptText = text.substring(0, cut);
            }
            return concat(keptIds, tokenizer.encode(text.substring(keptText.length())));
        }

        int keptChars() {
            return keptText.length();
        }

        /** The last index i <= at where text[i] is a line break after a visible ASCII character; 0 if none. */
        private static int pieceStart(String text, int at) {
            for (int i = Math.min(at, text.length() - 1); i > 0; i--) {
                char before = text.charAt(i - 1);
                if (text.charAt(i) == '\n' && before > 0x20 && before < 0x7f) return i;
            }
            return 0;
        }

        private static int[] concat(int[] a, int[] b) {
            int[] out = Arrays.copyOf(a, a.length + b.length);
            System.arraycopy(b, 0, out, a.length, b.length);
            return out;
        }
    }

    public List<Suggestion> suggest(String text, int n) {
        int[] ids = contextWindow(documentIds(text), model.maxSeqLen());
        if (ids.length == 0) return new ArrayList<>();
        String partial = trailingWord(text);
        boolean midWord = !partial.isEmpty();
        // token healing: the last token, and earlier ones until HEAL_CHARS characters of the partial word, are
        // taken back; the chains spell their text again
        int cut = healedStart(ids, partial);
        float[] logits = advance(Arrays.copyOf(ids, cut));
        String[] texts = tokenTexts(logits.length);
        String prefix = tokenizer.decode(Arrays.copyOfRange(ids, cut, ids.length));
        List<Chain> list = new ArrayList<>(), fresh = new ArrayList<>();
        double[] firstProbs = null; // the first tokens' softmax, taken once and only if a chain is new (as the page's)
        for (int t : firstTokens(logits, texts, prefix, CANDIDATES, midWord)) {
            // a chain depends on its first token, the text it must spell and whether its word has started (where it
            // forks)
            boolean started = hasWordChar(texts[t].substring(Math.min(prefix.length(), texts[t].length())));
            String key = t + " " + started + " " + prefix.substring(Math.min(texts[t].length(), prefix.length()));
            Chain chain = chains.get(key);
            if (chain == null || stale(chain, prefix, midWord)) {
                chain = new Chain(); // not computed yet, or too short to decide
                chain.tokens.add(t);
                if (firstProbs == null) firstProbs = Sampling.softmax(logits);
                chain.probs.add(firstProbs[t]);
                chains.put(key, chain);
                fresh.add(chain);
            }
            list.add(chain);
        }
        extendAll(fresh, list, prefix, partial, n);
        List<Suggestion> out = merge(list, prefix, partial);
        out.sort((a, b) -> Double.compare(b.probability, a.probability)); // stable: ties keep candidate order
        List<Suggestion> best = out.subList(0, Math.min(n, out.size()));
        if (!midWord && !best.isEmpty()) { // at a word start: the model's chance of each word given the typed text
            if (firstProbs == null) firstProbs = Sampling.softmax(logits);
            double z = prefixProbability(firstProbs, texts, prefix);
            if (z > 0) for (Suggestion w : best) w.probability /= z;
        }
        return withTypedWords(best, text, partial, n);
    }

    /** Step 11's Z: the probability that the next token fits the taken-back text (its non-empty text starts with
     *  prefix or is a proper prefix of it), summed in id order; 1 with no taken-back text. */
    static double prefixProbability(double[] p, String[] texts, String prefix) {
        if (prefix.isEmpty()) return 1;
        double z = 0;
        for (int t = 0; t < texts.length; t++) {
            String s = texts[t];
            if (!s.isEmpty() && (s.startsWith(prefix) || prefix.startsWith(s))) z += p[t];
        }
        return z;
    }

    /** Step 11: the model's words (its n best) and the words already typed that go on from the partial word, each
     *  scored (1 - TYPED_SHARE - f) p + TYPED_SHARE c / C + f a / A (p: the model's probability, 0 for a word it did
     *  not show; c: the word's occurrences among the C words typed; a: those right after the word and link before
     *  the cursor, among A, which counts every follower; f: FOLLOW_SHARE, 0 if A is 0); the n best, ties in that
     *  order (the model's, then by first occurrence). A chip inserts what the larger of its two parts inserts: the
     *  model's word, or the typed word (typedInsert; its ending: what followed it). */
    static List<Suggestion> withTypedWords(List<Suggestion> words, String text, String partial, int n) {
        String before = text.substring(0, text.length() - partial.length());
        Map<String, Typed> seen = typedWords(before);
        Map<String, Integer> follows = typedFollowers(before);
        int total = 0, afterTotal = 0;
        for (Typed e : seen.values()) total += e.count;
        for (int count : follows.values()) afterTotal += count;
        double followShare = afterTotal > 0 ? FOLLOW_SHARE : 0, keep = 1 - TYPED_SHARE - followShare;
        Map<String, Suggestion> out = new LinkedHashMap<>();
        for (Suggestion w : words) out.put(w.label, new Suggestion(w.label, w.insert, keep * w.probability, w.ending));
        for (Map.Entry<String, Typed> e : seen.entrySet()) {
            String word = e.getKey();
            if (word.length() <= partial.length() || !word.startsWith(partial)) continue;
            double share = TYPED_SHARE * e.getValue().count / total
                    + (follows.containsKey(word) ? followShare * follows.get(word) / afterTotal : 0);
            Suggestion known = out.get(word);
            if (known == null || share > known.probability) { // a tap inserts what the larger part inserts (step 9)
                known = new Suggestion(word, typedInsert(word, partial, text, words),
                                       known == null ? 0 : known.probability, e.getValue().after);
                out.put(word, known); // a key already there keeps its place
            }
            known.probability += share;
        }
        List<Suggestion> ranked = new ArrayList<>(out.values());
        ranked.sort((a, b) -> Double.compare(b.probability, a.probability)); // stable
        return new ArrayList<>(ranked.subList(0, Math.min(n, ranked.size())));
    }

    /** What a tap on a typed word inserts: the rest of it; at a word start after a symbol ("x =", "):") first the
     *  spaces the model's chip of that word, else its first chip, puts before its word (" y", "\n    return"). */
    static String typedInsert(String word, String partial, String text, List<Suggestion> modelWords) {
        if (!partial.isEmpty() || text.isEmpty() || SPACES.indexOf(text.charAt(text.length() - 1)) >= 0) {
            return word.substring(partial.length());
        }
        Suggestion same = modelWords.isEmpty() ? null : modelWords.get(0);
        for (Suggestion w : modelWords) {
            if (w.label.equals(word)) {
                same = w;
                break;
            }
        }
        return (same == null ? "" : same.insert.substring(0, same.insert.length() - same.label.length())) + word;
    }

    /** A word already typed: the times it occurs, the character after its last occurrence. */
    static final class Typed {
        int count;
        String after;
    }

    /** Where the words already typed are read from: after the text's TYPED_LINES-th last line break (0 if fewer). */
    static int typedWindow(String text) {
        int start = text.length();
        for (int k = 0; k < TYPED_LINES; k++) {
            start = start > 0 ? text.lastIndexOf('\n', start - 1) : -1;
            if (start < 0) break;
        }
        return start + 1;
    }

    /** The words in the text's window (typedWindow), in order of first occurrence; text ends before the word being
     *  typed. */
    static Map<String, Typed> typedWords(String text) {
        Map<String, Typed> seen = new LinkedHashMap<>();
        int i = typedWindow(text);
        while (i < text.length()) {
            int j = wordEnd(text, i);
            if (j == i) {
                i += Character.charCount(text.codePointAt(i));
                continue;
            }
            Typed entry = seen.computeIfAbsent(text.substring(i, j), w -> new Typed());
            entry.count++;
            entry.after = j < text.length() ? new String(Character.toChars(text.codePointAt(j))) : "";
            i = j;
        }
        return seen;
    }

    /** The end of the run of word characters that starts at i (i itself if there is none). */
    private static int wordEnd(String text, int i) {
        while (i < text.length() && isWordChar(text.codePointAt(i))) i += Character.charCount(text.codePointAt(i));
        return i;
    }

    /** The symbols between two words, each run of spaces as one " " (one "\n" if it holds a line break). */
    static String link(String between) {
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < between.length();) {
            int j = i;
            boolean lineBreak = false;
            while (j < between.length() && SPACES.indexOf(between.charAt(j)) >= 0) {
                lineBreak |= between.charAt(j++) == '\n';
            }
            if (j > i) out.append(lineBreak ? '\n' : ' ');
            else out.append(between.charAt(j++));
            i = j;
        }
        return out.toString();
    }

    /** Word -> times it was typed right after the word and link that end the text, in the text's window (its first
     *  word: after "" and the link from the window's start): after "self." the attributes typed after "self."
     *  before. */
    static Map<String, Integer> typedFollowers(String text) {
        List<String[]> pairs = new ArrayList<>(); // word before, link, word
        String before = "";
        int end = typedWindow(text);
        for (int i = end; i < text.length();) {
            int j = wordEnd(text, i);
            if (j == i) {
                i += Character.charCount(text.codePointAt(i));
                continue;
            }
            pairs.add(new String[] {before, link(text.substring(end, i)), text.substring(i, j)});
            before = text.substring(i, j);
            end = i = j;
        }
        String now = link(text.substring(end));
        Map<String, Integer> seen = new LinkedHashMap<>();
        for (String[] pair : pairs) {
            if (pair[0].equals(before) && pair[1].equals(now)) seen.merge(pair[2], 1, Integer::sum);
        }
        return seen;
    }

    /** Forget the program's cache rows (another caller of the same program overwrote them): the next suggestion
     *  runs its whole context. */
    public void forgetCache() {
        cached = new int[0];
        cachedLogits = null;
        chains = new HashMap<>();
        recent.clear();
    }

    /** The count likeliest next characters after `text`, called right after suggest(text) gave `words` (as the page's
     *  likelyKeys, lookahead.mjs): the first character of each chip's insert, in chip order, then those of the tokens
     *  that continue the taken-back text (healing), by their summed probability (ties: the lower token first). */
    public List<String> likelyKeys(String text, List<Suggestion> words, int count) {
        List<String> keys = new ArrayList<>();
        for (Suggestion w : words) {
            if (!w.insert.isEmpty()) addKey(keys, new String(Character.toChars(w.insert.codePointAt(0))), count);
        }
        int[] ids = contextWindow(documentIds(text), model.maxSeqLen());
        if (keys.size() >= count || cachedLogits == null || ids.length == 0) return keys;
        int cut = healedStart(ids, trailingWord(text));
        String prefix = tokenizer.decode(Arrays.copyOfRange(ids, cut, ids.length));
        String[] texts = tokenTexts(cachedLogits.length);
        double[] p = Sampling.softmax(cachedLogits); // the same doubles as the chains' and the page's
        Map<String, Double> mass = new LinkedHashMap<>(); // next character -> summed probability of its tokens
        for (int t = 0; t < texts.length; t++) {
            if (texts[t].length() <= prefix.length() || !texts[t].startsWith(prefix)) continue;
            String ch = new String(Character.toChars(texts[t].codePointAt(prefix.length())));
            mass.merge(ch, p[t], Double::sum);
        }
        List<Map.Entry<String, Double>> ranked = new ArrayList<>(mass.entrySet());
        ranked.sort((a, b) -> Double.compare(b.getValue(), a.getValue())); // stable: ties keep token order
        for (Map.Entry<String, Double> e : ranked) addKey(keys, e.getKey(), count);
        return keys;
    }

    private static void addKey(List<String> keys, String key, int count) {
        if (keys.size() < count && !keys.contains(key)) keys.add(key);
    }

    /** Whether a chain computed for an earlier keystroke is computed again: one of its family was cut short, or is
     *  too short to decide. */
    private boolean stale(Chain chain, String prefix, boolean midWord) {
        for (Chain member : chain.family()) {
            if (member.cutShort || (firstDecision(member, prefix, midWord) == null
                                    && member.tokens.size() <= MAX_EXTRA_TOKENS)) return true;
        }
        return false;
    }

    /** The words of the decided chains, in candidate order (each chain, then its forks); chains with the same
     *  label are one word, their probabilities added up, inserting what the most probable of them inserts. */
    private List<Suggestion> merge(List<Chain> list, String prefix, String partial) {
        Map<String, Suggestion> merged = new LinkedHashMap<>();
        Map<String, Double> best = new HashMap<>(); // label -> the probability of its most probable chain
        List<Chain> members = new ArrayList<>();
        for (Chain chain : list) members.addAll(chain.family());
        for (Chain chain : members) {
            Decision d = firstDecision(chain, prefix, !partial.isEmpty());
            if (d == null || d == DEAD) continue; // open, dead, or no word ended within MAX_EXTRA_TOKENS
            String label = partial + d.word;
            Suggestion known = merged.get(label);
            if (known == null) {
                merged.put(label, new Suggestion(label, d.insert, d.probability, d.ending));
                best.put(label, d.probability);
            } else if (d.probability > best.get(label)) {
                merged.put(label, new Suggestion(label, d.insert, known.probability + d.probability, d.ending));
                best.put(label, d.probability);
            } else {
                known.probability += d.probability;
            }
        }
        return new ArrayList<>(merged.values());
    }

    /** Extends the fresh chains one after another (a chain's forks right after it, while the cache rows after the
     *  point where they part still hold its tokens), until each has ended or is out of budget; stops, leaving the
     *  open ones cut short, once no end of them can change the n words shown (docs/keyboard.md step 6). */
    private void extendAll(List<Chain> fresh, List<Chain> all, String prefix, String partial, int n) {
        List<Chain> queue = new ArrayList<>(fresh);
        try {
            extendQueue(queue, all, prefix, partial, n);
        } catch (RuntimeException e) { // a model call called off (Lookahead) or failed: whoever reuses the chains
            boolean midWord = !partial.isEmpty(); // still open computes them again, not reading them as dropped
            for (Chain chain : queue) if (stillOpen(chain, prefix, midWord)) chain.cutShort = true;
            throw e;
        }
    }

    /** extendAll's steps; adds the forks to the queue right after their chain. */
    private void extendQueue(List<Chain> queue, List<Chain> all, String prefix, String partial, int n) {
        boolean midWord = !partial.isEmpty();
        for (int i = 0; i < queue.size(); i++) {
            Chain chain = queue.get(i);
            while (stillOpen(chain, prefix, midWord)) {
                List<Chain> open = new ArrayList<>();
                open.add(chain);
                for (Chain later : queue.subList(i + 1, queue.size())) {
                    if (stillOpen(later, prefix, midWord)) open.add(later); // not extended yet: open
                }
                if (settled(all, open, prefix, partial, n)) {
                    for (Chain c : open) c.cutShort = true;
                    return;
                }
                int forks = chain.forks.size();
                step(chain, cached.length, prefix, midWord);
                queue.addAll(i + 1, chain.forks.subList(forks, chain.forks.size()));
            }
        }
    }

    /** Whether the first n words of the decided chains stay the words shown, in the same order with the same
     *  probabilities and inserts, however the open chains end: n words are there, no open chain can end in one of
     *  them, and
     *  the n-th is more likely than the next one and every open chain together could be. */
    private boolean settled(List<Chain> all, List<Chain> open, String prefix, String partial, int n) {
        List<Suggestion> ranked = merge(all, prefix, partial);
        ranked.sort((a, b) -> Double.compare(b.probability, a.probability));
        if (ranked.size() < n) return false;
        double spare = 0;
        for (Chain chain : open) {
            int[] ids = ids(chain, chain.tokens.size());
            String text = tokenizer.decode(ids);
            String c = ""; // the chain's text past the taken-back one
            if (text.length() >= prefix.length()) {
                int end = text.length();
                while (end > prefix.length() && text.charAt(end - 1) == '\ufffd') end--;
                c = text.substring(prefix.length(), end);
            }
            int skip = 0;
            while (skip < c.length() && SPACES.indexOf(c.charAt(skip)) >= 0) skip++;
            String start = partial + c.substring(skip); // the label of any word the chain still ends in starts so
            for (Suggestion w : ranked.subList(0, n)) if (w.label.startsWith(start)) return false;
            double bound = chain.probs.get(0); // the product over the tokens that spell part of c
            for (int i = 1; i < ids.length; i++) {
                if (wholeCharacters(Arrays.copyOf(ids, i)).length() >= prefix.length() + c.length()) break;
                bound *= chain.probs.get(i);
            }
            spare += bound;
        }
        spare += ranked.size() > n ? ranked.get(n).probability : 0;
        return ranked.get(n - 1).probability > spare * (1 + 1e-9); // margin: float sums in another order
    }

    /** Run the context, reusing the cached rows of its common prefix (or, for a recent context, its logits and
     *  chains: the rows of a prefix do not depend on what follows it); returns the last position's logits. */
    private float[] advance(int[] ids) {
        int common = 0;
        while (common < ids.length && common < cached.length && ids[common] == cached[common]) common++;
        if (common == ids.length && common == cached.length && cachedLogits != null) return cachedLogits;
        String key = key(ids);
        Recent earlier = common == ids.length ? recent.remove(key) : null;
        float[] logits = null;
        if (earlier == null) { // before anything changes: a call that throws (called off) leaves the state as it was
            common = Math.min(common, ids.length - 1); // the last token runs again to give its logits
            logits = model.forward(Arrays.copyOfRange(ids, common, ids.length), common);
        }
        if (cachedLogits != null) recent.put(key(cached), new Recent(cachedLogits, chains));
        cachedLogits = earlier != null ? earlier.logits : logits;
        chains = earlier != null ? earlier.chains : new HashMap<>();
        cached = ids.clone();
        recent.keySet().removeIf(k -> !key.startsWith(k + ",")); // only a shorter prefix can be gone back to
        while (recent.size() > RECENT_CONTEXTS) recent.remove(recent.keySet().iterator().next()); // the oldest
        return cachedLogits;
    }

    private static String key(int[] ids) {
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < ids.length; i++) out.append(i > 0 ? "," : "").append(ids[i]);
        return out.toString();
    }

    /** Step 1: the text's ids after the document start, {@code <|eos|>} (training puts it after every file, so
     *  before the next: the text is read as a file from its start); without it where the tokenizer lacks it. */
    private int[] documentIds(String text) {
        int[] ids = typed.encode(text);
        Integer start = tokenizer.specialId(DOCUMENT_START);
        if (start == null) return ids;
        int[] out = new int[ids.length + 1];
        out[0] = start;
        System.arraycopy(ids, 0, out, 1, ids.length);
        return out;
    }

    /** Token healing: the index of the first id taken back. The last id, and earlier ones until the taken-back
     *  text holds HEAL_CHARS characters of the partial word (a context ending in a 1-character piece of a word is
     *  one the model rarely saw), earlier ones while both it and the token before are whitespace, and earlier ones
     *  while it would start inside a character; at least one id stays (with fewer than 2 ids nothing is taken back). */
    private int healedStart(int[] ids, String partial) {
        if (ids.length < 2) return ids.length;
        int j = ids.length - 1, chars = Math.min(codePoints(partial), HEAL_CHARS);
        while (j > 1 && codePoints(tokenizer.decode(Arrays.copyOfRange(ids, j, ids.length))) < chars) j--;
        // a run of whitespace at the end is taken back whole ("\n\n    " typed is "\n" "\n    ", which training never
        // shows before a word)
        if (isSpaces(tokenizer.decode(Arrays.copyOfRange(ids, j, ids.length)))) {
            while (j > 1 && isSpaces(tokenizer.decode(Arrays.copyOfRange(ids, j - 1, j)))) j--;
        }
        // not inside a character (its text would start with U+FFFD, which any bytes match): a token whose first
        // byte is a UTF-8 continuation byte ends a character the one before it began
        while (j > 1 && startsInsideACharacter(ids[j])) j--;
        return j;
    }

    /** Whether text is non-empty and only SPACES. */
    private static boolean isSpaces(String text) {
        if (text.isEmpty()) return false;
        for (int i = 0; i < text.length(); i++) {
            if (SPACES.indexOf(text.charAt(i)) < 0) return false;
        }
        return true;
    }

    private static int codePoints(String text) {
        return text.codePointCount(0, text.length());
    }

    private boolean startsInsideACharacter(int id) {
        byte[] bytes = tokenizer.tokenBytes(id);
        return bytes.length > 0 && (bytes[0] & 0xc0) == 0x80;
    }

    /** The text of ids without trailing U+FFFD: only the characters they complete (the bytes of the last one may
     *  still be coming: its U+FFFD would count as a character already spelled). */
    private String wholeCharacters(int[] ids) {
        String text = tokenizer.decode(ids);
        int end = text.length();
        while (end > 0 && text.charAt(end - 1) == '\ufffd') end--;
        return text.substring(0, end);
    }

    /** Whether the chain's word is still open and it has fewer than MAX_EXTRA_TOKENS tokens after the one that
     *  completes the taken-back text, which came within MAX_SPELLING_TOKENS after the first. */
    private boolean stillOpen(Chain chain, String prefix, boolean midWord) {
        int size = chain.tokens.size(), spelling = 1; // tokens up to the one that completes prefix
        while (spelling < size && tokenizer.decode(ids(chain, spelling)).length() < prefix.length()) spelling++;
        if (size > MAX_SPELLING_TOKENS && tokenizer.decode(ids(chain, size)).length() < prefix.length()) {
            return false; // not spelled within MAX_SPELLING_TOKENS after the first: dropped
        }
        return size - spelling < MAX_EXTRA_TOKENS && decide(chain, size, prefix, midWord) == null;
    }

    /** One step of the chain (its first token at position `position`): its next token, and the first time its word
     *  has not started, its forks (copies that take the 2nd.. of nextTokens instead). */
    private void step(Chain chain, int position, String prefix, boolean midWord) {
        int[] ids = ids(chain, chain.tokens.size());
        float[] logits = extender.forward(new int[] {ids[ids.length - 1]}, position + ids.length - 1);
        List<Integer> next = nextTokens(chain, logits, tokenizer.decode(ids), prefix, midWord);
        double[] p = Sampling.softmax(logits); // once for the step's tokens: the chain's and its forks'
        for (int t : next.subList(1, next.size())) {
            Chain fork = new Chain();
            fork.tokens.addAll(chain.tokens);
            fork.probs.addAll(chain.probs);
            fork.forked = true;
            fork.tokens.add(t);
            fork.probs.add(p[t]);
            chain.forks.add(fork);
        }
        chain.tokens.add(next.get(0));
        chain.probs.add(p[next.get(0)]);
    }

    /** Greedy: while the taken-back text is unspelled, only a token that fits it; where the word has not started,
     *  the best tokens after which a word can still come (BRANCHES of them the first time: the chain forks once). */
    private List<Integer> nextTokens(Chain chain, float[] logits, String spelled, String prefix, boolean midWord) {
        if (spelled.length() < prefix.length()) {
            List<Integer> fit = firstTokens(logits, tokenText, prefix.substring(spelled.length()), 1, null);
            return Collections.singletonList(fit.isEmpty() ? argmax(logits) : fit.get(0));
        }
        int end = spelled.length();
        while (end > prefix.length() && spelled.charAt(end - 1) == '\ufffd') end--;
        String c = spelled.substring(prefix.length(), end);
        if (hasWordChar(c)) return Collections.singletonList(argmax(logits));
        int count = chain.forked ? 1 : BRANCHES;
        chain.forked = true;
        List<Integer> found = wordTokens(logits, tokenText, c, midWord, count);
        return found.isEmpty() ? Collections.singletonList(argmax(logits)) : found;
    }

    /** The count highest-logit tokens (ties: lower id) after which a word can still come from a chain whose text
     *  past the taken-back one is c (no word character in it yet): readWord(c + text) is not DEAD. */
    private static List<Integer> wordTokens(float[] logits, String[] texts, String c, boolean midWord, int count) {
        List<Integer> best = new ArrayList<>();
        for (int t = 0; t < logits.length; t++) {
            if (texts[t].isEmpty() || !room(best, t, logits, count)) continue;
            if (readWord(c + texts[t], midWord) != DEAD) rank(best, t, logits, count);
        }
        return best;
    }

    private static boolean hasWordChar(String text) {
        for (int i = 0; i < text.length(); i += Character.charCount(text.codePointAt(i))) {
            if (isWordChar(text.codePointAt(i))) return true;
        }
        return false;
    }

    /** The chain's first k tokens. */
    private static int[] ids(Chain chain, int k) {
        int[] ids = new int[k];
        for (int i = 0; i < k; i++) ids[i] = chain.tokens.get(i);
        return ids;
    }

    private String[] tokenTexts(int vocab) {
        if (tokenText == null) {
            tokenText = new String[vocab];
            for (int i = 0; i < vocab; i++) tokenText[i] = tokenizer.decode(new int[] {i});
        }
        return tokenText;
    }

    /** The end of a long text: whole blocks of a quarter of min(maxSeqLen, CONTEXT_TOKENS) dropped from the start;
     *  a chain's up to 1 + MAX_SPELLING_TOKENS + MAX_EXTRA_TOKENS tokens (the last never run) fit within maxSeqLen. */
    static int[] contextWindow(int[] ids, int maxSeqLen) {
        int span = Math.min(maxSeqLen, CONTEXT_TOKENS);
        int limit = Math.min(span - MAX_EXTRA_TOKENS, maxSeqLen - MAX_SPELLING_TOKENS - MAX_EXTRA_TOKENS + 1);
        if (ids.length <= limit) return ids;
        int block = span / 4;
        int drop = (ids.length - limit + block - 1) / block * block;
        return Arrays.copyOfRange(ids, drop, ids.length);
    }

    static boolean isWordChar(int cp) {
        if (cp == '_') return true;
        switch (Character.getType(cp)) {
            case Character.UPPERCASE_LETTER: case Character.LOWERCASE_LETTER: case Character.TITLECASE_LETTER:
            case Character.MODIFIER_LETTER: case Character.OTHER_LETTER:
            case Character.DECIMAL_DIGIT_NUMBER: case Character.LETTER_NUMBER: case Character.OTHER_NUMBER:
                return true;
            default:
                return false;
        }
    }

    /** The word characters at the end of the text (the word being typed; "" after a space or a symbol). */
    static String trailingWord(String text) {
        int i = text.length();
        while (i > 0 && isWordChar(text.codePointBefore(i))) i -= Character.charCount(text.codePointBefore(i));
        return text.substring(i);
    }

    /** null while the word may go on (open), DEAD when no word can come out, else the word (probability 0). */
    static Decision readWord(String continuation, boolean midWord) {
        int end = continuation.length();
        while (end > 0 && continuation.charAt(end - 1) == '\ufffd') end--; // bytes of a character still coming
        String c = continuation.substring(0, end);
        int i = 0;
        if (!midWord) while (i < c.length() && SPACES.indexOf(c.charAt(i)) >= 0) i++;
        int j = i;
        while (j < c.length() && isWordChar(c.codePointAt(j))) j += Character.charCount(c.codePointAt(j));
        if (j == c.length()) return null;
        if (j == i) return DEAD;
        return new Decision(c.substring(0, j), c.substring(i, j), c.substring(j), 0);
    }

    /** The decision on the chain's first k tokens, with the word's probability: the product over the tokens that
     *  spell part of the word (not those of the ending alone). */
    private Decision decide(Chain chain, int k, String prefix, boolean midWord) {
        int[] ids = ids(chain, k);
        if (tokenText[ids[k - 1]].isEmpty()) return DEAD; // a special token (end of text): no word follows
        String text = tokenizer.decode(ids);
        if (text.length() < prefix.length() && prefix.startsWith(text)) return null; // still spelling the prefix
        if (!text.startsWith(prefix)) return DEAD;
        Decision read = readWord(text.substring(prefix.length()), midWord);
        if (read == null || read == DEAD) return read;
        int end = prefix.length() + read.insert.length();
        double p = chain.probs.get(0);
        for (int i = 1; i < k; i++) {
            if (wholeCharacters(Arrays.copyOf(ids, i)).length() >= end) break;
            p *= chain.probs.get(i);
        }
        return new Decision(read.insert, read.word, read.ending, p);
    }

    /** decide() on the chain's shortest prefix that decides; null if the whole chain is still open. */
    private Decision firstDecision(Chain chain, String prefix, boolean midWord) {
        for (int k = 1; k <= chain.tokens.size(); k++) {
            Decision d = decide(chain, k, prefix, midWord);
            if (d != null) return d;
        }
        return null;
    }

    /** The count highest-logit tokens whose text starts with prefix; in the slots left, the highest-logit tokens
     *  whose text is a (non-empty) proper prefix of it (the following tokens then spell the rest); ties: lower id.
     *  At a word start (midWord false) both kinds rank together by logit ("\n       " " self" spells
     *  "\n        self").
     *  midWord (non-null): skip the covering tokens from which no word can come (readWord is DEAD: " =" where a word
     *  should start). */
    private static List<Integer> firstTokens(float[] logits, String[] texts, String prefix, int count,
                                             Boolean midWord) {
        List<Integer> covering = new ArrayList<>(), shorter = new ArrayList<>();
        for (int t = 0; t < logits.length; t++) {
            if (texts[t].isEmpty() || !(room(covering, t, logits, count) || room(shorter, t, logits, count))) continue;
            if (texts[t].startsWith(prefix)) {
                if (midWord == null || readWord(texts[t].substring(prefix.length()), midWord) != DEAD) {
                    rank(covering, t, logits, count);
                }
            } else if (prefix.startsWith(texts[t])) rank(shorter, t, logits, count);
        }
        covering.addAll(shorter);
        if (Boolean.FALSE.equals(midWord)) {  // higher logit first; ties: the lower id
            covering.sort((a, b) -> logits[a] > logits[b] ? -1 : logits[a] < logits[b] ? 1 : Integer.compare(a, b));
        }
        return covering.subList(0, Math.min(count, covering.size()));
    }

    /** Whether t would rank among best (the string tests only run for such a token). */
    private static boolean room(List<Integer> best, int t, float[] logits, int count) {
        return best.size() < count || logits[t] > logits[best.get(count - 1)];
    }

    /** Insert t into best (at most count ids, highest logit first; ties: the lower id, which comes first). */
    private static void rank(List<Integer> best, int t, float[] logits, int count) {
        if (!room(best, t, logits, count)) return;
        if (best.size() == count) best.remove(count - 1);
        int k = best.size();
        while (k > 0 && logits[t] > logits[best.get(k - 1)]) k--;
        best.add(k, t);
    }

    /** First maximum on ties, like numpy's argmax. */
    private static int argmax(float[] logits) {
        int best = 0;
        for (int i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
        return best;
    }
}
