package org.hrmedge.core;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The 3 most likely next words, as the browser demo computes them (hrm_edge/app/web/js/suggest.mjs): for the
 * most likely next tokens, extend each greedily until its word has ended, rank words by the product of
 * their tokens' probabilities (summed over token paths spelling the same word). The text's last token is
 * taken back first ("token healing"): "def " ends in a lone space token the model rarely saw, so the
 * candidates are the tokens that start with that text instead.
 */
public final class WordSuggester {
    /** A KV-cache program: forward(tokens at positions start..) -> logits of the last token [vocab]. */
    public interface StepModel {
        float[] forward(int[] tokens, int start);

        int maxSeqLen();
    }

    public static final class Suggestion {
        public final String insert, label;
        public final double probability;

        Suggestion(String insert, String label, double probability) {
            this.insert = insert;
            this.label = label;
            this.probability = probability;
        }

        @Override
        public String toString() {
            return label + " (" + probability + ")";
        }
    }

    static final int CANDIDATES = 6, MAX_EXTRA_TOKENS = 3;
    private static final Pattern WORD = ByteLevelBpe.unicodePattern("^(\\s*)([\\p{L}\\p{N}_]+|[^\\s\\p{L}\\p{N}_]+)");
    private static final Pattern PARTIAL = ByteLevelBpe.unicodePattern("[\\p{L}\\p{N}_]+$");

    private final StepModel model;
    private final ByteLevelBpe tokenizer;
    private final String[] tokenText;
    // ids whose KV rows the program holds (rows of later branches are overwritten before they are read)
    private int[] cached = new int[0];

    public WordSuggester(StepModel model, ByteLevelBpe tokenizer) {
        this.model = model;
        this.tokenizer = tokenizer;
        tokenText = new String[tokenizer.vocabSize()];
        for (int i = 0; i < tokenText.length; i++) tokenText[i] = tokenizer.decode(new int[] {i});
    }

    public List<Suggestion> suggest(String text, int n) {
        int[] ids = tokenizer.encode(text);
        int room = model.maxSeqLen() - MAX_EXTRA_TOKENS - 2;
        if (ids.length > room) ids = Arrays.copyOfRange(ids, ids.length - room, ids.length);
        if (ids.length == 0) return new ArrayList<>();
        String prefix = "";
        if (ids.length >= 2) { // token healing
            prefix = tokenizer.decode(new int[] {ids[ids.length - 1]});
            ids = Arrays.copyOf(ids, ids.length - 1);
        }
        double[] p = Sampling.softmax(advance(ids));
        Map<String, Double> byWord = new LinkedHashMap<>();
        for (int token : topCandidates(p, prefix)) {
            Suggestion w = extendToWord(ids.length, token, p[token], prefix);
            if (w != null) byWord.merge(w.insert, w.probability, Double::sum);
        }
        Matcher partialMatch = PARTIAL.matcher(text);
        String partial = partialMatch.find() ? partialMatch.group() : "";
        List<Suggestion> out = new ArrayList<>();
        byWord.entrySet().stream().sorted((a, b) -> Double.compare(b.getValue(), a.getValue())).limit(n).forEach(e -> {
            String insert = e.getKey();
            int c = insert.codePointAt(0);
            boolean wordChar = Character.isLetterOrDigit(c) || c == '_';
            out.add(new Suggestion(insert, wordChar ? partial + insert : insert.replaceAll("^\\s+", ""), e.getValue()));
        });
        return out;
    }

    /** Run the context, reusing the cached rows of its common prefix; returns the last position's logits. */
    private float[] advance(int[] ids) {
        int common = 0;
        while (common < ids.length && common < cached.length && ids[common] == cached[common]) common++;
        if (common == ids.length) common--; // the last token runs again to give its logits
        float[] logits = model.forward(Arrays.copyOfRange(ids, common, ids.length), common);
        cached = ids.clone();
        return logits;
    }

    private List<Integer> topCandidates(double[] p, String prefix) {
        List<Integer> order = new ArrayList<>();
        for (int i = 0; i < p.length; i++) if (tokenText[i].startsWith(prefix)) order.add(i);
        order.sort((a, b) -> Double.compare(p[b], p[a]));
        return order.subList(0, Math.min(CANDIDATES, order.size()));
    }

    private Suggestion extendToWord(int position, int first, double firstP, String prefix) {
        List<Integer> ids = new ArrayList<>();
        List<Double> probs = new ArrayList<>();
        ids.add(first);
        probs.add(firstP);
        String text = tokenText[first];
        for (int step = 0; step < MAX_EXTRA_TOKENS; step++) {
            Matcher m = WORD.matcher(text.substring(prefix.length()));
            if (m.find() && prefix.length() + m.group().length() < text.length()) break; // the word has ended
            if (position + 1 > model.maxSeqLen()) break;
            double[] p = Sampling.softmax(model.forward(new int[] {ids.get(ids.size() - 1)}, position++));
            int next = Sampling.argmax(p);
            ids.add(next);
            probs.add(p[next]);
            text = tokenizer.decode(ids.stream().mapToInt(Integer::intValue).toArray());
        }
        Matcher m = WORD.matcher(text.length() >= prefix.length() ? text.substring(prefix.length()) : "");
        if (!m.find()) return null;
        double probability = 1;
        for (int i = 0; i < ids.size(); i++) {
            int start = tokenizer.decode(ids.subList(0, i).stream().mapToInt(Integer::intValue).toArray()).length();
            if (i > 0 && start >= prefix.length() + m.group().length()) break;
            probability *= probs.get(i);
        }
        return new Suggestion(m.group(), m.group(), probability);
    }
}
