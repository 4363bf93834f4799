package org.hrmedge.core;

import java.util.Locale;
import java.util.Map;

/**
 * ExecuTorch's LlmCallback.onStats(json) (extension/llm/runner/stats.h, executorch 1.4.1): times in ms since
 * an arbitrary origin, token counts, and SCALING_FACTOR_UNITS_PER_SECOND (1000). Decode speed is computed
 * here like hrm_edge.runtime.decoders.Generation: the first new token comes from the prefill, so
 * (generated - 1) / (inference_end - first_token).
 */
public final class GenerationStats {
    public final long promptTokens, generatedTokens;
    public final double prefillTokensPerS, decodeTokensPerS, firstTokenMs;

    private GenerationStats(long prompt, long generated, double prefill, double decode, double firstTokenMs) {
        this.promptTokens = prompt;
        this.generatedTokens = generated;
        this.prefillTokensPerS = prefill;
        this.decodeTokensPerS = decode;
        this.firstTokenMs = firstTokenMs;
    }

    public static GenerationStats parse(String json) {
        Map<String, Object> s = Json.object(Json.parse(json));
        double unit = s.containsKey("SCALING_FACTOR_UNITS_PER_SECOND") ? Json.number(s.get("SCALING_FACTOR_UNITS_PER_SECOND")) : 1000;
        long prompt = (long) Json.number(s.get("prompt_tokens"));
        long generated = (long) Json.number(s.get("generated_tokens"));
        double start = Json.number(s.get("inference_start_ms"));
        double promptEnd = Json.number(s.get("prompt_eval_end_ms"));
        double firstToken = Json.number(s.get("first_token_ms"));
        double end = Json.number(s.get("inference_end_ms"));
        double prefill = promptEnd > start ? prompt / ((promptEnd - start) / unit) : 0;
        double decode = end > firstToken && generated > 1 ? (generated - 1) / ((end - firstToken) / unit) : 0;
        return new GenerationStats(prompt, generated, prefill, decode, firstToken - start);
    }

    public String summary() {
        return String.format(Locale.ROOT, "%d tokens, decode %.0f tokens/s, prefill %d tokens at %.0f tokens/s",
                generatedTokens, decodeTokensPerS, promptTokens, prefillTokensPerS);
    }
}
