package org.hrmedge.core;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.StringJoiner;

/**
 * The core's numbers on this machine's JVM, for tests/test_android_core.py to compare with Python:
 *   parity BUNDLE LOGITS PRECISION   logits: raw little-endian float32 [samples * seqLen * vocab]; prints JSON
 *   tokenize TOKENIZER_JSON TEXTS    texts: a JSON array of strings; prints one line of ids and one decoded
 *                                    JSON string per text
 *   decode TOKENIZER_JSON IDS        ids: a JSON array of id lists; prints the decoded JSON string of each
 *   typed TOKENIZER_JSON TEXTS       texts: a JSON array of strings, typed in that order; prints per text the ids
 *                                    WordSuggester.KeptStartEncoder gives and the characters of the start it kept
 *   suggest TOKENIZER_JSON JOB       job: {vocab, allowed, max_seq_len, draft_seed, sequences: [[text, ...], ...]};
 *                                    prints {"sequences": each text's words [label, insert, probability, ending],
 *                                    "draft_calls" / "model_calls": the draft's / the model's forward calls in
 *                                    all} from WordSuggester on
 *                                    HashStepModel (chains on a draft HashStepModel of seed draft_seed, unless
 *                                    null), one suggester (cache) per sequence; per key "ahead" (computed
 *                                    ahead), "key_calls" (its own calls) and "likely" (the 3 likeliest next
 *                                    keys). With "lookahead": true, typed through Lookahead, the work ahead
 *                                    called off at the key's "call_off_at"-th call (null: varies, every other key)
 *   complete TOKENIZER_JSON JOB      job: {vocab, allowed, max_seq_len, eos, max_new_tokens, cases: [{text,
 *                                    penalty}]}; prints per case Completion's (greedy) tokens, text, the texts its
 *                                    listener got, where it stopped and whether the prompt was cut, on HashStepModel
 *   heal TOKENIZER_JSON CASES        cases: a JSON array of {text, logits, generated, penalty}; per case prints the
 *                                    healed context's ids, the allowed first tokens' ids, and the logits penalised
 *                                    over context + generated as the raw bits of each double
 */
public final class CoreCli {
    private CoreCli() {}

