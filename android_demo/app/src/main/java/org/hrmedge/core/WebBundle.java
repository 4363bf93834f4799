package org.hrmedge.core;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.Map;

/**
 * The web parity bundle written by hrm_edge/verify/web_bundle.py: a few validation windows and their fp32 eager
 * logits. Layout (little-endian): "HRMWEB01", uint32 header length H, H bytes of JSON header, then float32
 * logits [samples, seqLen, vocab] at header.logits_offset.
 */
public final class WebBundle {
    public final Map<String, Object> header;
    public final int samples, seqLen, vocab, prefillLen;
    /** [samples][seqLen + 1]: inputs are [:, :-1], next-token targets [:, 1:]. */
    public final int[][] windows;
    /** [samples * seqLen * vocab], row-major. */
    public final float[] logits;

    private WebBundle(Map<String, Object> header, int[][] windows, float[] logits) {
        this.header = header;
        this.samples = (int) Json.number(header.get("samples"));
        this.seqLen = (int) Json.number(header.get("seq_len"));
        this.vocab = (int) Json.number(header.get("vocab_size"));
        this.prefillLen = (int) Json.number(header.get("prefill_len"));
        this.windows = windows;
        this.logits = logits;
    }

    public static WebBundle read(byte[] data) {
        if (data.length < 12 || !"HRMWEB01".equals(new String(data, 0, 8, StandardCharsets.US_ASCII))) {
            throw new IllegalArgumentException("not a web parity bundle (bad magic)");
        }
        ByteBuffer buf = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
        int headerLength = buf.getInt(8);
        if (headerLength < 0 || headerLength > data.length - 12) {
            throw new IllegalArgumentException("web bundle cut short: its header needs " + headerLength + " bytes");
        }
        Map<String, Object> header = Json.object(Json.parse(new String(data, 12, headerLength, StandardCharsets.UTF_8)));
        if (Json.number(header.get("format_version")) != 1) {
            throw new IllegalArgumentException("unsupported web bundle format " + header.get("format_version"));
        }
        List<Object> rows = Json.array(header.get("windows"));
        int[][] windows = new int[rows.size()][];
        for (int w = 0; w < windows.length; w++) {
            List<Object> row = Json.array(rows.get(w));
            windows[w] = new int[row.size()];
            for (int j = 0; j < row.size(); j++) windows[w][j] = (int) Json.number(row.get(j));
        }
        checkShape(header, windows, data.length, 12 + headerLength);
        int n = (int) (Json.number(header.get("samples")) * Json.number(header.get("seq_len"))
                * Json.number(header.get("vocab_size")));
        float[] logits = new float[n];
        buf.position((int) Json.number(header.get("logits_offset")));
        buf.asFloatBuffer().get(logits);
        return new WebBundle(header, windows, logits);
    }

    /** What does not fit in the header (a cut or edited file) is refused here, not found deep in the self-test (the
     *  same checks as Python's web_bundle.shape_problem). */
    private static void checkShape(Map<String, Object> header, int[][] windows, long size, long headerEnd) {
        double n = Json.number(header.get("samples")), s = Json.number(header.get("seq_len"));
        double v = Json.number(header.get("vocab_size")), p = Json.number(header.get("prefill_len"));
        if (!(n >= 1 && s >= 1 && v >= 1 && p >= 1 && p <= s)) {
            throw new IllegalArgumentException("web bundle: samples, seq_len, vocab_size must be >= 1 and prefill_len"
                    + " in 1..seq_len");
        }
        boolean rows = windows.length == (int) n;
        for (int[] w : windows) {
            rows &= w.length == (int) s + 1;
            for (int t : w) rows &= t >= 0 && t < v;
        }
        if (!rows) {
            throw new IllegalArgumentException("web bundle: windows must be " + (int) n + " rows of " + ((int) s + 1)
                    + " token ids below " + (int) v);
        }
        double offset = Json.number(header.get("logits_offset"));
        if (offset < headerEnd || offset + 4 * n * s * v > size) {
            throw new IllegalArgumentException("web bundle cut short or edited: " + size + " bytes, the header needs "
                    + "logits at " + (long) offset + " for " + (long) (4 * n * s * v) + " bytes");
        }
    }

    /** fp32 programs are held to the fp32 gate; quantized ones to what their quantization may cost against fp32
     *  (int4 to the int4 bounds; a bundle written before it carried them: the int8 ones). */
    public ParityMetrics.Tolerance tolerance(String precision) {
        Map<String, Object> all = Json.object(header.get("tolerances"));
        Object own = all.get(precision + "_vs_fp32_eager");
        Map<String, Object> t = Json.object(own != null ? own : all.get("int8_vs_fp32_eager"));
        return new ParityMetrics.Tolerance(Json.number(t.get("rel_max_abs")), Json.number(t.get("min_top1")),
                Json.number(t.get("max_ppl_ratio")));
    }

    /** The input tokens of window w: its first seqLen tokens. */
    public int[] inputs(int w) {
        return java.util.Arrays.copyOf(windows[w], seqLen);
    }

    /** The next-token targets [samples][seqLen]. */
    public int[][] targets() {
        int[][] t = new int[samples][];
        for (int w = 0; w < samples; w++) t[w] = java.util.Arrays.copyOfRange(windows[w], 1, seqLen + 1);
        return t;
    }
}
