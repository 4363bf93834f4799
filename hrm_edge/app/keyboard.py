"""The suggestion bar measured in a real browser: `python -m hrm_edge.demo EXPORT --keyboard-bench`.

Serves the page as `python -m hrm_edge.demo` does, opens it in headless Chromium at a phone's viewport (one WASM
thread by default, as a phone page without cross-origin isolation gets), and types held-out code one character at a
time through the page's own suggestWords (hrm_edge/app/web/js/suggest.mjs), each key as soon as the last one's chips
are there, or one every --keyboard-interval ms as a typist types, the page's lookahead (lookahead.mjs) computing the
likeliest next keys' chips in between. Reports the time per keystroke (median, p90), top-3 next-word accuracy at word
starts and keystroke savings (keyboard_metrics), the page's memory after the typing (renderer_memory), and checks that
every chip is a whole word. Needs playwright (pip install '.[test]') and Debian's chromium.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.measure.keyboard import spread_texts
from hrm_edge.runtime.suggest import keyboard_metrics
from hrm_edge.train.dataset import heldout_projects

CHROMIUM = "/usr/bin/chromium"
# flags that work for Debian's chromium as root in a container (no sandbox, no GPU, no network chatter)
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PROFILE_INTERVAL_US = 100  # Chromium's sampling profiler: one sample every 0.1 ms
PROFILE_PARTS = 12  # the parts profile_parts names; the rest is one line
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True, "has_touch": True}
# one suggestion call per prefix of each text, in the page, each text from an empty context (the first in the page's
# own); each call's words as [label, insert, probability, ending]. interval > 0: a typist's keys, one every interval
# ms, with the page's lookahead (lookahead.mjs) computing ahead in between; each key's ms from when it was due
TYPE_IN_PAGE = """async ({ texts, interval }) => {
  const { TypedContext, suggestWords } = await import("/app/js/suggest.mjs");
  const { Lookahead, likelyKeys } = await import("/app/js/lookahead.mjs");
  const { state } = window.hrmDemo;
  const { BranchModel, runtimeInfo } = await import("/app/js/model.mjs");
  const typing = state.lookahead.context; // the page's typed context, on the program it loaded (?model=)
  // the program's load: its sessions made (weights fetched, graphs optimized) and run once, from the status line
  const said = /loaded in ([0-9]+) ms/.exec(document.getElementById("status").textContent);
  const loadMs = said ? Number(said[1]) : null;
  // where a keystroke's time goes: each graph's session.run, timed around the original
  let calls = []; // this keystroke's (or the work ahead's): [graph (0: KV, 1: draft or branch), rows, tokens a row, ms]
  const timed = (kvModel, graph) => {
    if (!kvModel) return;
    const run = kvModel.session.run.bind(kvModel.session);
    kvModel.session.run = async (feeds, fetches) => {
      const t = performance.now();
      try { return await run(feeds, fetches); } finally {
        calls.push([graph, ...feeds.tokens.dims, performance.now() - t]);
      }
    };
  };
  timed(typing.model, 0);
  timed(typing.draft, 1);
  const typed = [], sleep = (ms) => new Promise((done) => setTimeout(done, ms));
  let aheadCalls = 0; // graph calls of the work ahead that no key waited for
  for (const [k, text] of texts.entries()) {
    const context = k === 0 ? typing : new TypedContext(typing.model, typing.draft);
    const look = interval > 0 ? new Lookahead(context, state.tokenizer) : null;
    const steps = [{ ms: 0, words: [], calls: [], ahead: false }]; // nothing is suggested before the first key
    let due = performance.now();
    const chars = Array.from(text); // one key a code point, as Python's keyboard_metrics indexes the text
    for (let i = 1; i < chars.length; i++) {
      const before = chars.slice(0, i).join("");
      if (interval > 0) await sleep(due - performance.now());
      aheadCalls += calls.length;
      calls = [];
      const r = interval > 0 ? await look.suggest(before, 3) : await suggestWords(context, state.tokenizer, before, 3);
      const ms = interval > 0 ? performance.now() - due : r.ms;
      steps.push({ ms, words: r.words.map((w) => [w.label, w.insert, w.probability, w.ending]), calls,
                   ahead: r.ahead ?? false });
      calls = [];
      if (interval > 0) {
        look.start(before, likelyKeys(look.context, state.tokenizer, before, r.words));
        due = Math.max(due + interval, performance.now());
      }
    }
    await look?.stop();
    typed.push(steps);
  }
  aheadCalls += calls.length;
  return { typed, aheadCalls, loadMs, model: state.modelInfo.id, userAgent: navigator.userAgent,
           extender: typing.draft === null ? "full depth" : typing.draft instanceof BranchModel ? "branch"
             : "draft", threads: runtimeInfo().threads };
}"""


def heldout_text(chars: int) -> str:
    """The first `chars` characters of the first validation document (hrm_edge.train.dataset.heldout_projects, in
    sorted order) that holds at least that many, else of the longest: a short first file (an __init__.py of
    imports) would measure the bar on a few words."""
    projects = heldout_projects()
    texts = [text for name in sorted(projects) for _, text in projects[name]]
    if not texts:
        raise UserError("the built corpus has no validation documents")
    return next((t for t in texts if len(t) >= chars), max(texts, key=len))[:chars]


def heldout_pieces(chars: int) -> list[str]:
    """About `chars` characters of each validation project (in sorted order), in pieces from the middles of equal
    stretches of its files, as `python -m hrm_edge.evaluate --keyboard` types them (spread_texts)."""
    projects = heldout_projects()
    if not projects:
        raise UserError("the built corpus has no validation documents")
    return [piece for name in sorted(projects) for piece in spread_texts([t for _, t in projects[name]], chars)]


@dataclass(frozen=True)
class BenchSettings:
    """How browser_keyboard_bench types. model: which of the page's programs it loads (?model=, an artifact id such
    as hrm.fp32.kv.onnx; None: its default). threads: WASM threads. draft: the chains on the branch (else draft) graph
    where the export has one (False: on the full depth). interval_ms > 0: a key every interval_ms, the page's
    lookahead computing ahead in between; 0: a key as soon as the last is done. cpu_slowdown > 1: Chromium's CPU
    throttling slows the page's main thread that many times from before the page loads (DevTools' setting,
    Emulation.setCPUThrottlingRate): an estimate of a slower CPU, such as a phone's, not a measurement of one;
    onnxruntime-web's worker threads are not slowed, so it is for one WASM thread. profile: Chromium's sampling
    profiler runs over the typing (profile_parts; it slows the page, by a third on 2026-12-06: its times are not
    the bench's)."""
    model: str | None = None
    threads: int = 1
    draft: bool = True
    interval_ms: float = 0
    cpu_slowdown: float = 1
    profile: bool = False


def browser_keyboard_bench(url: str, texts: list[str], settings: BenchSettings = BenchSettings()) -> dict:
    """Type each of `texts` (from an empty context) in the page served at `url` as `settings` say, and return
    keyboard_metrics over all texts plus median_ms / p90_ms / p99_ms / max_ms per keystroke, where the time went
    (time_split, call_costs), the chips after each prefix of each text, the program, what extended the words
    (extender: "branch", "draft" or "full depth"), the threads and the browser. With an interval: ahead, the share of
    keys the lookahead had computed, and ahead_calls, its other graph calls a key. load_ms: how long the program took
    to load (its sessions made and run once; None if the page did not say). profile: profile_parts of the typing
    (None unless settings.profile). memory: renderer_memory after the typing and a garbage collection, with
    blank_anon_mb, the private memory of a blank page's renderer in the same browser before (nan if unread), and
    js_heap_mb, what V8's heap holds (onnxruntime-web's WASM memory not included) (None where /proc cannot be read)."""
    try:
        from playwright.sync_api import Error as PlaywrightError, TimeoutError as PlaywrightTimeout, sync_playwright
    except ImportError:
        raise UserError("the keyboard bench drives a browser with playwright: pip install '.[test]'") from None
    if not Path(CHROMIUM).is_file():
        raise UserError(f"{CHROMIUM} not found: apt-get install chromium (python -m hrm_edge.sysdeps does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(**PHONE)
        cdp = page.context.new_cdp_session(page)
        if settings.cpu_slowdown != 1:
            cdp.send("Emulation.setCPUThrottlingRate", {"rate": settings.cpu_slowdown})
        processes = browser.new_browser_cdp_session()
        page.goto("about:blank")  # the renderer's memory before the page: Chromium's own
        blank = renderer_memory(processes.send("SystemInfo.getProcessInfo")["processInfo"])
        page.goto(url + f"?threads={settings.threads}" + ("" if settings.draft else "&draft=0")
                  + (f"&model={quote(settings.model)}" if settings.model else ""))
        try:
            page.wait_for_function("(s => s.dataset.ready === '1' || s.classList.contains('error'))"
                                   "(document.getElementById('status'))", timeout=120_000)
        except PlaywrightTimeout:
            raise UserError(f"the page did not load its program in 120 s ({page.inner_text('#status')})") from None
        if page.get_attribute("#status", "data-ready") != "1":
            raise UserError(f"the page could not load its program: {page.inner_text('#status')}")
        if settings.model and page.get_attribute("#status", "data-model") != settings.model:
            raise UserError(f"the page loaded {page.get_attribute('#status', 'data-model')}, not {settings.model}")
        if settings.profile:
            cdp.send("Profiler.enable")
            cdp.send("Profiler.setSamplingInterval", {"interval": PROFILE_INTERVAL_US})
            cdp.send("Profiler.start")
        try:
            out = page.evaluate(TYPE_IN_PAGE, {"texts": texts, "interval": settings.interval_ms})
        except PlaywrightError as e:
            raise UserError(f"the page could not type with {page.get_attribute('#status', 'data-model')}: "
                            f"{e.message.splitlines()[0]}") from None
        profile = profile_parts(cdp.send("Profiler.stop")["profile"]) if settings.profile else None
        cdp.send("HeapProfiler.collectGarbage")  # what the page still holds, not garbage V8 has yet to collect
        memory = renderer_memory(processes.send("SystemInfo.getProcessInfo")["processInfo"])
        if memory:
            memory["js_heap_mb"] = cdp.send("Runtime.getHeapUsage")["usedSize"] / 2**20  # V8's objects, WASM not
            memory["blank_anon_mb"] = blank["anon_mb"] if blank else float("nan")
        browser.close()
    steps = [s for typed in out["typed"] for s in typed[1:]]  # every keystroke of every text
    ms = np.array([s["ms"] for s in steps])
    chips = [[s["words"] for s in typed] for typed in out["typed"]]
    calls = [s["calls"] for s in steps]
    metrics = combined_metrics([keyboard_metrics(text, c) for text, c in zip(texts, chips)])
    return {**metrics, "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
            "time": time_split(ms, np.array([runs_of(c) for c in calls])), "calls": call_costs(calls),
            "browser": out["userAgent"], "model": out["model"], "extender": out["extender"], "threads": out["threads"],
            "texts": len(texts), "chips": chips, "interval_ms": settings.interval_ms,
            "ahead": float(np.mean([s["ahead"] for s in steps])), "ahead_calls": out["aheadCalls"] / len(steps),
            "load_ms": out["loadMs"], "cpu_slowdown": settings.cpu_slowdown, "profile": profile, "memory": memory}


def renderer_memory(processes: list[dict]) -> dict | None:
    """A page's memory, from Linux's /proc: of Chromium's renderer processes (CDP SystemInfo.getProcessInfo's, type
    "renderer") the one with the largest resident set, which is the open page's:
    {"rss_mb": its resident set (Chromium's own code included), "anon_mb": its private anonymous memory (V8's heap and
    the WASM memory, where onnxruntime-web holds the sessions' weights, caches and buffers), "peak_mb": its largest
    resident set}; None where /proc cannot be read."""
    found = []
    for pid in (p["id"] for p in processes if p["type"] == "renderer"):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        kib = {key: int(fields[key].split()[0]) for key in ("VmRSS", "RssAnon", "VmHWM") if key in fields}
        if len(kib) == 3:
            found.append({"rss_mb": kib["VmRSS"] / 1024, "anon_mb": kib["RssAnon"] / 1024,
                          "peak_mb": kib["VmHWM"] / 1024})
    return max(found, key=lambda m: m["rss_mb"], default=None)


def profile_parts(profile: dict) -> list[tuple[str, float]]:
    """Where the sampled time went, from a Chromium CPU profile (Profiler.stop's `profile`: nodes, samples,
    timeDeltas in us): [(part, ms)], largest first, the idle time left out. A part is a JS function with its file
    and line (`probabilities (suggest.mjs:163)`), all of onnxruntime's WASM code as one (its functions are unnamed:
    `onnxruntime-web's WASM (its kernels)`), or Chromium's own ((program), (garbage collector)); past PROFILE_PARTS,
    the rest as one part."""
    node_ms: Counter = Counter()
    for node, delta in zip(profile["samples"], profile["timeDeltas"][1:] + [0]):  # a sample lasts until the next
        node_ms[node] += delta / 1000
    parts: Counter = Counter()
    for node in profile["nodes"]:
        frame = node["callFrame"]
        name, file = frame["functionName"] or "(anonymous)", frame["url"].rsplit("/", 1)[-1]
        if name == "(idle)" or node_ms[node["id"]] == 0:
            continue
        part = ("onnxruntime-web's WASM (its kernels)" if file.endswith(".wasm")
                else f"{name} ({file}:{frame['lineNumber'] + 1})" if file else name)
        parts[part] += node_ms[node["id"]]
    ranked = parts.most_common()
    rest = sum(ms for _, ms in ranked[PROFILE_PARTS:])
    return ranked[:PROFILE_PARTS] + ([("the rest", rest)] if rest else [])


def combined_metrics(metrics: list[dict]) -> dict:
    """keyboard_metrics of several texts as one: top-3 accuracy over all their word starts, savings over all their
    characters."""
    chars, starts = sum(m["characters"] for m in metrics), sum(m["word_starts"] for m in metrics)
    hits = sum(m["top3_word_accuracy"] * m["word_starts"] for m in metrics)
    keys = sum((1 - m["keystroke_savings"]) * m["characters"] for m in metrics)
    return {"characters": chars, "word_starts": starts, "top3_word_accuracy": hits / max(starts, 1),
            "keystroke_savings": 1 - keys / max(chars, 1), "partial_chips": sum(m["partial_chips"] for m in metrics)}


def runs_of(calls: list) -> list:
    """A keystroke's graph calls [[graph (0: KV, 1: draft or branch), rows, tokens a row, ms]] -> [KV calls, their ms,
    draft calls, their ms]."""
    return [sum(1 for c in calls if c[0] == 0), sum(c[3] for c in calls if c[0] == 0),
            sum(1 for c in calls if c[0] == 1), sum(c[3] for c in calls if c[0] == 1)]


def call_costs(calls: list[list]) -> dict:
    """What one graph call cost, from every keystroke's calls (as runs_of reads them): {"kv": {tokens: [calls, median
    ms]} with tokens "1", "2-8" and ">8" (a context run again from its start, as when the window drops a block),
    "draft": {rows: [calls, median ms]} (one token a row)}."""
    kv, draft = {}, {}
    for graph, rows, tokens, ms in (c for keystroke in calls for c in keystroke):
        if graph == 0:
            kv.setdefault("1" if tokens == 1 else "2-8" if tokens <= 8 else ">8", []).append(ms)
        else:
            draft.setdefault(rows, []).append(ms)

    def summary(groups):
        return {k: [len(v), float(np.median(v))] for k, v in sorted(groups.items())}

    return {"kv": summary(kv), "draft": summary(draft)}


def time_split(ms: np.ndarray, runs: np.ndarray) -> dict:
    """Where the keystrokes' time went: ms [K] per keystroke, runs [K, 4] (KV graph calls, their ms, draft graph
    calls, their ms). Shares of the total time, calls per keystroke (mean, p90), and the same over the slowest tenth
    of keystrokes (those at or above the p90), which set the p90."""
    calls = runs[:, 0] + runs[:, 2]
    slow = ms >= np.percentile(ms, 90)

    def split(rows):
        total = max(float(ms[rows].sum()), 1e-9)
        return {"kv_share": float(runs[rows, 1].sum()) / total, "draft_share": float(runs[rows, 3].sum()) / total,
                "calls_mean": float(calls[rows].mean()), "ms_mean": float(ms[rows].mean())}

    return {"all": split(np.ones(len(ms), bool)), "slowest_tenth": split(slow),
            "calls_p90": float(np.percentile(calls, 90))}

