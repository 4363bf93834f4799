package org.hrmedge.core;

import static org.junit.Assert.assertEquals;

import org.junit.Test;

public class GenerationStatsTest {
    @Test
    public void parsesExecuTorchStatsJson() {
        // the fields of extension/llm/runner/stats.h stats_to_json_string (executorch 1.4.1)
        String json = "{\"prefill_token_per_sec\":400,\"decode_token_per_sec\":250,\"prompt_tokens\":8,"
                + "\"generated_tokens\":33,\"model_load_start_ms\":100,\"model_load_end_ms\":150,"
                + "\"inference_start_ms\":1000,\"inference_end_ms\":1148,\"prompt_eval_end_ms\":1020,"
                + "\"first_token_ms\":1020,\"aggregate_sampling_time_ms\":3,\"SCALING_FACTOR_UNITS_PER_SECOND\":1000}";
        GenerationStats s = GenerationStats.parse(json);
        assertEquals(8, s.promptTokens);
        assertEquals(33, s.generatedTokens);
        assertEquals(400.0, s.prefillTokensPerS, 1e-9); // 8 tokens in 20 ms
        assertEquals(250.0, s.decodeTokensPerS, 1e-9); // 32 decode steps in 128 ms
        assertEquals(20.0, s.firstTokenMs, 0);
        assertEquals("33 tokens, decode 250 tokens/s, prefill 8 tokens at 400 tokens/s", s.summary());
    }
}
