package org.hrmedge.demo;

import android.app.Activity;
import android.os.Bundle;
import android.os.Handler;
import android.os.Looper;
import android.text.Editable;
import android.text.TextWatcher;
import android.widget.Button;
import android.widget.EditText;
import android.widget.TextView;
import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import org.hrmedge.core.ByteLevelBpe;
import org.hrmedge.core.Completion;
import org.hrmedge.core.Json;
import org.hrmedge.core.Lookahead;
import org.hrmedge.core.ParityMetrics;
import org.hrmedge.core.TokenHealing;
import org.hrmedge.core.WebBundle;
import org.hrmedge.core.WordSuggester;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Module;
import org.pytorch.executorch.Tensor;

/**
 * The phone demo on ExecuTorch: suggestions as you type, a streamed completion with tokens/s, and a
 * self-test of the web parity bundle. Only UI and ExecuTorch calls live here; the rest is the plain-Java
 * core (org.hrmedge.core), compiled and tested on the JDK by tests/test_android_core.py.
 *
 * One handle on the int8 KV .pte, ExecuTorch's Module (forward -> logits), serves the suggestions, the completion
 * (the core's Completion: token healing and the repetition penalty, which ExecuTorch's LlmModule, text in and text
 * out, cannot apply; and one copy of the program in memory, not two) and the self-test. All model calls run on one
 * background thread, one at a time; after a completion or the self-test the suggestions forget the cache rows they
 * had (the same program's buffers, written from position 0 again).
 */
public class MainActivity extends Activity {
    static final String PTE = "hrm.kv.pte", TOKENIZER = "tokenizer.json", BUNDLE = "web_bundle.bin",
            PROGRAM = "program.json";
    static final int MAX_NEW_TOKENS = 64;
    /** As the page's: shorter than the gap between a phone typist's keys, so the chips follow every key (a guessed
     *  key's at once), while keys closer together (auto-repeat, a paste) share one run (docs/keyboard.md). */
    static final int SUGGEST_DEBOUNCE_MS = 30;

    private final ExecutorService worker = Executors.newSingleThreadExecutor();
    private final Handler ui = new Handler(Looper.getMainLooper());
    private Module module;
    private volatile Completion completion; // set by load() (after the tokenizer, which complete() reads)
    private volatile boolean stopCompletion;
    private boolean suggesting; // a suggestion run is on the worker (UI thread only)
    private boolean busy; // a completion or the self-test runs: the chips stay off (UI thread only)
    /** The program's precision (copy_artifacts.py's program.json): the Self-test judges it by that one's tolerances. */
    private volatile String precision = "int8";
    private ByteLevelBpe tokenizer;
    /** Set by load(): the suggestions, and the chips of the likeliest next key computed between keys. */
    private volatile Lookahead lookahead;
    private int maxSeqLen;
    private EditText text;
    private TextView status, stats, suggestTime, selftestResult;
    private final Button[] words = new Button[3];

    @Override
    protected void onCreate(Bundle state) {
        super.onCreate(state);
        setContentView(R.layout.activity_main);
        text = findViewById(R.id.text);
        status = findViewById(R.id.status);
        stats = findViewById(R.id.stats);
        suggestTime = findViewById(R.id.suggestTime);
        selftestResult = findViewById(R.id.selftestResult);
        words[0] = findViewById(R.id.word0);
        words[1] = findViewById(R.id.word1);
        words[2] = findViewById(R.id.word2);
        findViewById(R.id.complete).setOnClickListener(v -> complete());
        findViewById(R.id.stop).setOnClickListener(v -> stopCompletion = true);
        findViewById(R.id.selftest).setOnClickListener(v -> selfTest());
        text.addTextChangedListener(new TextWatcher() {
            @Override public void beforeTextChanged(CharSequence s, int a, int b, int c) {}
            @Override public void onTextChanged(CharSequence s, int a, int b, int c) {}
            @Override public void afterTextChanged(Editable s) {
                if (lookahead != null) lookahead.keyTyped(); // the work ahead stops before its next model call
                ui.removeCallbacks(suggestRunnable);
                ui.postDelayed(suggestRunnable, SUGGEST_DEBOUNCE_MS);
            }
        });
        worker.execute(this::load);
    }

    /** ExecuTorch opens files by path: copy the assets (copy_artifacts.py put them there) into app storage. */
    private File asset(String name) throws IOException {
        File out = new File(getFilesDir(), name);
        try (InputStream in = getAssets().open(name); FileOutputStream os = new FileOutputStream(out)) {
            byte[] buf = new byte[1 << 16];
            for (int n; (n = in.read(buf)) > 0; ) os.write(buf, 0, n);
        }
        return out;
    }

