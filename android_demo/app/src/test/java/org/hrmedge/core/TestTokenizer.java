package org.hrmedge.core;

/** A tiny byte-level BPE tokenizer.json for the tests: the letters a b c, space, "(", and two merges. */
final class TestTokenizer {
    private TestTokenizer() {}

    static final String JSON = "{\"added_tokens\":[{\"id\":0,\"content\":\"<|bos|>\",\"special\":true},"
            + "{\"id\":1,\"content\":\"<|eos|>\",\"special\":true}],"
            + "\"model\":{\"type\":\"BPE\",\"vocab\":{\"\\u0120\":2,\"a\":3,\"b\":4,\"c\":5,\"\\u0120a\":6,\"\\u0120b\":7,\"(\":8},"
            + "\"merges\":[[\"\\u0120\",\"a\"],\"\\u0120 b\"]}}";

    static ByteLevelBpe load() {
        return new ByteLevelBpe(JSON);
    }
}
