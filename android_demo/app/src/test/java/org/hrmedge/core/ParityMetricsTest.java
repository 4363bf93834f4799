package org.hrmedge.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertTrue;

import org.junit.Test;

public class ParityMetricsTest {
    static final ParityMetrics.Tolerance FP32 = new ParityMetrics.Tolerance(1e-4, 0.999, 1.001);
    // 2 positions, vocabulary 3; next tokens 2 and 0
    static final float[] REF = {0f, 1f, 2f, 3f, 0f, 0f};
    static final int[] TARGETS = {2, 0};

    @Test
    public void identicalLogitsPass() {
        ParityMetrics.Result r = ParityMetrics.compare(REF.clone(), REF, TARGETS, 3, FP32);
        assertTrue(r.reason, r.passed);
        assertEquals(0, r.maxAbsLogitError, 0);
        assertEquals(3, r.logitRange, 0);
        assertEquals(1, r.top1Agreement, 0);
        // by hand: -log softmax([0,1,2])[2] = log(1 + e^-1 + e^-2); -log softmax([3,0,0])[0] = log(1 + 2 e^-3)
        double nll = (Math.log(1 + Math.exp(-1) + Math.exp(-2)) + Math.log(1 + 2 * Math.exp(-3))) / 2;
        assertEquals(Math.exp(nll), r.perplexity, 1e-12);
        assertEquals(r.referencePerplexity, r.perplexity, 0);
    }

    @Test
    public void aFlippedArgmaxAndALargeErrorFail() {
        float[] logits = {0f, 2.5f, 2f, 3f, 0f, 0f};
        ParityMetrics.Result r = ParityMetrics.compare(logits, REF, TARGETS, 3, FP32);
        assertFalse(r.passed);
        assertEquals(1.5, r.maxAbsLogitError, 1e-9);
        assertEquals(0.5, r.top1Agreement, 0);
        assertTrue(r.reason, r.reason.contains("max abs logit error") && r.reason.contains("top-1 agreement 0.5000"));
        assertTrue(r.perplexity > r.referencePerplexity);
    }

    @Test
    public void tiesGoToTheFirstMaximumLikeNumpy() {
        assertEquals(1, ParityMetrics.argmax(new float[] {0f, 5f, 5f}, 0, 3));
        assertEquals(0, ParityMetrics.argmax(new float[] {9f, 9f, 9f, 7f, 7f, 7f}, 1, 3));
    }

    @Test
    public void checkUsesTheBundlesToleranceForThePrecision() {
        WebBundle b = WebBundle.read(WebBundleTest.bundleBytes(REF));
        float[] logits = REF.clone();
        logits[0] += 0.01f; // 0.01 > 1e-4 x range 3, but < 5e-2 x 3
        assertFalse(ParityMetrics.check(logits, b, "fp32").passed);
        assertTrue(ParityMetrics.check(logits, b, "int8").passed);
    }
}
