"""The suggestion bar measured in a real browser: `python -m hrm_edge.demo EXPORT --keyboard-bench`.

Serves the page as `python -m hrm_edge.demo` does, opens it in headless Chromium at a phone's viewport (one WASM
thread by default, as a phone page without cross-origin isolation gets), and types held-out code one character at a
time through the page's own suggestWords (hrm_edge/app/web/js/suggest.mjs). Reports the time per keystroke (median,
p90), top-3 next-word accuracy at word starts and keystroke savings (keyboard_metrics), and checks that every
chip is a whole word. Needs playwright (pip install '.[test]') and Debian's chromium.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hrm_edge.errors import UserError
from hrm_edge.runtime.suggest import keyboard_metrics

CHROMIUM = "/usr/bin/chromium"
# flags that work for Debian's chromium as root in a container (no sandbox, no GPU, no network chatter)
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 2, "is_mobile": True, "has_touch": True}
# one suggestion call per prefix of the text, in the page; each call's words as [label, insert, probability, ending]
TYPE_IN_PAGE = """async ({ text, model, draft }) => {
  const { TypedContext, suggestWords } = await import("/app/js/suggest.mjs");
  const { state } = window.hrmDemo;
  const { BranchModel, KvModel, runtimeInfo } = await import("/app/js/model.mjs");
  if (model) { // another of the page's programs, loaded as the page loads it
    const info = state.config.models.find((m) => m.id === model), n = state.config.max_seq_len;
    const extender = !draft ? null : info.branch_url ? await BranchModel.load(info.branch_url, n)
      : info.draft_url ? await KvModel.load(info.draft_url, n) : null;
    state.context = new TypedContext(await KvModel.load(info.url, n), extender);
  }
  // where a keystroke's time goes: each graph's session.run, timed around the original
  const spent = { kv: [0, 0], draft: [0, 0] }; // [calls, ms]
  const timed = (kvModel, key) => {
    if (!kvModel) return;
    const run = kvModel.session.run.bind(kvModel.session);
    kvModel.session.run = async (feeds, fetches) => {
      const t = performance.now();
      try { return await run(feeds, fetches); } finally { spent[key][0] += 1; spent[key][1] += performance.now() - t; }
    };
  };
  timed(state.context.model, "kv");
  timed(state.context.draft, "draft");
  const steps = [{ ms: 0, words: [], runs: [0, 0, 0, 0] }]; // nothing is suggested before the first key
  for (let i = 1; i < text.length; i++) {
    spent.kv = [0, 0]; spent.draft = [0, 0];
    const r = await suggestWords(state.context, state.tokenizer, text.slice(0, i), 3);
    steps.push({ ms: r.ms, words: r.words.map((w) => [w.label, w.insert, w.probability, w.ending]),
                 runs: [...spent.kv, ...spent.draft] }); // [KV calls, KV ms, draft calls, draft ms]
  }
  return { steps, model: model ?? state.modelInfo.id, userAgent: navigator.userAgent,
           extender: state.context.draft === null ? "full depth" : state.context.draft instanceof BranchModel ? "branch"
             : "draft", threads: runtimeInfo().threads };
}"""


def heldout_text(chars: int) -> str:
    """The first `chars` characters of the first validation document (hrm_edge.train.dataset.heldout_projects, in
    sorted order) that holds at least that many, else of the longest: a short first file (an __init__.py of
    imports) would measure the bar on a few words."""
    from hrm_edge.train.dataset import heldout_projects

    projects = heldout_projects()
    texts = [text for name in sorted(projects) for _, text in projects[name]]
    if not texts:
        raise UserError("the built corpus has no validation documents")
    return next((t for t in texts if len(t) >= chars), max(texts, key=len))[:chars]


def browser_keyboard_bench(url: str, text: str, model: str | None = None, threads: int = 1, draft: bool = True) -> dict:
    """Type `text` in the page served at `url` (its default program, or `model`: an artifact id such as
    hrm.fp32.kv.onnx) on `threads` WASM threads, the chains on the branch (else draft) graph where the export has
    one (draft False: on the full depth), and return keyboard_metrics plus median_ms / p90_ms per keystroke, the
    chips after each prefix of the text, the program, what extended the words (extender: "branch", "draft" or "full
    depth"), the threads and the browser."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise UserError("the keyboard bench drives a browser with playwright: pip install '.[test]'") from None
    if not Path(CHROMIUM).is_file():
        raise UserError(f"{CHROMIUM} not found: apt-get install chromium (python -m hrm_edge.sysdeps does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(**PHONE)
        page.goto(url + f"?threads={threads}" + ("" if draft else "&draft=0"))
        page.wait_for_function("document.getElementById('status').dataset.ready === '1'", timeout=120_000)
        out = page.evaluate(TYPE_IN_PAGE, {"text": text, "model": model, "draft": draft})
        browser.close()
    ms = np.array([s["ms"] for s in out["steps"][1:]])
    chips = [s["words"] for s in out["steps"]]
    return {**keyboard_metrics(text, chips), "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "time": time_split(ms, np.array([s["runs"] for s in out["steps"][1:]])),
            "browser": out["userAgent"], "model": out["model"], "extender": out["extender"], "threads": out["threads"],
            "chips": chips}


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