    private void load() {
        try {
            File pte = asset(PTE), tok = asset(TOKENIZER), about = asset(PROGRAM);
            asset(BUNDLE);
            precision = (String) Json.object(Json.parse(new String(Files.readAllBytes(about.toPath()), "UTF-8")))
                    .get("precision");
            long t = System.nanoTime();
            module = Module.load(pte.getAbsolutePath());
            maxSeqLen = (int) module.execute("get_max_seq_len")[0].toInt();
            tokenizer = new ByteLevelBpe(new String(Files.readAllBytes(tok.toPath()), "UTF-8"));
            PteStepModel program = new PteStepModel();
            completion = new Completion(program, TokenHealing.vocabBytes(tokenizer), tokenizer.specialId("<|eos|>"));
            lookahead = new Lookahead(program, null, tokenizer);
            long ms = (System.nanoTime() - t) / 1_000_000;
            ui.post(() -> {
                status.setText(precision + " KV program loaded in " + ms + " ms");
                suggestRunnable.run();
            });
        } catch (Exception | LinkageError e) { // LinkageError: Module's native library did not load
            ui.post(() -> status.setText("load failed: " + e));
        }
    }

    /** The KV program through Module: forward(tokens [1, S], input_pos [1]) -> logits [1, S, V]. */
    private final class PteStepModel implements WordSuggester.StepModel {
        @Override
        public float[] forward(int[] tokens, int start) {
            long[] ids = new long[tokens.length];
            for (int i = 0; i < ids.length; i++) ids[i] = tokens[i];
            EValue[] out = module.forward(EValue.from(Tensor.fromBlob(ids, new long[] {1, ids.length})),
                    EValue.from(Tensor.fromBlob(new long[] {start}, new long[] {1})));
            float[] all = out[0].toTensor().getDataAsFloatArray();
            int vocab = all.length / tokens.length;
            return java.util.Arrays.copyOfRange(all, all.length - vocab, all.length);
        }

        @Override
        public int maxSeqLen() {
            return maxSeqLen;
        }
    }

    private String textBeforeCursor() {
        return text.getText().subSequence(0, text.getSelectionStart()).toString();
    }

    /** The chips after the text before the cursor; then, on the same worker, the chips after the likeliest next key
     *  (a key that was guessed shows them at once; any key calls the work off, docs/keyboard.md "Lookahead"). One
     *  run at a time, as the page: a key during a run schedules the next, so no stale runs queue on the worker (a
     *  completion's streamed tokens included), and chips whose text has changed since are not shown. */
    private final Runnable suggestRunnable = () -> {
        if (lookahead == null || worker.isShutdown()) return; // not loaded yet, or the activity is gone
        if (suggesting) {
            ui.postDelayed(this.suggestRunnable, SUGGEST_DEBOUNCE_MS);
            return;
        }
        suggesting = true;
        String before = textBeforeCursor();
        int key = lookahead.keysTyped();
        long t = System.nanoTime(); // the wait for the work ahead's call in flight counts
        worker.execute(() -> {
            Lookahead.Result found;
            try {
                found = lookahead.suggest(before, 3);
            } catch (RuntimeException e) {
                ui.post(() -> { suggesting = false; suggestTime.setText("suggestions failed: " + e); });
                return;
            }
            long ms = (System.nanoTime() - t) / 1_000_000;
            ui.post(() -> {
                suggesting = false;
                // typed on meanwhile: a newer run is due, and these words are not shown
                if (before.equals(textBeforeCursor())) showSuggestions(before, found.words, ms);
            });
            lookahead.ahead(before, found.nextKeys, 3, key); // stops at the next key; failures are the key's to see
        });
    };

    /** The words for the text `before` the cursor: a tap after a key typed since inserts nothing (its insert would
     *  land in a new word). */
    private void showSuggestions(String before, List<WordSuggester.Suggestion> found, long ms) {
        for (int i = 0; i < words.length; i++) {
            WordSuggester.Suggestion w = i < found.size() ? found.get(i) : null;
            words[i].setText(w == null ? "" : w.label);
            words[i].setEnabled(w != null && !busy); // a run in flight when Complete was pressed ends meanwhile
            words[i].setOnClickListener(v -> {
                if (w == null || busy || !before.equals(textBeforeCursor())) return;
                text.getText().insert(text.getSelectionStart(), w.insert);
            });
        }
        suggestTime.setText(ms + " ms");
    }

