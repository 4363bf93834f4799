package org.hrmedge.core;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A small JSON reader: objects become {@code Map<String, Object>} (insertion order kept), arrays
 * {@code List<Object>}, numbers {@code Double} (or {@code Long} when integral and written without a
 * fraction or exponent), plus String, Boolean and null. The core has no dependencies (it is compiled with
 * the plain JDK here and runs unchanged on Android), so it cannot use org.json or a library.
 */
public final class Json {
    private final String s;
    private int i;

    private Json(String s) {
        this.s = s;
    }

    public static Object parse(String text) {
        Json p = new Json(text);
        p.skipSpace();
        Object value = p.value();
        p.skipSpace();
        if (p.i != text.length()) throw p.error("trailing characters");
        return value;
    }

    @SuppressWarnings("unchecked")
    public static Map<String, Object> object(Object value) {
        if (!(value instanceof Map)) throw new IllegalArgumentException("not a JSON object: " + value);
        return (Map<String, Object>) value;
    }

    @SuppressWarnings("unchecked")
    public static List<Object> array(Object value) {
        if (!(value instanceof List)) throw new IllegalArgumentException("not a JSON array: " + value);
        return (List<Object>) value;
    }

    public static double number(Object value) {
        if (!(value instanceof Number)) throw new IllegalArgumentException("not a JSON number: " + value);
        return ((Number) value).doubleValue();
    }

    private Object value() {
        if (i >= s.length()) throw error("unexpected end");
        char c = s.charAt(i);
        if (c == '{') return object();
        if (c == '[') return array();
        if (c == '"') return string();
        if (s.startsWith("true", i)) { i += 4; return Boolean.TRUE; }
        if (s.startsWith("false", i)) { i += 5; return Boolean.FALSE; }
        if (s.startsWith("null", i)) { i += 4; return null; }
        return number();
    }

    private Map<String, Object> object() {
        Map<String, Object> map = new LinkedHashMap<>();
        i++; // {
        skipSpace();
        if (peek() == '}') { i++; return map; }
        while (true) {
            skipSpace();
            if (peek() != '"') throw error("expected a key");
            String key = string();
            skipSpace();
            expect(':');
            skipSpace();
            map.put(key, value());
            skipSpace();
            if (peek() == ',') { i++; continue; }
            expect('}');
            return map;
        }
    }

    private List<Object> array() {
        List<Object> list = new ArrayList<>();
        i++; // [
        skipSpace();
        if (peek() == ']') { i++; return list; }
        while (true) {
            skipSpace();
            list.add(value());
            skipSpace();
            if (peek() == ',') { i++; continue; }
            expect(']');
            return list;
        }
    }

    private String string() {
        StringBuilder out = new StringBuilder();
        i++; // opening quote
        while (true) {
            if (i >= s.length()) throw error("unterminated string");
            char c = s.charAt(i++);
            if (c == '"') return out.toString();
            if (c != '\\') { out.append(c); continue; }
            char e = s.charAt(i++);
            switch (e) {
                case 'n': out.append('\n'); break;
                case 't': out.append('\t'); break;
                case 'r': out.append('\r'); break;
                case 'b': out.append('\b'); break;
                case 'f': out.append('\f'); break;
                case 'u': out.append((char) Integer.parseInt(s.substring(i, i + 4), 16)); i += 4; break;
                default: out.append(e); // \" \\ \/
            }
        }
    }

    private Object number() {
        int start = i;
        while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) i++;
        String t = s.substring(start, i);
        if (t.isEmpty()) throw error("unexpected character");
        if (t.matches("-?\\d{1,18}")) return Long.parseLong(t);
        return Double.parseDouble(t);
    }

    private char peek() {
        if (i >= s.length()) throw error("unexpected end");
        return s.charAt(i);
    }

    private void expect(char c) {
        if (peek() != c) throw error("expected '" + c + "'");
        i++;
    }

    private void skipSpace() {
        while (i < s.length() && Character.isWhitespace(s.charAt(i))) i++;
    }

    private IllegalArgumentException error(String what) {
        return new IllegalArgumentException("JSON: " + what + " at character " + i);
    }
}
