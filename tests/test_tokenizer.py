import sysconfig
from pathlib import Path

import pytest
from pytorch_tokenizers import CppHFTokenizer

from hrm_edge.train.tokenizer import EOS, save_tokenizer, train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "  indented\ttabs\r\nand crlf  ",
    "unicode: naïve café — 漢字 🙂\n",
    "",
    "x=[1,2,3]  # comment\n\n\n",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    texts = [(STDLIB / n).read_text() for n in ("textwrap.py", "string.py", "heapq.py", "bisect.py")]
    tok = train_tokenizer(texts, 400)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(tok, path)
    return tok, path, texts


def test_round_trip(trained):
    tok, _, texts = trained
    assert tok.get_vocab_size() == 400
    for s in SAMPLES + [texts[0][:2000]]:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids) == s
    # BPE compresses code: clearly fewer tokens than bytes
    ids = tok.encode(texts[1], add_special_tokens=False).ids
    assert len(ids) < 0.6 * len(texts[1].encode())
    assert tok.token_to_id(EOS) == 1


def test_pytorch_tokenizers_encodes_identically(trained):
    """ExecuTorch's runner tokenizes with pytorch_tokenizers' C++ HF tokenizer: it must agree with ours."""
    tok, path, texts = trained
    cpp = CppHFTokenizer()
    cpp.load(str(path))
    assert cpp.vocab_size() == tok.get_vocab_size()
    for s in SAMPLES[:3] + [SAMPLES[4], texts[2][:3000], (STDLIB / "glob.py").read_text()[:3000]]:
        ours = tok.encode(s, add_special_tokens=False).ids
        theirs = list(cpp.encode(s, 0, 0))
        assert theirs == ours, s[:80]
        assert cpp.decode_batch(ours) == s
    assert cpp.bos_tok() == 0 and cpp.eos_tok() == 1