    public static void main(String[] args) throws IOException {
        if (args.length == 4 && args[0].equals("parity")) {
            WebBundle bundle = WebBundle.read(Files.readAllBytes(Path.of(args[1])));
            byte[] raw = Files.readAllBytes(Path.of(args[2]));
            float[] logits = new float[raw.length / 4];
            ByteBuffer.wrap(raw).order(ByteOrder.LITTLE_ENDIAN).asFloatBuffer().get(logits);
            System.out.println(ParityMetrics.check(logits, bundle, args[3]).toJson());
        } else if (args.length == 3 && args[0].equals("tokenize")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            List<Object> texts = Json.array(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)));
            for (Object text : texts) {
                int[] ids = tok.encode((String) text);
                StringJoiner line = new StringJoiner(",", "[", "]");
                for (int id : ids) line.add(Integer.toString(id));
                System.out.println(line);
                System.out.println(quote(tok.decode(ids)));
            }
        } else if (args.length == 3 && args[0].equals("decode")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            for (Object list : Json.array(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)))) {
                List<Object> values = Json.array(list);
                int[] ids = new int[values.size()];
                for (int i = 0; i < ids.length; i++) ids[i] = (int) Json.number(values.get(i));
                System.out.println(quote(tok.decode(ids)));
            }
        } else if (args.length == 3 && args[0].equals("typed")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            WordSuggester.KeptStartEncoder typed = new WordSuggester.KeptStartEncoder(tok);
            for (Object text : Json.array(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)))) {
                StringJoiner line = new StringJoiner(",", "[", "]");
                for (int id : typed.encode((String) text)) line.add(Integer.toString(id));
                System.out.println(line + " " + typed.keptChars());
            }
        } else if (args.length == 3 && args[0].equals("suggest")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            System.out.println(suggest(tok, Json.object(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)))));
        } else if (args.length == 3 && args[0].equals("complete")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            System.out.println(complete(tok, Json.object(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)))));
        } else if (args.length == 3 && args[0].equals("heal")) {
            ByteLevelBpe tok = new ByteLevelBpe(Files.readString(Path.of(args[1]), StandardCharsets.UTF_8));
            byte[][] vocabBytes = TokenHealing.vocabBytes(tok);
            for (Object c : Json.array(Json.parse(Files.readString(Path.of(args[2]), StandardCharsets.UTF_8)))) {
                Map<String, Object> heal = Json.object(c);
                TokenHealing h = TokenHealing.heal(tok.encode((String) heal.get("text")), vocabBytes);
                List<Object> values = Json.array(heal.get("logits")), generated = Json.array(heal.get("generated"));
                float[] logits = new float[values.size()];
                for (int i = 0; i < logits.length; i++) logits[i] = (float) Json.number(values.get(i));
                int[] context = Arrays.copyOf(h.context, h.context.length + generated.size());
                for (int i = 0; i < generated.size(); i++) context[h.context.length + i] = (int) Json.number(generated.get(i));
                StringJoiner ids = new StringJoiner(",", "[", "]"), allowed = new StringJoiner(",", "[", "]");
                StringJoiner bits = new StringJoiner(",", "[", "]");
                for (int id : h.context) ids.add(Integer.toString(id));
                for (int i = 0; h.allowed != null && i < h.allowed.length; i++) if (h.allowed[i]) allowed.add(Integer.toString(i));
                for (double z : Sampling.penalizeRepetition(logits, context, Json.number(heal.get("penalty")))) {
                    bits.add(Long.toString(Double.doubleToRawLongBits(z)));
                }
                System.out.println(ids);
                System.out.println(allowed);
                System.out.println(bits);
            }
        } else {
            System.err.println("usage: CoreCli parity BUNDLE LOGITS PRECISION | tokenize TOKENIZER_JSON TEXTS_JSON | "
                    + "typed TOKENIZER_JSON TEXTS_JSON | suggest TOKENIZER_JSON JOB_JSON | "
                    + "complete TOKENIZER_JSON JOB_JSON | heal TOKENIZER_JSON CASES_JSON");
            System.exit(2);
        }
    }

    static String suggest(ByteLevelBpe tok, Map<String, Object> job) {
        int[] allowed = ints(job.get("allowed"));
        boolean lookahead = Boolean.TRUE.equals(job.get("lookahead"));
        StringJoiner sequences = new StringJoiner(",", "[", "]"), ahead = new StringJoiner(",", "[", "]");
        StringJoiner keyCalls = new StringJoiner(",", "[", "]"), likely = new StringJoiner(",", "[", "]");
        int draftCalls = 0, modelCalls = 0;
        for (Object texts : Json.array(job.get("sequences"))) {
            HashStepModel model = fixtureModel(job, allowed);
            Object draftSeed = job.get("draft_seed"); // the draft fixture's seed, or null: no draft
            HashStepModel draft = draftSeed == null ? null : new HashStepModel(model, (int) Json.number(draftSeed));
            Session session = new Session(model, draft);
            List<String> typed = new ArrayList<>();
            for (Object text : Json.array(texts)) typed.add((String) text);
            if (lookahead) session.typeWithLookahead(tok, typed, job.get("call_off_at"));
            else session.type(tok, typed);
            sequences.add(session.words.toString());
            ahead.add(session.ahead.toString());
            keyCalls.add(session.keyCalls.toString());
            likely.add(session.likely.toString());
            draftCalls += draft == null ? 0 : draft.calls;
            modelCalls += model.calls;
        }
        return "{\"sequences\":" + sequences + ",\"draft_calls\":" + draftCalls + ",\"model_calls\":" + modelCalls
                + ",\"ahead\":" + ahead + ",\"key_calls\":" + keyCalls + ",\"likely\":" + likely + "}";
    }

    static String complete(ByteLevelBpe tok, Map<String, Object> job) {
        int[] allowed = ints(job.get("allowed"));
        byte[][] vocabBytes = TokenHealing.vocabBytes(tok);
        StringJoiner out = new StringJoiner(",", "[", "]");
        for (Object c : Json.array(job.get("cases"))) {
            Map<String, Object> one = Json.object(c);
            HashStepModel model = fixtureModel(job, allowed);
            Completion.Settings s = new Completion.Settings();
            s.repetitionPenalty = Json.number(one.get("penalty"));
            s.maxNewTokens = (int) Json.number(job.get("max_new_tokens"));
            List<String> shown = new ArrayList<>();
            Completion.Result r = new Completion(model, vocabBytes, (int) Json.number(job.get("eos")))
                    .run(tok.encode((String) one.get("text")), s, shown::add, null);
            StringJoiner ids = new StringJoiner(",", "[", "]"), texts = new StringJoiner(",", "[", "]");
            for (int id : r.tokens) ids.add(Integer.toString(id));
            for (String text : shown) texts.add(quote(text));
            out.add("{\"tokens\":" + ids + ",\"text\":" + quote(r.text) + ",\"shown\":" + texts
                    + ",\"stopped_at\":" + quote(r.stoppedAt) + ",\"truncated\":" + r.truncated + "}");
        }
        return out.toString();
    }

    /** One typing session (one cache) on the fixture models; per key its words, whether they were computed ahead,
     *  the model calls it made itself, and (without the lookahead) the 3 likeliest next keys after it. */
    private static final class Session {
        final HashStepModel model, draft;
        final StringJoiner words = new StringJoiner(",", "[", "]"), ahead = new StringJoiner(",", "[", "]");
        final StringJoiner keyCalls = new StringJoiner(",", "[", "]"), likely = new StringJoiner(",", "[", "]");

        Session(HashStepModel model, HashStepModel draft) {
            this.model = model;
            this.draft = draft;
        }

        int calls() {
            return model.calls + (draft == null ? 0 : draft.calls);
        }

        void add(List<WordSuggester.Suggestion> found, boolean computedAhead, int calls) {
            StringJoiner w = new StringJoiner(",", "[", "]");
            for (WordSuggester.Suggestion s : found) {
                w.add("[" + quote(s.label) + "," + quote(s.insert) + "," + s.probability + "," + quote(s.ending) + "]");
            }
            words.add(w.toString());
            ahead.add(Boolean.toString(computedAhead));
            keyCalls.add(Integer.toString(calls));
        }

        void type(ByteLevelBpe tok, List<String> texts) {
            WordSuggester suggester = new WordSuggester(model, draft, tok);
            for (String text : texts) {
                int before = calls();
                List<WordSuggester.Suggestion> found = suggester.suggest(text, 3);
                add(found, false, calls() - before);
                StringJoiner keys = new StringJoiner(",", "[", "]");
                for (String key : suggester.likelyKeys(text, found, 3)) keys.add(quote(key));
                likely.add(keys.toString());
            }
        }

        /** As keyboard_fixture.mjs types with the page's Lookahead: after each key the work ahead computes the next
         *  key (where it is one more character; "#" if not) and a wrong one, in either order, and at every other key
         *  (callOffAt null) or at every key, a key comes at its k-th model call. */
        void typeWithLookahead(ByteLevelBpe tok, List<String> texts, Object callOffAt) {
            Lookahead look = new Lookahead(model, draft, tok);
            for (int i = 0; i < texts.size(); i++) {
                String text = texts.get(i), next = i + 1 < texts.size() ? texts.get(i + 1) : "";
                int key = look.keyTyped(), before = calls();
                Lookahead.Result result = look.suggest(text, 3);
                add(result.words, result.ahead, calls() - before);
                String typedNext = next.startsWith(text) ? next.substring(text.length()) : "";
                List<String> guesses = new ArrayList<>(List.of(typedNext.length() == 1 ? typedNext : "#",
                        typedNext.equals("x") ? "y" : "x"));
                if (i % 3 == 2) Collections.reverse(guesses);
                int k = callOffAt != null ? (int) Json.number(callOffAt) : 1 + i % 7;
                boolean callOff = callOffAt != null || i % 2 == 1;
                int[] seen = {0};
                Runnable onCall = () -> { if (callOff && ++seen[0] == k) look.keyTyped(); };
                model.onCall = onCall;
                if (draft != null) draft.onCall = onCall;
                look.ahead(text, guesses, 3, key);
                model.onCall = null; // the next key's own calls are not called off
                if (draft != null) draft.onCall = null;
            }
        }
    }

    /** The job's hash fixture model (its vocab and max_seq_len), over the allowed ids. */
    static HashStepModel fixtureModel(Map<String, Object> job, int[] allowed) {
        return new HashStepModel((int) Json.number(job.get("vocab")), allowed,
                (int) Json.number(job.get("max_seq_len")));
    }

    /** A JSON array of numbers as ints. */
    static int[] ints(Object array) {
        List<Object> values = Json.array(array);
        int[] out = new int[values.size()];
        for (int i = 0; i < out.length; i++) out[i] = (int) Json.number(values.get(i));
        return out;
    }

    /** A JSON string literal (non-ASCII escaped, so the console encoding cannot alter it). */
    static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') out.append('\\').append(c);
            else if (c < 0x20 || c > 0x7e) out.append(String.format("\\u%04x", (int) c));
            else out.append(c);
        }
        return out.append('"').toString();
    }
}
