package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertThrows;
import static org.junit.Assert.assertTrue;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import org.junit.Test;

public class WebBundleTest {
    /** A bundle laid out like hrm_edge/verify/web_bundle.py writes it: 1 window of 2 tokens, vocabulary 3. */
    static byte[] bundleBytes(float[] logits) {
        String header = "{\"format_version\":1,\"samples\":1,\"seq_len\":2,\"vocab_size\":3,\"prefill_len\":1,"
                + "\"windows\":[[0,2,1]],\"logits_offset\":OFFSET,\"tolerances\":{"
                + "\"fp32_vs_fp32_eager\":{\"rel_max_abs\":0.0001,\"min_top1\":0.999,\"max_ppl_ratio\":1.001},"
                + "\"int8_vs_fp32_eager\":{\"rel_max_abs\":0.05,\"min_top1\":0.97,\"max_ppl_ratio\":1.02}}}";
        int length = header.length() + 3; // "OFFSET" -> 3 digits, below
        length += (4 - (12 + length) % 4) % 4;
        int offset = 12 + length;
        String text = header.replace("OFFSET", String.format("%03d", offset));
        text = text + " ".repeat(length - text.length());
        ByteBuffer buf = ByteBuffer.allocate(offset + 4 * logits.length).order(ByteOrder.LITTLE_ENDIAN);
        buf.put("HRMWEB01".getBytes(StandardCharsets.US_ASCII)).putInt(length).put(text.getBytes(StandardCharsets.UTF_8));
        for (float f : logits) buf.putFloat(f);
        return buf.array();
    }

    @Test
    public void readsHeaderWindowsAndLogits() {
        float[] logits = {1f, 2f, 3f, -1f, 0.5f, 0.25f};
        WebBundle b = WebBundle.read(bundleBytes(logits));
        assertEquals(1, b.samples);
        assertEquals(2, b.seqLen);
        assertEquals(3, b.vocab);
        assertEquals(1, b.prefillLen);
        assertArrayEquals(new int[] {0, 2}, b.inputs(0));
        assertArrayEquals(new int[] {2, 1}, b.targets()[0]);
        assertArrayEquals(logits, b.logits, 0f);
        assertEquals(1e-4, b.tolerance("fp32").relMaxAbs, 0);
        assertEquals(0.97, b.tolerance("int8").minTop1, 0);
        assertEquals(0.97, b.tolerance("int4").minTop1, 0); // a bundle without int4 bounds: the int8 ones
    }

    @Test
    public void refusesACutBundleWithAMessage() {
        byte[] good = bundleBytes(new float[] {1f, 2f, 3f, -1f, 0.5f, 0.25f});
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> WebBundle.read(java.util.Arrays.copyOf(good, good.length - 4)));
        assertTrue(e.getMessage(), e.getMessage().startsWith("web bundle cut short or edited"));
    }

    @Test
    public void rejectsOtherFiles() {
        assertThrows(IllegalArgumentException.class, () -> WebBundle.read("PK\u0003\u0004 not a bundle".getBytes(StandardCharsets.UTF_8)));
    }
}
