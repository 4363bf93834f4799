package org.hrmedge.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertThrows;

import java.util.List;
import java.util.Map;
import org.junit.Test;

public class JsonTest {
    @Test
    public void parsesNestedValues() {
        Map<String, Object> o = Json.object(Json.parse(" {\"a\": [1, -2.5e1, true, null], \"b\": {\"c\": \"x\\ny\\u00e9\"}} "));
        List<Object> a = Json.array(o.get("a"));
        assertEquals(1L, a.get(0));
        assertEquals(-25.0, Json.number(a.get(1)), 0);
        assertEquals(Boolean.TRUE, a.get(2));
        assertNull(a.get(3));
        assertEquals("x\nyé", Json.object(o.get("b")).get("c"));
    }

    @Test
    public void keepsKeyOrderAndEmptyContainers() {
        Map<String, Object> o = Json.object(Json.parse("{\"z\":{},\"a\":[]}"));
        assertEquals(List.of("z", "a"), List.copyOf(o.keySet()));
        assertEquals(0, Json.array(o.get("a")).size());
    }

    @Test
    public void rejectsMalformedText() {
        assertThrows(IllegalArgumentException.class, () -> Json.parse("{\"a\": 1"));
        assertThrows(IllegalArgumentException.class, () -> Json.parse("[1, 2] x"));
        assertThrows(IllegalArgumentException.class, () -> Json.parse("\"open"));
    }
}
