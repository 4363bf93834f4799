package org.hrmedge.core;

import static org.junit.Assert.assertArrayEquals;
import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;

import java.util.Random;
import org.junit.Test;

public class SamplingTest {
    @Test
    public void temperatureZeroIsArgmaxWithFirstMaximum() {
        assertEquals(1, Sampling.sample(new float[] {0f, 3f, 3f, 1f}, 0, 0, new Random(0)));
    }

    @Test
    public void topKOneIsGreedyAndTopKRestrictsTheDraws() {
        float[] logits = {0f, 1f, 2f, 0.5f};
        Random r = new Random(1);
        for (int i = 0; i < 50; i++) assertEquals(2, Sampling.sample(logits, 1.0, 1, r));
        int[] counts = new int[4];
        for (int i = 0; i < 4000; i++) counts[Sampling.sample(logits, 1.0, 2, r)]++;
        assertEquals(0, counts[0] + counts[3]);
        double p2 = Math.exp(2) / (Math.exp(2) + Math.exp(1)); // 0.731
        assertTrue("drew " + counts[2], Math.abs(counts[2] / 4000.0 - p2) < 0.03);
    }

    @Test
    public void repetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOfSeenTokens() {
        float[] logits = {2f, -1f, 0.5f, 3f, 0f};
        assertArrayEquals(new double[] {1.0, -2.0, 0.5, 3.0, 0.0},
                Sampling.penalizeRepetition(logits, new int[] {0, 1, 1, 4}, 2.0), 0.0);
        assertArrayEquals(new double[] {2.0, -1.3, 0.5, 2.3076923076923075, 0.0},
                Sampling.penalizeRepetition(logits, new int[] {3, 1}, 1.3), 1e-15);
        assertArrayEquals(new double[] {2.0, -1.0, 0.5, 3.0, 0.0},
                Sampling.penalizeRepetition(logits, new int[] {0, 3}, 1.0), 0.0);
        assertEquals(0, Sampling.sample(Sampling.penalizeRepetition(logits, new int[] {3}, 2.0), 0, 0, new Random(0)));
    }
}