    /** Streams a completion of the text before the cursor into the box (greedy at temperature 0, as complete). */
    private void complete() {
        if (completion == null) return;
        int cursor = text.getSelectionStart();
        int[] prompt = tokenizer.encode(textBeforeCursor());
        if (prompt.length == 0) {
            stats.setText("type something to complete first");
            return;
        }
        if (lookahead != null) lookahead.keyTyped(); // the work ahead waits: the completion runs on the same worker
        setBusy(true); // the box too: the completion streams into it at `cursor`
        Completion.Settings settings = new Completion.Settings();
        settings.temperature = parseOr(((EditText) findViewById(R.id.temperature)).getText().toString(), 0f);
        settings.maxNewTokens = MAX_NEW_TOKENS;
        stopCompletion = false;
        final int[] shownLength = {0}; // the completion's characters in the box so far
        worker.execute(() -> {
            try {
                Completion.Result r = completion.run(prompt, settings, shown -> ui.post(() -> {
                    text.getText().replace(cursor, Math.min(cursor + shownLength[0], text.getText().length()), shown);
                    shownLength[0] = shown.length();
                }), () -> stopCompletion);
                ui.post(() -> stats.setText(r.summary()));
            } catch (RuntimeException e) {
                ui.post(() -> stats.setText("completion failed: " + e));
            } finally {
                if (lookahead != null) lookahead.forgetCache(); // its rows overwrote the typed text's
                ui.post(() -> setBusy(false));
            }
        });
    }

    /** While a completion or the self-test runs: Complete, Self-test, the text box and the chips wait (Stop does
     *  not); the next suggestion run enables the chips it shows. */
    private void setBusy(boolean busy) {
        this.busy = busy;
        findViewById(R.id.complete).setEnabled(!busy);
        findViewById(R.id.selftest).setEnabled(!busy);
        text.setEnabled(!busy);
        if (busy) for (Button w : words) w.setEnabled(false);
    }

    /** Run the web parity bundle through the program (prefill, then one decode step per token). */
    private void selfTest() {
        if (module == null) return;
        selftestResult.setText("running…");
        if (lookahead != null) lookahead.keyTyped(); // the work ahead waits: the self-test runs on the same worker
        setBusy(true);
        worker.execute(() -> {
            try {
                WebBundle b = WebBundle.read(Files.readAllBytes(new File(getFilesDir(), BUNDLE).toPath()));
                long t = System.nanoTime();
                // the bundle's windows overwrite the cache rows of the typed text
                if (lookahead != null) lookahead.forgetCache();
                float[] logits = runBundle(b);
                ParityMetrics.Result r = ParityMetrics.check(logits, b, precision);
                long ms = (System.nanoTime() - t) / 1_000_000;
                ui.post(() -> selftestResult.setText(String.format(Locale.ROOT,
                        "max abs logit error %.2e (≤ %.2e)%ntop-1 agreement %.4f%nperplexity %.3f / %.3f%n%d positions, %d ms%n%s",
                        r.maxAbsLogitError, r.absLimit, r.top1Agreement, r.perplexity, r.referencePerplexity,
                        r.positions, ms, r.passed ? "PASSED" : "FAILED: " + r.reason)));
            } catch (Exception e) {
                ui.post(() -> selftestResult.setText("self-test could not run: " + e));
            } finally {
                ui.post(() -> setBusy(false));
            }
        });
    }

    private float[] runBundle(WebBundle b) {
        PteStepModel step = new PteStepModel();
        float[] logits = new float[b.samples * b.seqLen * b.vocab];
        for (int w = 0; w < b.samples; w++) {
            int[] inputs = b.inputs(w);
            // the prefill's logits of every position: Module returns [1, S, V]
            long[] prefill = new long[b.prefillLen];
            for (int i = 0; i < prefill.length; i++) prefill[i] = inputs[i];
            float[] all = module.forward(EValue.from(Tensor.fromBlob(prefill, new long[] {1, prefill.length})),
                    EValue.from(Tensor.fromBlob(new long[] {0}, new long[] {1})))[0].toTensor().getDataAsFloatArray();
            System.arraycopy(all, 0, logits, w * b.seqLen * b.vocab, all.length);
            for (int i = b.prefillLen; i < b.seqLen; i++) {
                float[] row = step.forward(new int[] {inputs[i]}, i);
                System.arraycopy(row, 0, logits, (w * b.seqLen + i) * b.vocab, b.vocab);
            }
        }
        return logits;
    }

    private static float parseOr(String s, float fallback) {
        try {
            return Float.parseFloat(s);
        } catch (NumberFormatException e) {
            return fallback;
        }
    }

    @Override
    protected void onDestroy() {
        ui.removeCallbacksAndMessages(null); // a pending suggestion run would hand work to a stopped worker
        stopCompletion = true;
        if (lookahead != null) lookahead.keyTyped(); // the work ahead stops at its next model call
        worker.execute(() -> { // after the run in flight, on the thread that calls the program
            if (module != null) module.destroy();
        });
        worker.shutdown();
        super.onDestroy();
    }
}
