"""User corpus folders keep the per-file hash split; a stray record.json does not make one a built corpus."""
import hashlib

from hrm_edge.config import DataConfig
from hrm_edge.train.dataset import document_order, load_corpus


def expected_split(name: str, cfg: DataConfig) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return "val" if bucket < cfg.val_percent else "calib" if bucket < cfg.val_percent + cfg.calib_percent else "train"


def test_user_folder_split_by_file_hash(tmp_path):
    """50 files of one line each (>= MIN_DOCUMENTS is not reached, so they are cut into pieces: one piece
    each here, named NAME#0), each in the split its name's hash gives, and a byte cap keeps files in
    hash order."""
    folder = tmp_path / "c"
    folder.mkdir()
    texts = {f"f{i:03d}.py": f"x_{i} = {i} * 7  # file {i}\n" for i in range(50)}
    for name, text in texts.items():
        (folder / name).write_text(text)
    (folder / "record.json").write_text('{"format": "something else"}')  # a user file, not a built corpus
    texts["record.json"] = '{"format": "something else"}'
    cfg = DataConfig(corpus=str(folder), val_percent=20, calib_percent=20)
    corpus = load_corpus(cfg, required_splits=())
    for split in ("train", "val", "calib"):
        want = sorted(t for n, t in texts.items() if expected_split(f"{n}#0", cfg) == split)
        assert sorted(corpus.split(split)) == want, split
    assert corpus.source == str(folder)

    cap = sum(len(t) for t in list(texts.values())[:10])
    capped = load_corpus(DataConfig(corpus=str(folder), max_corpus_bytes=cap), required_splits=())
    kept = sorted(capped.train + capped.val + capped.calib)
    order = sorted(texts, key=document_order)
    greedy, total = [], 0
    for name in order:
        if total + len(texts[name]) <= cap or not greedy:
            greedy.append(texts[name])
            total += len(texts[name])
    assert kept == sorted(greedy) and 0 < total <= cap
