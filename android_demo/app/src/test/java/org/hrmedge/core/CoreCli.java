package org.hrmedge.core;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.StringJoiner;

/**
 * The core's numbers on this machine's JVM, for tests/test_android_core.py to compare with Python:
 *   parity BUNDLE LOGITS PRECISION   logits: raw little-endian float32 [samples * seqLen * vocab]; prints JSON
 *   tokenize TOKENIZER_JSON TEXTS    texts: a JSON array of strings; prints one line of ids and one decoded
 *                                    JSON string per text
 *   typed TOKENIZER_JSON TEXTS       texts: a JSON array of strings, typed in that order; prints per text the ids
 *                                    WordSuggester.KeptStartEncoder gives and the characters of the start it kept
 *   suggest TOKENIZER_JSON JOB       job: {vocab, allowed, max_seq_len, draft_seed, sequences: [[text, ...], ...]};
 *                                    prints {"sequences": each text's words [label, insert, probability, ending],
 *                                    "draft_calls" / "model_calls": the draft's / the model's forward calls in
 *                                    all} from WordSuggester on
 *                                    HashStepModel (chains on a draft HashStepModel of seed draft_seed, unless
 *                                    null), one suggester (cache) per sequence
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
                    + "heal TOKENIZER_JSON CASES_JSON");
            System.exit(2);
        }
    }

    static String suggest(ByteLevelBpe tok, Map<String, Object> job) {
        List<Object> allowedList = Json.array(job.get("allowed"));
        int[] allowed = new int[allowedList.size()];
        for (int i = 0; i < allowed.length; i++) allowed[i] = (int) Json.number(allowedList.get(i));
        StringJoiner sequences = new StringJoiner(",", "[", "]");
        int draftCalls = 0, modelCalls = 0;
        for (Object texts : Json.array(job.get("sequences"))) {
            HashStepModel model = new HashStepModel((int) Json.number(job.get("vocab")), allowed,
                    (int) Json.number(job.get("max_seq_len")));
            Object draftSeed = job.get("draft_seed"); // the draft fixture's seed, or null: no draft
            HashStepModel draft = draftSeed == null ? null : new HashStepModel(model, (int) Json.number(draftSeed));
            WordSuggester suggester = new WordSuggester(model, draft, tok);
            StringJoiner steps = new StringJoiner(",", "[", "]");
            for (Object text : Json.array(texts)) {
                StringJoiner words = new StringJoiner(",", "[", "]");
                for (WordSuggester.Suggestion w : suggester.suggest((String) text, 3)) {
                    words.add("[" + quote(w.label) + "," + quote(w.insert) + "," + w.probability + "," + quote(w.ending) + "]");
                }
                steps.add(words.toString());
            }
            sequences.add(steps.toString());
            draftCalls += draft == null ? 0 : draft.calls;
            modelCalls += model.calls;
        }
        return "{\"sequences\":" + sequences + ",\"draft_calls\":" + draftCalls + ",\"model_calls\":" + modelCalls
                + "}";
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
